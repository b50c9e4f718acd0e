"""Collation layouts and their loss equivalence on the tiny model.

Structure: shapes, dtypes, masks, labels, positions and cu_seqlens of `collate_padded`,
`collate_packed` and `idle_batch`; `loss_tokens` counts what the shifted loss sums. Equivalence: on
`TinyCausalLM` a sample's loss is the same alone, right-padded in a batch (attention mask + position
ids) and packed in one row (position restarts), within 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from batchd.client import collate_packed, collate_padded, idle_batch, loss_tokens, token_loss_sum
from batchd.testing import IGNORE_INDEX, TinyCausalLM

VOCAB = 512


def make_sample(seed: int, n: int, prompt: int | None = None, dtype=np.int64) -> dict[str, np.ndarray]:
    """Random token ids; labels mask a prompt of `prompt` tokens (random when None)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, n).astype(dtype)
    labels = ids.astype(np.int64)
    labels[: int(rng.integers(0, n)) if prompt is None else prompt] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=6)


# -- structure ---------------------------------------------------------------------------------------
@given(lengths_st, st.integers(0, 5))
def test_padded_layout(lengths, pad_id):
    samples = [make_sample(i, n) for i, n in enumerate(lengths)]
    batch = collate_padded(samples, pad_id=pad_id)
    b, t = len(lengths), max(lengths)
    assert set(batch) == {"input_ids", "attention_mask", "labels", "position_ids"}
    for v in batch.values():
        assert v.shape == (b, t) and v.dtype == torch.int64
    for row, (s, n) in enumerate(zip(samples, lengths, strict=False)):
        assert batch["input_ids"][row, :n].tolist() == s["input_ids"].tolist()
        assert (batch["input_ids"][row, n:] == pad_id).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (t - n)
        assert batch["labels"][row, :n].tolist() == s["labels"].tolist()
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
        assert batch["position_ids"][row].tolist() == list(range(n)) + [0] * (t - n)
        assert loss_tokens(batch["labels"][row]) == loss_tokens(s["labels"])


