import pytest

from batchd.core import CostModel, Sample, loss_scale, max_fitting_length


def test_sample_defaults_and_round_trip():
    s = Sample(7, 100)
    assert s.loss_tokens == 100 and s.home_rank == 0
    t = Sample(8, 50, 20, 3, (("text", 10), ("vision", 40)))
    assert Sample.from_json(t.to_json()) == t
    assert Sample.from_json(s.to_json()) == s


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(id=-1, length=5), "id"),
        (dict(id=1, length=0), "length"),
        (dict(id=1, length=5, loss_tokens=6), "loss_tokens"),
        (dict(id=1, length=True), "length"),
        (dict(id="3", length=5), "id"),
        (dict(id=1, length=5, modality_tokens=(("v", -1),)), "modality_tokens"),
    ],
)
def test_sample_rejects_bad_values_by_name(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        Sample(**kwargs)


def test_cost_models():
    padded, packed, attn = CostModel("padded"), CostModel("packed"), CostModel("attention", quadratic=100)
    assert padded.cost([3, 5, 1]) == 15
    assert packed.cost([3, 5, 1]) == 9
    assert attn.cost([10, 20]) == 10 + 1 + 20 + 4
    assert padded.materialized_tokens([3, 5]) == 10 and packed.materialized_tokens([3, 5]) == 8
    assert padded.quality([100, 100], 250) == 1.0  # floor(250/100)=2 rows of 100: full
    assert padded.quality([100], 250) == 0.5
    assert padded.quality([300], 250) == 1.0  # lone over-budget sample
    with pytest.raises(ValueError, match="cost"):
        CostModel("quadratic")


@pytest.mark.parametrize("budget", [1, 7, 100, 8192])
@pytest.mark.parametrize("q", [1, 64, 4096])
def test_max_fitting_length_is_the_longest_that_fits(budget, q):
    cost = CostModel("attention", quadratic=q)
    n = max_fitting_length(budget, cost)
    assert n == 1 or cost.item(n) <= budget
    assert cost.item(n + 1) > budget
    assert max_fitting_length(budget, CostModel("padded")) == budget


def test_loss_scale():
    assert loss_scale(10, 40, 4) == 1.0
    assert loss_scale(0, 40, 4) == 0.0
    assert loss_scale(0, 0, 2) == 0.0
    with pytest.raises(ValueError, match="global_tokens"):
        loss_scale(5, 4, 2)
