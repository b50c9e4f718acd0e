"""Two-phase (OrchMLLM) balancing: the pure vision planner's invariants, the exchange's wire form, and the
coordinator -> rank round trip through the simulator."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchd.core import (
    Exchange,
    ImageRef,
    JobSpec,
    Phases,
    PolicySpec,
    Sample,
    Simulator,
    VisionCost,
    exchanged,
    imbalance,
    mean_imbalance,
    plan_vision,
)
from batchd.testing import ACCEPT, SLACKS, phase_loads, plan_vision_round, single_phase, vision_bound
from batchd.testing import vision_greedy as _greedy
from batchd.testing import vision_images as _images
from batchd.testing import vision_place as _place

EPS = 1e-9


@st.composite
def rows(draw, max_ranks=16, max_samples=6, max_images=4):
    """(row, nodes, cost): row[r] = rank r's LLM group; nodes None or one node index per rank."""
    n = draw(st.integers(1, max_ranks))
    ids = itertools.count()
    row = []
    for _ in range(n):
        group = []
        for _ in range(draw(st.integers(0, max_samples))):
            images = tuple(
                draw(st.lists(st.tuples(st.integers(1, 4096), st.integers(1, 1024)), max_size=max_images))
            )
            text = draw(st.integers(0, 64))
            length = max(1, text + sum(t for _, t in images))
            group.append(Sample(next(ids), length, -1, draw(st.integers(0, n - 1)), (), 0, images))
        row.append(group)
    nodes = draw(
        st.one_of(
            st.none(),
            st.integers(1, n).map(lambda k: [r // k for r in range(n)]),
            st.lists(st.integers(0, 3), min_size=n, max_size=n),
        )
    )
    cost = VisionCost(quadratic=draw(st.sampled_from([0, 1024, 8192])))
    return row, nodes, cost


def llm_images(group):
    return [(s.id, k) for s in group for k in range(len(s.images))]


def first_cap(row, nodes, cost):
    """The least of the first `SLACKS` caps (over `vision_bound`) each greedy mode fits under (None: both
    fail, LPT), replayed, but at least `ACCEPT` over the bound (a keep-first plan that close is taken
    without trying the one-pass greedy); a bound on the plan's peak either way."""
    images = _images(row)
    costs = [cost.image(im.patches) for im in images]
    where_node = list(nodes) if nodes is not None else list(range(len(row)))
    floor = vision_bound(costs, len(row))
    order = sorted(range(len(images)), key=lambda i: -costs[i])
    caps = []
    for keep_first in (True, False):
        for slack in SLACKS:
            cap = floor * (1 + slack)
            if _greedy(images, costs, where_node, cap, order, keep_first) is not None:
                caps.append(cap)
                break
    if not caps:
        return None
    return max(min(caps), floor * (1 + ACCEPT)) if len(caps) == 2 else caps[0]


@given(rows())
def test_every_image_is_encoded_once_and_reaches_its_owner(case):
    row, nodes, cost = case
    n = len(row)
    ex = plan_vision(row, cost, nodes)
    assert [e.rank for e in ex] == list(range(n)) and all(e.world_size == n for e in ex)
    encoded = Counter((im.sample_id, im.index) for e in ex for im in e.encode)
    assert encoded == Counter(key for g in row for key in llm_images(g))
    where = {(im.sample_id, im.index): e.rank for e in ex for im in e.encode}
    for group, e in zip(row, ex, strict=True):
        own = llm_images(group)
        assert list(e.sources) == [where[key] for key in own]
        assert list(e.tokens) == [t for s in group for _, t in s.images]
        for im in e.encode:  # refs describe the owner's sample faithfully
            owner_sample = next(s for s in row[im.owner] if s.id == im.sample_id)
            assert owner_sample.images[im.index] == (im.patches, im.tokens)
            assert im.home_rank == owner_sample.home_rank
    for a, b in itertools.product(range(n), repeat=2):
        assert ex[a].send_splits()[b] == ex[b].recv_splits()[a]


@given(rows())
def test_the_all_to_all_delivers_every_embedding_to_its_llm_position(case):
    row, nodes, cost = case
    n = len(row)
    ex = plan_vision(row, cost, nodes)
    # encoder e's output: its images in `encode` order, image i as `tokens` rows tagged (image, row)
    out_by_rank = [[((im.sample_id, im.index), j) for im in e.encode for j in range(im.tokens)] for e in ex]
    received: list[list] = [[] for _ in range(n)]
    for e in range(n):  # all_to_all: contiguous chunks by send_splits, received source by source
        splits = ex[e].send_splits()
        offset = 0
        for o in range(n):
            received[o].append(out_by_rank[e][offset : offset + splits[o]])
            offset += splits[o]
        assert offset == len(out_by_rank[e])
    for o in range(n):
        chunks = received[o]
        assert [len(c) for c in chunks] == ex[o].recv_splits()
        flat = [x for c in chunks for x in c]
        # split the received rows into images (each image's rows are contiguous) and place them
        sizes = [ex[o].tokens[i] for i in ex[o].placement()]
        assert sorted(ex[o].placement()) == list(range(len(ex[o].sources)))
        pieces, offset = [], 0
        for size in sizes:
            pieces.append(flat[offset : offset + size])
            offset += size
        assert offset == len(flat)
        llm = [None] * len(sizes)
        for j, piece in enumerate(pieces):
            llm[ex[o].placement()[j]] = piece
        expect = [
            [(key, j) for j in range(t)] for key, t in zip(llm_images(row[o]), ex[o].tokens, strict=True)
        ]
        assert llm == expect


@given(rows())
def test_max_load_is_within_the_cap_the_greedy_met_and_never_above_single_phase(case):
    row, nodes, cost = case
    loads = phase_loads(plan_vision(row, cost, nodes), cost)
    costs = [cost.image(p) for g in row for s in g for p, _ in s.images]
    if not costs:
        assert max(loads) == 0
        return
    single = max(phase_loads(single_phase(row), cost))
    cap = first_cap(row, nodes, cost)
    if cap is not None:  # the bisection only lowers the cap the plan meets
        assert max(loads) <= cap * (1 + EPS) <= vision_bound(costs, len(row)) * (1 + max(SLACKS)) * (1 + EPS)
    else:  # LPT fallback: 4/3 of the optimum; list scheduling's C/N + max c bounds it without the optimum
        assert max(loads) <= (sum(costs) / len(row) + max(costs)) * (1 + EPS)
    assert max(loads) <= single * (1 + EPS), "two-phase plan costlier than every rank encoding its own"
    assert sum(loads) == pytest.approx(sum(costs))


@given(rows())
def test_an_image_leaves_its_owners_node_only_when_that_node_had_no_room(case):
    """With the greedy's cap B: an image of cost c encoded off its owner's node was spilled when no
    rank of that node had room (load + c > B); loads only grow, so every rank of the owner's node ends
    above B - c. And an image encoded off its owner rank at all: the owner ended above B - c too."""
    row, nodes, cost = case
    images = _images(row)
    if not images:
        return
    where_node = list(nodes) if nodes is not None else list(range(len(row)))
    costs = [cost.image(im.patches) for im in images]
    where, cap = _place(images, costs, where_node)  # the greedy's placement, before the local search
    if cap is None:
        return
    loads = [0.0] * len(row)
    for r, c in zip(where, costs, strict=True):
        loads[r] += c
    for im, r, c in zip(images, where, costs, strict=True):
        if r != im.owner:
            assert loads[im.owner] + c > cap * (1 - EPS)
        if where_node[r] != where_node[im.owner]:
            peers = [q for q in range(len(row)) if where_node[q] == where_node[im.owner]]
            assert all(loads[q] + c > cap * (1 - EPS) for q in peers)


@given(rows())
def test_nothing_moves_when_the_single_phase_plan_meets_the_lower_bound(case):
    row, nodes, cost = case
    single = phase_loads(single_phase(row), cost)
    costs = [cost.image(p) for g in row for s in g for p, _ in s.images]
    if costs and max(single) > vision_bound(costs, len(row)) * (1 + EPS):
        return
    ex = plan_vision(row, cost, nodes)
    assert all(im.owner == e.rank for e in ex for im in e.encode)
    assert exchanged(ex, nodes) == dict.fromkeys(
        ("intra_node_images", "intra_node_rows", "cross_node_images", "cross_node_rows"), 0
    )


def optimum(costs, n):
    """The least max load of any placement (brute force)."""
    best = float("inf")
    for assign in itertools.product(range(n), repeat=len(costs)):
        load = [0.0] * n
        for r, c in zip(assign, costs, strict=True):
            load[r] += c
        best = min(best, max(load))
    return best


@given(st.lists(st.integers(1, 100), min_size=1, max_size=7), st.integers(1, 4))
def test_vision_bound_never_exceeds_the_optimum(costs, n):
    costs = [float(c) for c in costs]
    bound = vision_bound(costs, n)
    assert max(sum(costs) / n, max(costs)) <= bound <= optimum(costs, n) + EPS


def test_vision_bound_by_hand():
    assert vision_bound([], 3) == 0.0
    assert vision_bound([5.0] * 70, 64) == 10.0  # 65 equal images on 64 ranks: one rank encodes two
    assert vision_bound([5.0] * 64, 64) == 5.0
    assert vision_bound([4.0, 3.0, 3.0], 2) == 6.0  # the 3 costliest on 2 ranks: c2 + c3
    with pytest.raises(ValueError, match="n must be >= 1"):
        vision_bound([1.0], 0)


@given(rows())
def test_two_phase_plan_respects_the_lower_bound(case):
    row, nodes, cost = case
    costs = [cost.image(p) for g in row for s in g for p, _ in s.images]
    assert max(phase_loads(plan_vision(row, cost, nodes), cost)) >= vision_bound(costs, len(row)) * (1 - EPS)


def test_cross_node_exchange_counts_by_hand():
    cost = VisionCost(quadratic=0)
    # rank 0 owns four equal images, ranks 1..3 none; nodes {0, 1} and {2, 3}: floor = 1 image per rank
    row = [[Sample(0, 40, images=((10, 10),) * 4)], [], [], []]
    ex = plan_vision(row, cost, [0, 0, 1, 1])
    assert phase_loads(ex, cost) == [10.0] * 4
    assert exchanged(ex, [0, 0, 1, 1]) == {
        "intra_node_images": 1,
        "intra_node_rows": 10,
        "cross_node_images": 2,
        "cross_node_rows": 20,
    }
    assert ex[0].sources == (0, 1, 2, 3) and ex[0].recv_splits() == [10, 10, 10, 10]
    assert imbalance(phase_loads(single_phase(row), cost)) == pytest.approx(4.0)


@given(st.integers(1, 16), st.integers(0, 6), st.booleans())
def test_an_image_free_row_gives_empty_exchanges(n, samples, with_nodes):
    row = [[Sample(r * 10 + i, 5) for i in range(samples)] for r in range(n)]
    ex = plan_vision(row, VisionCost(), [r // 2 for r in range(n)] if with_nodes else None)
    assert all(e.empty and e.send_splits() == [0] * n and e.placement() == [] for e in ex)
    assert all(e.empty for e in single_phase(row))
    assert imbalance(phase_loads(ex, VisionCost())) is None


@given(rows(max_ranks=6))
def test_exchange_and_imageref_json_round_trip(case):
    row, nodes, cost = case
    for e in plan_vision(row, cost, nodes):
        assert Exchange.from_json(json.loads(json.dumps(e.to_json()))) == e
        for im in e.encode:
            assert ImageRef.from_json(json.loads(json.dumps(im.to_json()))) == im


def test_plan_vision_round_is_per_step_plan_vision():
    a = [Sample(0, 10, images=((100, 4),)), Sample(1, 10, images=((900, 9), (50, 1)))]
    plan = [[a, []], [[], [Sample(2, 3, images=((5, 3),))]]]
    vision = plan_vision_round(plan, VisionCost())
    for s in range(2):
        assert [vision[r][s] for r in range(2)] == plan_vision([plan[r][s] for r in range(2)], VisionCost())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rank": 2, "world_size": 2}, "rank must be <= 1"),
        ({"rank": 0, "world_size": 0}, "world_size must be >= 1"),
        ({"rank": 0, "world_size": 2, "sources": (0,), "tokens": ()}, "one entry per image"),
        ({"rank": 0, "world_size": 2, "sources": (2,), "tokens": (3,)}, "source must be <= 1"),
        (
            {"rank": 0, "world_size": 2, "encode": (ImageRef(0, 0, 0, 1, 4, 4), ImageRef(1, 0, 0, 0, 4, 4))},
            "ordered by owner",
        ),
        ({"rank": 0, "world_size": 2, "encode": (ImageRef(0, 0, 0, 2, 4, 4),)}, "ordered by owner rank < 2"),
    ],
)
def test_exchange_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Exchange(**kwargs)


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 0, 0, 0, 1, 0), "tokens must be >= 1"),
        ((-1, 0, 0, 0, 1, 1), "sample_id must be >= 0"),
        ((0, 0, 0, 0, 1.5, 1), "patches must be an int"),
    ],
)
def test_imageref_validation(args, match):
    with pytest.raises(ValueError, match=match):
        ImageRef(*args)