@given(lengths_st)
def test_packed_layout(lengths):
    samples = [make_sample(i, n, dtype=np.int32) for i, n in enumerate(lengths)]
    batch = collate_packed(samples)
    s_total = sum(lengths)
    for key in ("input_ids", "labels", "position_ids"):
        assert batch[key].shape == (1, s_total) and batch[key].dtype == torch.int64
    cu = batch["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert batch["max_seqlen"] == max(lengths) and isinstance(batch["max_seqlen"], int)
    for i, s in enumerate(samples):
        lo, hi = int(cu[i]), int(cu[i + 1])
        assert batch["input_ids"][0, lo:hi].tolist() == s["input_ids"].tolist()
        assert batch["position_ids"][0, lo:hi].tolist() == list(range(hi - lo))
        assert batch["labels"][0, lo] == IGNORE_INDEX  # no prediction across the sample boundary
        assert batch["labels"][0, lo + 1 : hi].tolist() == s["labels"][1:].tolist()
    # the packed row carries exactly the per-sample loss tokens
    assert loss_tokens(batch["labels"][0]) == sum(loss_tokens(s["labels"]) for s in samples)
    assert samples[0]["labels"][0] == make_sample(0, lengths[0])["labels"][0]  # inputs not mutated


def test_default_labels_are_shifted_input_ids():
    ids = np.array([5, 6, 7], dtype=np.int32)
    padded = collate_padded([{"input_ids": ids}, {"input_ids": ids[:1]}], pad_id=9)
    assert padded["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100]]
    assert padded["input_ids"].tolist() == [[5, 6, 7], [5, 9, 9]]
    packed = collate_packed([{"input_ids": ids}, {"input_ids": ids, "labels": None}])
    assert packed["labels"].tolist() == [[-100, 6, 7, -100, 6, 7]]
    assert ids.tolist() == [5, 6, 7]


def test_idle_batch():
    batch = idle_batch()
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        "input_ids": (1, 1),
        "attention_mask": (1, 1),
        "labels": (1, 1),
        "position_ids": (1, 1),
    }
    assert batch["labels"].tolist() == [[IGNORE_INDEX]] and batch["attention_mask"].tolist() == [[1]]
    assert loss_tokens(batch["labels"][0]) == 0
    assert idle_batch(pad_id=3)["input_ids"].tolist() == [[3]]


def test_loss_tokens_counts_shifted_targets():
    assert loss_tokens(np.array([1, 2, 3])) == 2  # position 0 is never predicted
    assert loss_tokens(np.array([-100, -100, 4, -100, 5])) == 2
    assert loss_tokens(torch.tensor([7])) == 0
    assert loss_tokens(torch.tensor([-100, 1, 2], dtype=torch.int32)) == 2
    with pytest.raises(ValueError, match="shape"):
        loss_tokens(np.zeros((2, 3), dtype=np.int64))


@pytest.mark.parametrize(
    "samples, match",
    [
        ([], "non-empty"),
        ([{"labels": np.array([1])}], "input_ids"),
        ([{"input_ids": np.array([], dtype=np.int64)}], "non-empty 1-D"),
        ([{"input_ids": np.zeros((2, 2), dtype=np.int64)}], "non-empty 1-D"),
        ([{"input_ids": np.array([1.0, 2.0])}], "integer"),
        ([{"input_ids": np.array([1, 2]), "labels": np.array([1])}], "labels"),
    ],
)
def test_bad_payloads_raise(samples, match):
    for collate in (collate_padded, collate_packed):
        with pytest.raises(ValueError, match=match):
            collate(samples)


def test_bad_pad_id_raises():
    with pytest.raises(ValueError, match="pad_id=-1"):
        collate_padded([{"input_ids": np.array([1])}], pad_id=-1)


# -- loss equivalence on the tiny model -------------------------------------------------------------
@pytest.fixture(scope="module")
def model() -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM(vocab_size=VOCAB).eval()


def per_token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Shifted CE per target position [B, T-1] (0 where the label is -100)."""
    ce = F.cross_entropy(
        logits[:, :-1].transpose(1, 2).float(), labels[:, 1:], ignore_index=IGNORE_INDEX, reduction="none"
    )
    return ce


def alone_means(model: TinyCausalLM, samples) -> list[float]:
    out = []
    for s in samples:
        batch = collate_padded([s])
        loss_sum, n = token_loss_sum(model(batch["input_ids"]), batch["labels"])
        out.append(float(loss_sum) / n)
    return out


def padded_means(model: TinyCausalLM, samples) -> list[float]:
    batch = collate_padded(samples, pad_id=1)
    logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    ce = per_token_ce(logits, batch["labels"])
    return [float(ce[i].sum()) / loss_tokens(s["labels"]) for i, s in enumerate(samples)]


def packed_means(model: TinyCausalLM, samples, varlen: bool = False) -> list[float]:
    batch = collate_packed(samples)
    cu = batch["cu_seqlens"] if varlen else None
    ce = per_token_ce(
        model(batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=cu), batch["labels"]
    )[0]
    cu = batch["cu_seqlens"].tolist()
    # target index j (label j + 1) belongs to the sample whose range holds j + 1
    return [float(ce[cu[i] : cu[i + 1] - 1].sum()) / loss_tokens(s["labels"]) for i, s in enumerate(samples)]


@pytest.mark.parametrize("lengths", [[7], [3, 17, 9], [33, 2, 33, 12, 5], [64, 2, 40]])
@torch.no_grad()
def test_padded_packed_alone_same_loss(model, lengths):
    samples = [make_sample(100 + i, n, prompt=min(i, n - 2)) for i, n in enumerate(lengths)]
    alone = alone_means(model, samples)
    np.testing.assert_allclose(padded_means(model, samples), alone, rtol=0, atol=1e-5)
    np.testing.assert_allclose(packed_means(model, samples), alone, rtol=0, atol=1e-5)
    np.testing.assert_allclose(packed_means(model, samples, varlen=True), alone, rtol=0, atol=1e-5)


@torch.no_grad()
def test_varlen_attention_equals_the_block_diagonal_mask(model):
    samples = [make_sample(7 + i, n) for i, n in enumerate([5, 31, 1, 12])]
    batch = collate_packed(samples)
    dense = model(batch["input_ids"], position_ids=batch["position_ids"])
    varlen = model(batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"])
    torch.testing.assert_close(varlen, dense, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="cu_seqlens must rise strictly"):
        model(batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=torch.tensor([0, 5, 5, 49]))
    padded = collate_padded(samples[:2])
    with pytest.raises(ValueError, match="cu_seqlens must rise strictly"):
        model(
            padded["input_ids"],
            padded["attention_mask"],
            padded["position_ids"],
            cu_seqlens=torch.tensor([0, 5]),
        )


@given(st.lists(st.integers(2, 24), min_size=1, max_size=4), st.integers(0, 10_000))
@torch.no_grad()
def test_padding_does_not_change_a_sample_loss(model, lengths, seed):
    samples = [make_sample(seed + i, n) for i, n in enumerate(lengths)]
    samples = [s for s in samples if loss_tokens(s["labels"])] or [make_sample(seed, 4, prompt=0)]
    np.testing.assert_allclose(padded_means(model, samples), alone_means(model, samples), rtol=0, atol=1e-5)
    np.testing.assert_allclose(packed_means(model, samples), alone_means(model, samples), rtol=0, atol=1e-5)


@torch.no_grad()
def test_packed_samples_do_not_see_each_other(model):
    a, b = make_sample(1, 12), make_sample(2, 9)
    a2 = {"input_ids": (a["input_ids"] + 1) % VOCAB, "labels": a["labels"]}
    logits = [
        model(x["input_ids"], position_ids=x["position_ids"])[0, 12:]
        for x in (collate_packed([a, b]), collate_packed([a2, b]))
    ]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-6)


def test_model_size_and_determinism():
    torch.manual_seed(3)
    m1 = TinyCausalLM()
    torch.manual_seed(3)
    m2 = TinyCausalLM()
    assert m1.num_parameters() == 467_584
    assert TinyCausalLM(tie_embeddings=False).num_parameters() == 533_120
    for p1, p2 in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p1, p2)
    with pytest.raises(ValueError, match="n_heads"):
        TinyCausalLM(d_model=100, n_heads=3)
    with pytest.raises(ValueError, match="n_layers=0"):
        TinyCausalLM(n_layers=0)


def test_vision_tensors_are_concatenated_in_sample_order():
    text = {"input_ids": np.arange(1, 4), "labels": np.arange(1, 4)}
    a = {
        "input_ids": np.arange(1, 6),
        "labels": np.arange(1, 6),
        "pixel_values": np.ones((4, 6), np.float32),
        "image_grid_thw": np.array([[1, 2, 2]]),
    }
    b = {
        "input_ids": np.arange(1, 3),
        "labels": np.arange(1, 3),
        "pixel_values": np.full((8, 6), 2, np.float32),
        "image_grid_thw": np.array([[1, 2, 2], [1, 2, 2]]),
    }
    for batch in (collate_padded([a, text, b]), collate_packed([a, text, b])):
        assert batch["pixel_values"].shape == (12, 6) and batch["pixel_values"].dtype == torch.float32
        assert batch["pixel_values"][:4].eq(1).all() and batch["pixel_values"][4:].eq(2).all()
        assert batch["image_grid_thw"].tolist() == [[1, 2, 2]] * 3
    assert "pixel_values" not in collate_padded([text])


def test_token_type_ids_are_collated_like_input_ids():
    """HF Qwen2-VL's mm_token_type_ids travel per token: padded with 0 (text), packed into the row."""
    a = {
        "input_ids": np.arange(1, 6),
        "labels": np.arange(1, 6),
        "mm_token_type_ids": np.array([0, 1, 1, 0, 0]),
    }
    b = {"input_ids": np.arange(1, 3), "labels": np.arange(1, 3), "mm_token_type_ids": np.array([0, 0])}
    padded = collate_padded([a, b])
    assert padded["mm_token_type_ids"].tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert padded["mm_token_type_ids"].dtype == torch.int64
    packed = collate_packed([b, a])
    assert packed["mm_token_type_ids"].tolist() == [[0, 0, 0, 1, 1, 0, 0]]
    with pytest.raises(ValueError, match="some samples carry it"):
        collate_padded([a, {"input_ids": np.arange(1, 3), "labels": np.arange(1, 3)}])
    with pytest.raises(ValueError, match="shaped like input_ids"):
        collate_packed([{**a, "mm_token_type_ids": np.array([0, 1])}])


def test_two_phase_batch_keeps_the_llm_grids_and_sends_the_pixels_away():
    """A two-phase step's LLM part has no pixels but llm_image_grid_thw: its own images' grids in LLM order
    (M-RoPE needs them); the pixels and grids of the images it encodes come from `collate_images`."""
    from batchd.core import collate_images, image_of, llm_grids, strip_vision

    a = {
        "input_ids": np.arange(1, 6),
        "labels": np.arange(1, 6),
        "pixel_values": np.ones((4, 6), np.float32),
        "image_grid_thw": np.array([[1, 2, 2]]),
    }
    b = {
        "input_ids": np.arange(1, 3),
        "labels": np.arange(1, 3),
        "pixel_values": np.arange(24 * 6, dtype=np.float32).reshape(24, 6),
        "image_grid_thw": np.array([[1, 2, 2], [1, 4, 5]]),
    }
    text = {"input_ids": np.arange(1, 4), "labels": np.arange(1, 4)}
    assert llm_grids([a, text, b])["llm_image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2], [1, 4, 5]]
    assert llm_grids([text]) == {}
    assert all("pixel_values" not in s and "image_grid_thw" not in s for s in strip_vision([a, b]))
    encoded = collate_images([image_of(b, 1), image_of(a, 0)])
    assert encoded["image_grid_thw"].tolist() == [[1, 4, 5], [1, 2, 2]]
    assert np.array_equal(encoded["pixel_values"][:20], b["pixel_values"][4:])