def test_plan_vision_rejects_a_topology_of_the_wrong_size():
    with pytest.raises(ValueError, match="one node index per rank"):
        plan_vision([[], []], VisionCost(), [0])


def workload(n: int, seed: int) -> list[Sample]:
    """Samples with 0..4 images of varied size (a deterministic LCG, no rng state)."""
    out, x = [], seed
    for i in range(n):
        images = []
        x = (x * 1103515245 + 12345) % 2**31
        for _ in range(x % 5):
            x = (x * 1103515245 + 12345) % 2**31
            patches = 16 + x % 4000
            images.append((patches, max(1, patches // 4)))
        text = 1 + (x >> 8) % 900
        out.append(Sample(i, text + sum(t for _, t in images), images=tuple(images)))
    return out


@pytest.mark.parametrize(
    "world_size, local_ranks, nodes", [(4, None, "local"), (8, 4, "local"), (8, 4, "aware")]
)
def test_two_phase_round_trip_attaches_an_exchange_covering_each_step(world_size, local_ranks, nodes):
    samples = workload(600, 3)
    spec = JobSpec(
        world_size=world_size,
        token_budget=4096,
        policy=PolicySpec(name="balanced", window=32, depth=4, nodes=nodes),
        phases=Phases(count=2),
    )
    sim = Simulator(samples, spec, local_ranks=local_ranks)
    by_id = {x.id: x for x in samples}
    steps = 0
    for step in sim:
        steps += 1
        assert all(isinstance(s.exchange, Exchange) for s in step)
        assert [s.exchange.rank for s in step] == list(range(world_size))
        images = Counter((x.id, k) for s in step for x in s.samples for k in range(len(x.images)))
        assert Counter((im.sample_id, im.index) for s in step for im in s.exchange.encode) == images
        for s in step:  # samples keep their images; each rank's sources cover exactly its own images
            assert all(x.images == by_id[x.id].images for x in s.samples)
            assert len(s.exchange.sources) == sum(len(x.images) for x in s.samples)
        assert Step_json_round_trips(step)
    assert steps > 0 and sim.vision_plan_s


def Step_json_round_trips(step) -> bool:
    from batchd.core import Step

    return all(Step.from_json(json.loads(json.dumps(s.to_json()))) == s for s in step)


def test_one_phase_steps_carry_no_exchange():
    spec = JobSpec(world_size=4, token_budget=4096, policy=PolicySpec(name="balanced", window=32, depth=8))
    assert all(s.exchange is None for step in Simulator(workload(200, 5), spec) for s in step)


@pytest.mark.parametrize("cut", [0, 3, 9])
def test_a_two_phase_simulator_resumed_mid_epoch_reproduces_the_rest_exchanges_included(cut):
    """Resume mid-epoch: a JSON round trip of the simulator's state (coordinator, ranks, views, the steps of
    the round not yet consumed, their exchanges with them) continues exactly as the original does."""
    rng = random.Random(4)
    samples = [
        Sample(
            i,
            60 + rng.randrange(400),
            images=tuple((4 * t, t) for t in rng.sample([8, 16, 32, 64], rng.randrange(3))),
        )
        for i in range(160)
    ]
    samples = [s.replace(length=s.length + sum(t for _, t in s.images)) for s in samples]
    spec = JobSpec(
        world_size=3,
        token_budget=1024,
        policy=PolicySpec(name="balanced", window=12, depth=3),
        phases=Phases(count=2),
    )

    def rest(sim):
        return [tuple(json.dumps(st.to_json(), sort_keys=True) for st in step) for step in sim]

    original = Simulator(samples, spec)
    for _ in range(cut):
        assert original.next_step() is not None
    state = json.loads(json.dumps(original.state_dict()))
    restored = Simulator(samples, spec)
    restored.load_state_dict(state)
    a, b = rest(original), rest(restored)
    assert a and a == b
    assert any('"exchange"' in s for step in a for s in step)


def test_mean_imbalance_by_hand():
    assert mean_imbalance([[4, 0], [0, 0], [3, 1]]) == pytest.approx(
        (2.0 + 1.5) / 2
    )  # the empty step skipped
    assert mean_imbalance([[0, 0]]) is None and mean_imbalance([]) is None
