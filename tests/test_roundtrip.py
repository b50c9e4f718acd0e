"""The shared save/load round trip, torchdata's pattern, for every stateful piece of batchd.

For each class: drive an instance part-way, take `state_dict()`, JSON-round-trip it, load it into a
FRESH instance, then drive both the original and the restored instance to the end and assert that their
continuations (what each yields from the cut on) are identical, item by item; equal states are not
enough. Per class, a state of another rank / world size / seed / epoch (where the class stores it) is
refused with a ValueError naming the field. Controls: a state corrupted by one position makes the
continuation differ, and `assert_same_continuation` catches it (the test can fail).

Covered: ViewSource, RankState, Coordinator, Simulator, Delivery (batchd.core); SyntheticSource,
RaySource (real Ray, a tiny demo dataset), Quarantine (batchd.service.preprocess); BatchClient
(batchd.client, against an in-process job); the rank journal (a RankServiceCore restored from its state
dir). Jobs here use one rank and depth=1: each round then makes exactly one step whatever the trainer's
timing, so two runs of the same job make the same steps and can be compared.
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _jobs import job_pool
from hypothesis import given, settings
from hypothesis import strategies as st

from batchd.client import BatchClient
from batchd.core import (
    ATTACHED,
    SEND_END,
    Coordinator,
    Delivery,
    JobSpec,
    PolicySpec,
    ProtocolError,
    RankState,
    Remainder,
    Sample,
    Simulator,
    Updates,
    ViewSource,
)
from batchd.service import CoordinatorClient, RankServiceCore
from batchd.service.preprocess import (
    EXHAUSTED,
    IngestSource,
    Quarantine,
    RaySource,
    Source,
    StreamOptions,
    SyntheticData,
    SyntheticSource,
    TokenizerRef,
    default_stages,
    demo_tokenizer,
    make_demo_dataset,
    resolve_many,
)
from batchd.testing import PreprocessPool


def json_round_trip(state: Any) -> Any:
    """`state` through JSON text: fails on anything that is not JSON-safe (tuples come back as lists)."""
    return json.loads(json.dumps(state))


def assert_same_continuation(original: Iterable[Any], restored: Iterable[Any], what: str = "") -> None:
    """The restored instance yields exactly what the original yields from the cut on (names the first
    item that differs)."""
    original, restored = list(original), list(restored)
    for k, (a, b) in enumerate(zip(original, restored, strict=False)):
        if a != b:
            raise AssertionError(
                f"{what}: the continuations first differ at item {k}: original {a!r}, restored {b!r}"
            )
    if len(original) != len(restored):
        raise AssertionError(
            f"{what}: the original continues for {len(original)} items, the restored for {len(restored)}"
        )


def digest(arrays: dict[str, np.ndarray]) -> tuple:
    """A payload dict as something `==` compares exactly: (key, dtype, shape, sha1 of the bytes) per array."""
    return tuple(
        (k, v.dtype.str, v.shape, hashlib.sha1(np.ascontiguousarray(v).tobytes()).hexdigest())
        for k, v in sorted(arrays.items())
    )


# ---------------------------------------------------------------------------------------------------
# batchd.core: ViewSource, RankState, Coordinator, Simulator (one simulated world: N ranks, their views
# and the coordinator), and Delivery
# ---------------------------------------------------------------------------------------------------
LENGTHS = [int(n) for n in np.random.default_rng(7).integers(1, 180, 90)] + [300, 420]  # two over budget
WORLDS = {
    "local": JobSpec(
        world_size=3, token_budget=256, seed=3, policy=PolicySpec(name="local", window=7, depth=2)
    ),
    "balanced": JobSpec(
        world_size=3, token_budget=256, seed=3, policy=PolicySpec(name="balanced", window=7, depth=2)
    ),
    "odb-non-join": JobSpec(
        world_size=3,
        token_budget=256,
        seed=3,
        mode="non-join",
        quota=70,
        policy=PolicySpec(name="odb", window=7, depth=3),
    ),
    # Optimizer updates of a fixed count: the coordinator carries the open update across rounds.
    "balanced-updates": JobSpec(
        world_size=3,
        token_budget=256,
        seed=3,
        policy=PolicySpec(name="balanced", window=7, depth=2),
        updates=Updates(tokens_per_update=900),
    ),
    "local-non-join-updates": JobSpec(
        world_size=3,
        token_budget=256,
        seed=3,
        mode="non-join",
        quota=70,
        policy=PolicySpec(name="local", window=7, depth=3),
        updates=Updates(samples_per_update=10, update_rule="at_least"),
    ),
}
COMPONENTS = ("simulator", "coordinator", "rank", "view")


def sim_steps(sim: Simulator) -> list[tuple[str, ...]]:
    """The rest of the epoch: per global step, each rank's step as canonical JSON text."""
    return [tuple(json.dumps(s.to_json(), sort_keys=True) for s in step) for step in sim]


def simulator_at(world: str, cut: int) -> Simulator:
    """A simulator of `world` that has yielded `cut` global steps."""
    sim = Simulator(LENGTHS, WORLDS[world])
    for _ in range(cut):
        assert sim.next_step() is not None
    return sim


def fresh_component(world: str, component: str, rank: int) -> Any:
    """A new instance of `world`'s `component` (rank `rank`'s for a rank state or view) in epoch 0."""
    c, epoch = WORLDS[world], 0
    if component == "simulator":
        return Simulator(LENGTHS, c, epoch)
    if component == "coordinator":
        return Coordinator(c, epoch)
    if component == "rank":
        return RankState(c, rank, epoch)
    return ViewSource(len(LENGTHS), rank, c.world_size, c.seed, epoch, c.shuffle, c.mode == "non-join")


def component_of(sim: Simulator, component: str, rank: int) -> Any:
    return {
        "simulator": sim,
        "coordinator": sim.coordinator,
        "rank": sim.ranks[rank],
        "view": sim.sources[rank],
    }[component]


def restored_world(world: str, cut: int, component: str, rank: int, state: dict) -> Simulator:
    """The world at `cut` with `component` replaced by a fresh instance loaded with `state`: the whole
    simulator, or one part of a world replayed to the cut (its other parts are the original's twins)."""
    fresh = fresh_component(world, component, rank)
    fresh.load_state_dict(state)
    if component == "simulator":
        return fresh
    sim = simulator_at(world, cut)
    if component == "coordinator":
        sim.coordinator = fresh
    elif component == "rank":
        sim.ranks[rank] = fresh
    else:
        sim.sources[rank] = fresh
    return sim


def total_steps(world: str) -> int:
    return len(sim_steps(Simulator(LENGTHS, WORLDS[world])))


@given(
    world=st.sampled_from(sorted(WORLDS)),
    component=st.sampled_from(COMPONENTS),
    rank=st.integers(0, 2),
    cut=st.floats(0.0, 1.0, exclude_max=True),
)
def test_core_state_round_trip_continues_identically(world, component, rank, cut):
    cut = int(cut * total_steps(world))
    original = simulator_at(world, cut)
    state = json_round_trip(component_of(original, component, rank).state_dict())
    restored = restored_world(world, cut, component, rank, state)
    rest = sim_steps(original)
    assert rest, "the cut is before the end: something must follow it"
    assert_same_continuation(rest, sim_steps(restored), f"{component} of {world} at step {cut}")


@pytest.mark.parametrize(
    "component, key",
    [
        ("view", "position"),  # a sample is skipped
        ("rank", "step"),  # the step numbers shift
        ("simulator", "sources"),  # rank 0's view skips a sample
        ("coordinator", "update_seen"),  # the updates end elsewhere
    ],
)
def test_control_a_corrupted_core_state_changes_the_continuation(component, key):
    world, cut, rank = ("balanced-updates" if key.startswith("update") else "local"), 3, 1
    original = simulator_at(world, cut)
    state = json_round_trip(component_of(original, component, rank).state_dict())
    if key == "sources":
        state[key][0]["position"] += 1
    else:
        state[key] += 450 if key == "update_seen" else 1  # half an update: a boundary moves
    restored = restored_world(world, cut, component, rank, state)
    with pytest.raises(AssertionError, match="first differ"):
        assert_same_continuation(sim_steps(original), sim_steps(restored), component)


def _other(component: str, field: str, value: Any = None) -> tuple[Any, dict]:
    """(a fresh `component` whose `field` differs from the state's, the state of the "local" world's rank 1
    after 3 steps)."""
    sim = simulator_at("local", 3)
    state = json_round_trip(component_of(sim, component, 1).state_dict())
    spec, rank, epoch = sim.spec, 1, 0
    if field == "rank":
        rank = 2
    elif field == "epoch":
        epoch = 1
    elif field == "mode":
        spec = spec.replace(mode=value, quota=50)
    elif value is not None:
        spec = spec.replace(**{field: value})
    if component == "simulator":
        return Simulator(LENGTHS, spec, epoch), state
    if component == "coordinator":
        return Coordinator(spec, epoch), state
    if component == "rank":
        return RankState(spec, rank, epoch), state
    n = len(LENGTHS) + (1 if field == "num_samples" else 0)
    return ViewSource(n, rank, spec.world_size, spec.seed, epoch, spec.shuffle), state


@pytest.mark.parametrize(
    "component, field, value",
    [
        ("view", "rank", None),
        ("view", "world_size", 4),
        ("view", "seed", 4),
        ("view", "epoch", None),
        ("view", "num_samples", None),
        ("rank", "rank", None),
        ("rank", "world_size", 4),
        ("rank", "seed", 4),
        ("rank", "epoch", None),
        ("rank", "policy", "odb"),
        ("rank", "token_budget", 255),
        ("coordinator", "world_size", 4),
        ("coordinator", "seed", 4),
        ("coordinator", "epoch", None),
        ("coordinator", "policy", "balanced"),
        ("coordinator", "mode", "non-join"),
        ("simulator", "world_size", 4),
        ("simulator", "seed", 4),
        ("simulator", "epoch", None),
        ("simulator", "window", 8),
    ],
)
def test_core_refuses_a_state_of_another_configuration(component, field, value):
    fresh, state = _other(component, field, value)
    with pytest.raises(ValueError, match=rf"{field}: saved|'{field}': \("):  # the simulator's config diff
        fresh.load_state_dict(state)


def test_core_state_is_refused_mid_round():
    """`state_dict()` is taken between rounds; inside one, the rank state and the coordinator refuse."""
    sim = Simulator(LENGTHS, WORLDS["local"])
    sim._fill()
    reports = [r.report(2) for r in sim.ranks]
    with pytest.raises(ProtocolError, match="between rounds"):
        sim.ranks[0].state_dict()
    sim.coordinator.decide(reports)
    with pytest.raises(ProtocolError, match="between rounds"):
        sim.coordinator.state_dict()


@given(shuffle=st.booleans(), wrap=st.booleans(), cut=st.integers(0, 70), resized=st.booleans())
def test_view_source_round_trip_continues_across_passes(shuffle, wrap, cut, resized):
    """A view on its own, also in non-join mode (wrap): the continuation crosses into later passes; also
    a view of a resize's remainder."""
    rem = Remainder(0, 5, 4, 1, set(range(0, 50, 3))) if resized else None

    def make():
        return ViewSource(50, rank=1, world_size=4, seed=3, shuffle=shuffle, wrap=wrap, remainder=rem)

    original = make()
    for _ in range(cut):
        original.next()
    restored = make()
    restored.load_state_dict(json_round_trip(original.state_dict()))
    assert restored.peek() == original.peek()
    assert_same_continuation(
        [original.next() for _ in range(40)], [restored.next() for _ in range(40)], "view"
    )


# Delivery: a scripted trainer and round loop on a driven clock, both decided by the tick only.
TRAINER = "trainer"


def delivery_trace(d: Delivery, start: int, stop: int = 500) -> list[tuple]:
    """Drives `d` from tick `start` to the job's end (or `stop`): per tick the round loop may make steps
    (or close the epoch, or start the next one) and the trainer connects, takes a step and acknowledges
    some; returns what happened. What happens at tick t depends only on t and `d`'s state."""
    trace: list[tuple] = []
    for t in range(start, stop):
        if d.finished:
            break
        rng, now = random.Random(t), float(t)
        if d.can_advance:
            d.advance(now)
            trace.append(("advance", d.epoch))
        elif not d.done and d.capacity > 0 and rng.random() < 0.6:
            steps = list(range(d.made, d.made + rng.randint(1, d.capacity)))
            d.add(steps)
            trace.append(("add", steps))
            if d.made >= 5 + 2 * d.epoch:
                d.close()
                trace.append(("close", d.made))
        if d.holder is None:
            c = d.connect(TRAINER, d.epoch, d.acked, 2, now)
            trace.append(("connect", c.outcome, c.reason))
            if c.outcome != ATTACHED:
                continue
        nxt = d.next_for(TRAINER)
        if nxt == SEND_END:
            d.mark_end_sent(TRAINER)
            d.disconnect(TRAINER, now)
            trace.append(("end", d.epoch))
        elif nxt is not None:
            d.sent(TRAINER, nxt)
            trace.append(("sent", nxt))
        if rng.random() < 0.6:  # the trainer consumed what it was sent, and asks for more
            d.ack(TRAINER, d.cursor)
        trace.append(("at", d.capacity, tuple(d.ready), d.acked, d.done, d.end_sent))
    return trace


def _delivery(now: float = 0.0, epochs: int = 3) -> Delivery:
    return Delivery(0, epochs, 3, grace_s=1000.0, trainer_timeout_s=1000.0, now=now)


def delivery_pair(cut: int, corrupt: Callable[[dict], None] | None = None) -> tuple[list, list]:
    """(the original's continuation, the restored one's) for a cut at tick `cut`. The restart drops the
    trainer's stream: the original sees it disconnect; the restored one starts with nobody connected."""
    original = _delivery()
    delivery_trace(original, 0, cut)
    state = json_round_trip(original.state_dict())
    if corrupt is not None:
        corrupt(state)
    restored = _delivery(now=float(cut))
    restored.load_state_dict(state, float(cut))
    original.disconnect(TRAINER, float(cut))
    return delivery_trace(original, cut), delivery_trace(restored, cut)


@given(cut=st.integers(0, 60))
def test_delivery_round_trip_continues_identically(cut):
    original, restored = delivery_pair(cut)
    assert_same_continuation(original, restored, f"delivery at tick {cut}")


def test_delivery_drives_a_whole_job_and_refuses_an_epoch_outside_it():
    d = _delivery()
    trace = delivery_trace(d, 0)
    assert d.finished and ("advance", 2) in trace and sum(e[0] == "end" for e in trace) == 3
    with pytest.raises(ValueError, match="epoch must be <= 1, got epoch=2"):
        _delivery(epochs=2).load_state_dict(json_round_trip(d.state_dict()), 0.0)  # its epoch 2 of 3


def test_control_a_corrupted_delivery_state_changes_the_continuation():
    cut = next(t for t in range(5, 60) if _delivery_state_at(t)["acked"] > 0)

    def corrupt(state):
        state["acked"] -= 1  # the trainer would get a step again

    with pytest.raises(AssertionError, match="first differ"):
        assert_same_continuation(*delivery_pair(cut, corrupt), "delivery")


def _delivery_state_at(cut: int) -> dict:
    d = _delivery()
    delivery_trace(d, 0, cut)
    return d.state_dict()


# ---------------------------------------------------------------------------------------------------
# batchd.service.preprocess: SyntheticSource, Quarantine, RaySource
# ---------------------------------------------------------------------------------------------------
SYN_LENGTHS = [int(n) for n in np.random.default_rng(5).integers(2, 60, 40)]
SYN_EPOCHS = 2


def source_items(src: Source, epoch: int, polls: int | None = None, epochs: int = SYN_EPOCHS) -> list:
    """What `src` yields from here: (epoch, Sample, payload digest) per sample, to the end of epoch
    epochs-1 (calling `start_epoch` at each end), or for `polls` polls (a wrapping view never ends)."""
    out: list = []
    while polls is None or len(out) < polls:
        item = src.poll(5.0)
        if item is None:
            raise AssertionError(f"{type(src).__name__} gave nothing within 5 s after {len(out)} item(s)")
        if item is EXHAUSTED:
            if epoch + 1 >= epochs:
                break
            epoch += 1
            src.start_epoch(epoch)
            continue
        sample, payload = item
        out.append((epoch, sample, digest(payload)))
    return out


def _synthetic(
    epoch: int = 0,
    wrap: bool = False,
    shuffle: bool = True,
    rank: int = 1,
    world_size: int = 3,
    seed: int = 4,
    lengths: list[int] = SYN_LENGTHS,
) -> SyntheticSource:
    return SyntheticSource(SyntheticData(lengths, 97), rank, world_size, seed, epoch, shuffle, wrap)


def synthetic_pair(
    cut: int, wrap: bool, shuffle: bool, corrupt: Callable[[dict], None] | None = None
) -> tuple[list, list]:
    polls = 2 * len(_synthetic()) + 3 if wrap else None  # past the end of the first pass
    original = _synthetic(wrap=wrap, shuffle=shuffle)
    head = source_items(original, 0, polls=cut, epochs=1 if wrap else SYN_EPOCHS)
    epoch = head[-1][0] if head else 0
    if not wrap and epoch == 0 and len(head) == len(original):  # the cut is at the end of epoch 0
        epoch = 1
        original.start_epoch(1)
    state = json_round_trip(original.state_dict())
    if corrupt is not None:
        corrupt(state)
    restored = _synthetic(epoch, wrap=wrap, shuffle=shuffle)
    restored.load_state_dict(state)
    left = None if polls is None else polls - cut
    return source_items(original, epoch, left), source_items(restored, epoch, left)


@given(wrap=st.booleans(), shuffle=st.booleans(), cut=st.integers(0, 2 * 13 - 1))
def test_synthetic_source_round_trip_continues_identically(wrap, shuffle, cut):
    """Non-join (wrap): the continuation crosses into the view's next pass; join: into the next epoch."""
    original, restored = synthetic_pair(cut, wrap, shuffle)
    assert original, "something follows the cut"
    assert_same_continuation(original, restored, f"SyntheticSource(wrap={wrap}) at {cut}")


def test_control_a_corrupted_synthetic_state_changes_the_continuation():
    def corrupt(state):
        state["position"] += 1

    with pytest.raises(AssertionError, match="first differ"):
        assert_same_continuation(*synthetic_pair(4, False, True, corrupt), "SyntheticSource")


@pytest.mark.parametrize(
    "field, other",
    [
        ("rank", {"rank": 2}),
        ("world_size", {"world_size": 4, "rank": 1}),
        ("seed", {"seed": 5}),
        ("epoch", {"epoch": 1}),
        ("num_samples", {"lengths": SYN_LENGTHS + [7]}),
    ],
)
def test_synthetic_source_refuses_a_state_of_another_view(field, other):
    src = _synthetic()
    source_items(src, 0, polls=3)
    with pytest.raises(ValueError, match=f"{field}: saved"):
        _synthetic(**other).load_state_dict(json_round_trip(src.state_dict()))


REASONS = ["invalid_json: x", "missing_field: messages", "bad_image: truncated", "over_cutoff: 5000 > 4096"]


def quarantine_trace(q: Quarantine, start: int, stop: int = 40) -> list:
    """Adds records start..stop-1 (a reason picked by the record's number); per add, the counts after it."""
    out = []
    for i in range(start, stop):
        q.add(i, f"demo.jsonl:{i}", REASONS[(i * 7) % len(REASONS)], epoch=i // 20)
        out.append((dict(q.counts), q.total))
    return out


@given(cut=st.integers(0, 39))
def test_quarantine_round_trip_continues_identically(cut):
    with tempfile.TemporaryDirectory() as tmp:
        original = Quarantine(Path(tmp) / "a.jsonl")
        quarantine_trace(original, 0, cut)
        restored = Quarantine(Path(tmp) / "b.jsonl")  # the file is a log; the counts are the state
        restored.load_state_dict(json_round_trip(original.state_dict()))
        assert_same_continuation(
            quarantine_trace(original, cut), quarantine_trace(restored, cut), "Quarantine"
        )
        assert Quarantine.read(Path(tmp) / "a.jsonl")[cut:] == Quarantine.read(Path(tmp) / "b.jsonl")


@pytest.mark.parametrize(
    "state",
    [{}, {"count": {}}, {"counts": {"bad_image": -1}}, {"counts": [1]}, {"counts": {"bad_image": "2"}}],
)
def test_quarantine_refuses_a_malformed_state_naming_the_field(state):
    with pytest.raises(ValueError, match="'counts'"):
        Quarantine().load_state_dict(state)


RAY_NUM = 40


@pytest.fixture(scope="module")
def ray_pool(ray_session, tmp_path_factory):
    """A 2-actor pool (0.5 CPU each) over a tiny demo dataset with bad records (quarantined)."""
    work = tmp_path_factory.mktemp("roundtrip-ray")
    demo = make_demo_dataset(
        work / "demo", num_samples=RAY_NUM, seed=2, format="jsonl", max_image_side=96, bad_fraction=0.1
    )
    tok = TokenizerRef(demo_tokenizer(work / "tokenizer.json"))
    with PreprocessPool(demo.path, default_stages(tok, cutoff=512), num_actors=2, actor_num_cpus=0.5) as pool:
        yield pool, demo


def ray_items(src: RaySource, limit: int | None = None) -> list:
    """(Sample, payload digest) per sample polled (to the end of the view, or `limit` of them), then the
    source's counters once it is exhausted. Fails on a stall (nothing for 60 s), not on slowness."""
    out: list = []
    deadline = time.monotonic() + 60
    while limit is None or len(out) < limit:
        item = src.poll(0.5)
        if item is EXHAUSTED:
            out.append(("end", src.emitted, dict(src.reasons), src.records_read))
            break
        if item is not None:
            out.append(item)
            deadline = time.monotonic() + 60
        assert time.monotonic() < deadline, f"RaySource stalled after {len(out)} item(s)"
    refs = [i for i, x in enumerate(out) if isinstance(x, tuple) and isinstance(x[0], Sample)]
    payloads = resolve_many([out[i][1] for i in refs])
    for i, payload in zip(refs, payloads, strict=False):
        out[i] = (out[i][0], digest(payload))
    return out


@settings(max_examples=3)
@given(cut=st.integers(0, RAY_NUM // 2 - 3))
def test_ray_source_round_trip_continues_identically(ray_pool, cut):
    """A real RaySource cut with tasks in flight: the restored one requests them again and yields what
    the original yields, payloads included, and ends with the same counters (quarantined records too)."""
    pool, demo = ray_pool

    def make(**kw):
        # a tenth of the records are bad by design: their share is not what this test judges
        args = {"rank": 1, "world_size": 2, "seed": 5, "epoch": 0}
        args.update(kw)
        options = StreamOptions(chunk_size=3, max_in_flight=9, max_bad_fraction=1.0)
        return RaySource(None, pool=pool, options=options, **args)

    original = make()
    ray_items(original, cut)
    state = json_round_trip(original.state_dict())
    restored = make()
    restored.load_state_dict(state)
    rest = ray_items(original)
    bad = set(ViewSource(RAY_NUM, 1, 2, 5, 0, True)._view) & set(demo.bad)
    assert rest[-1][0] == "end" and sum(rest[-1][2].values()) == len(bad), rest[-1]
    assert_same_continuation(rest, ray_items(restored), f"RaySource at {cut}")
    for field, other in [
        ("rank", {"rank": 0}),
        ("world_size", {"world_size": 3}),
        ("seed", {"seed": 6}),
        ("epoch", {"epoch": 1}),
    ]:
        with pytest.raises(ValueError, match=f"{field}: saved"):
            make(**other).load_state_dict(state)
    with pytest.raises(ValueError, match="not a RaySource state"):
        make().load_state_dict(json_round_trip(_synthetic().state_dict()))


def test_every_source_implements_the_protocol(ray_pool):
    pool, _ = ray_pool
    for src in [_synthetic(), IngestSource(4), RaySource(None, pool=pool)]:
        assert isinstance(src, Source), type(src).__name__
        assert all(isinstance(k, str) and isinstance(v, int) for k, v in src.reasons.items())
        json.dumps(src.stats())
        json.dumps(src.state_dict())


def test_rank_service_refuses_a_source_that_is_not_a_Source_naming_what_it_lacks():
    assert not isinstance(_Partial(), Source)
    with pytest.raises(TypeError, match=r"_Partial lacks \['materialize_many', 'peek_id', 'reasons'\]"):
        RankServiceCore(
            0,
            JobSpec(world_size=1, token_budget=64, policy=PolicySpec(name="local", window=4, depth=8)),
            None,
            _Partial(),
        )


class _Partial:
    """A source from before the protocol: no materialize_many, peek_id nor reasons."""

    def poll(self, timeout=0.0):
        return EXHAUSTED

    def materialize(self, sample_id):
        raise KeyError(sample_id)

    def start_epoch(self, epoch):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def stats(self):
        return {}

    def close(self):
        pass


# ---------------------------------------------------------------------------------------------------
# BatchClient and the rank journal, against in-process jobs
# ---------------------------------------------------------------------------------------------------
JOB_LENGTHS = [int(n) for n in np.random.default_rng(11).integers(2, 300, 70)]
JOB_SPEC = JobSpec(
    world_size=1, token_budget=512, seed=6, epochs=2, policy=PolicySpec(name="local", window=12, depth=1)
)


@pytest.fixture
def make_job():
    with job_pool(connect_timeout_s=30) as make:
        yield make


def project(batch: dict, info: Any) -> tuple:
    """A received step as something `==` compares: epoch-local step, sample ids, the token ids' digest."""
    return (
        info.step,
        tuple(batch["sample_ids"].tolist()),
        hashlib.sha1(batch["input_ids"].numpy().tobytes()).hexdigest(),
    )


def client_steps(
    client: BatchClient, epochs: int = JOB_SPEC.epochs, limit: int | None = None, it: Iterator | None = None
) -> tuple[list, Iterator | None]:
    """Steps read by `client` from its epoch on, as (epoch, *project): to the job's end, or `limit` of them.
    Returns them and the open iterator (to continue the same stream)."""
    out: list = []
    while client.epoch < epochs and (limit is None or len(out) < limit):
        if it is None:
            client.set_epoch(client.epoch)
            it = iter(client)
        for batch, info in it:
            out.append((client.epoch, *project(batch, info)))
            if limit is not None and len(out) >= limit:
                return out, it
        it = None
        if client.epoch + 1 >= epochs:
            break
        client.set_epoch(client.epoch + 1)
    return out, it


def client_pair(make, cut: int, corrupt: Callable[[dict], None] | None = None) -> tuple[list, list]:
    """Job A: a trainer reads `cut` steps, saves its state, and reads on to the end (the original). Job B,
    the same job: a trainer reads `cut` steps and dies; a FRESH client loads A's saved state and reads on
    to the end (the restored)."""
    job_a, job_b = make(JOB_SPEC, JOB_LENGTHS), make(JOB_SPEC, JOB_LENGTHS)
    with job_a.client(0) as a:
        head_a, it = client_steps(a, limit=cut)
        state = json_round_trip(a.state_dict())
        rest_a, _ = client_steps(a, it=it)
    with job_b.client(0) as dying:
        head_b, it = client_steps(dying, limit=cut)
        it.close()
    assert head_a == head_b, "two runs of the same job make the same steps"
    if corrupt is not None:
        corrupt(state)
    with job_b.client(0) as b:
        b.load_state_dict(state)
        rest_b, _ = client_steps(b)
    return rest_a, rest_b


@pytest.mark.parametrize("cut", [1, 9])
def test_batch_client_round_trip_continues_identically(make_job, cut):
    original, restored = client_pair(make_job, cut)
    assert {e for e, *_ in original} == {0, 1}, "the continuation crosses into the next epoch"
    assert_same_continuation(original, restored, f"BatchClient at step {cut}")


def test_control_a_corrupted_client_state_changes_the_continuation(make_job):
    def corrupt(state):
        state["next_step"] -= 1  # a step comes again (one more would be refused: not made yet)

    with pytest.raises(AssertionError, match="first differ"):
        assert_same_continuation(*client_pair(make_job, 4, corrupt), "BatchClient")


@pytest.mark.parametrize("rank, world_size, field", [(1, 2, "rank"), (0, 2, "world_size")])
def test_batch_client_refuses_a_state_of_another_rank(rank, world_size, field):
    state = BatchClient("127.0.0.1:1", 0, 1).state_dict()
    with pytest.raises(ValueError, match=f"{field}: saved"):
        BatchClient("127.0.0.1:1", rank, world_size).load_state_dict(json_round_trip(state))


def wait_for_trainer_wait(job, limit_s: float = 30.0) -> None:
    """Until rank 0's loop blocks on its trainer (no room for another round): its journal is then stable."""
    deadline = time.monotonic() + limit_s
    while not job.cores[0].waiting_for_trainer:
        assert time.monotonic() < deadline, "rank 0's loop never waited for its trainer"
        time.sleep(0.01)


def journal_pair(
    make, tmp_path: Path, cut: int, corrupt: Callable[[dict], None] | None = None
) -> tuple[list, list]:
    """Job A: its trainer reads `cut` steps, A's rank journal is saved, the trainer reads on to the end (the
    original rank service continues). Job B, the same job: its trainer reads `cut` steps and leaves; B's
    rank service is killed and restarted from A's saved journal (the restored); a trainer resumes it at the
    same step and reads to the end. Returns the two continuations."""
    job_a = make(JOB_SPEC, JOB_LENGTHS, rank_state_dir=tmp_path / "a")
    job_b = make(JOB_SPEC, JOB_LENGTHS, rank_state_dir=tmp_path / "b")
    journal_a, journal_b = (tmp_path / d / "rank-0.json" for d in "ab")
    with job_a.client(0) as a:
        head_a, it = client_steps(a, limit=cut)
        wait_for_trainer_wait(job_a)
        saved = json_round_trip(json.loads(journal_a.read_text()))  # stable: the loop waits for an ack
        client_state = a.state_dict()
        rest_a, _ = client_steps(a, it=it)
    with job_b.client(0) as b:
        head_b, it = client_steps(b, limit=cut)
        wait_for_trainer_wait(job_b)
        assert json.loads(journal_b.read_text()) == saved, "two runs of the same job journal the same state"
        it.close()
    assert head_a == head_b
    if corrupt is not None:
        corrupt(saved)
    job_b.restart_rank(0, before_start=lambda: journal_b.write_text(json.dumps(saved)))
    with job_b.client(0) as b:
        b.load_state_dict(client_state)
        rest_b, _ = client_steps(b)
    return rest_a, rest_b


@pytest.mark.parametrize("cut", [3, 11])
def test_rank_journal_round_trip_continues_identically(make_job, tmp_path, cut):
    original, restored = journal_pair(make_job, tmp_path, cut)
    assert {e for e, *_ in original} == {0, 1}, "the continuation crosses into the next epoch"
    assert_same_continuation(original, restored, f"rank journal at step {cut}")


def test_control_a_corrupted_rank_journal_changes_the_continuation(make_job, tmp_path):
    def corrupt(journal):
        journal["source"]["position"] += 1  # the restored source skips a sample

    with pytest.raises(AssertionError, match="first differ"):
        assert_same_continuation(*journal_pair(make_job, tmp_path, 3, corrupt), "rank journal")


@pytest.fixture
def journal_dir(tmp_path) -> Iterator[tuple[Path, dict]]:
    """A state dir with rank 0's journal written by a rank service of JOB_SPEC at its start, and the
    journal."""
    coord = CoordinatorClient("127.0.0.1:1", 0, JOB_SPEC, startup_timeout_s=1)
    try:
        core = RankServiceCore(
            0, JOB_SPEC, coord, SyntheticSource(JOB_LENGTHS, 0, 1, JOB_SPEC.seed), state_dir=tmp_path
        )
        core._write_journal()
    finally:
        coord.close()
    yield tmp_path, json.loads((tmp_path / "rank-0.json").read_text())


def _restore(state_dir: Path, rank: int = 0, spec: JobSpec = JOB_SPEC) -> RankServiceCore:
    coord = CoordinatorClient("127.0.0.1:1", rank, spec, startup_timeout_s=1)
    try:
        return RankServiceCore(
            rank,
            spec,
            coord,
            SyntheticSource(JOB_LENGTHS, rank, spec.world_size, spec.seed),
            state_dir=state_dir,
        )
    finally:
        coord.close()


def test_rank_journal_of_this_version_restores(journal_dir):
    state_dir, journal = journal_dir
    core = _restore(state_dir)
    assert core.state.state_dict() == journal["rank"] and core.delivery.state_dict() == journal["delivery"]


@pytest.mark.parametrize("version", [1, 4, 6, "5", None, 5.0, True])
def test_rank_journal_of_another_version_is_refused_naming_the_file_and_both_versions(journal_dir, version):
    state_dir, journal = journal_dir
    if version is None:
        del journal["version"]
    else:
        journal["version"] = version
    (state_dir / "rank-0.json").write_text(json.dumps(journal))
    found = "without a 'version' key" if version is None else f"version {version!r}"
    with pytest.raises(ValueError, match=rf"rank-0\.json: rank journal {found}, this build reads version 5"):
        _restore(state_dir)


@pytest.mark.parametrize(
    "key",
    ["delivery", "rank", "source", "ready", "rejected_before", "finish_acked", "filled", "resize", "past"],
)
def test_rank_journal_missing_a_key_is_refused_naming_it(journal_dir, key):
    state_dir, journal = journal_dir
    del journal[key]
    (state_dir / "rank-0.json").write_text(json.dumps(journal))
    with pytest.raises(
        ValueError,
        match=rf"rank-0\.json: rank journal version 5 lacks the required key\(s\) "
        rf"\['{key}'\]",
    ):
        _restore(state_dir)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda j: j.update(extra=1), r"unknown key\(s\) \['extra'\]"),
        (lambda j: j.update(finish_acked=0), "'finish_acked' is a int, expected a bool"),
        (lambda j: j.update(ready={}), "'ready' is a dict, expected a list"),
        (
            lambda j: j["rank"].update(epoch=1),
            r"cannot resume rank 0 from this journal: .*epoch: saved 1, current 0",
        ),
        (lambda j: j["source"].update(seed=7), "seed: saved 7, current 6"),
        (lambda j: j["delivery"].update(epoch=5), "epoch must be <= 1"),
        (lambda j: j["delivery"].pop("made"), "KeyError: 'made'"),
    ],
)
def test_rank_journal_that_does_not_fit_is_refused_naming_the_file_and_field(journal_dir, edit, needle):
    state_dir, journal = journal_dir
    edit(journal)
    (state_dir / "rank-0.json").write_text(json.dumps(journal))
    with pytest.raises(ValueError, match=rf"rank-0\.json: .*{needle}"):
        _restore(state_dir)


def test_rank_journal_of_another_rank_or_seed_is_refused(journal_dir):
    state_dir, _ = journal_dir
    (state_dir / "rank-0.json").rename(state_dir / "rank-1.json")
    with pytest.raises(ValueError, match=r"rank-1\.json: cannot resume rank 1 .*rank: saved 0, current 1"):
        _restore(state_dir, rank=1, spec=JOB_SPEC.replace(world_size=2))
    (state_dir / "rank-1.json").rename(state_dir / "rank-0.json")
    with pytest.raises(ValueError, match=r"rank-0\.json: cannot resume rank 0 .*seed: saved 6, current 7"):
        _restore(state_dir, spec=JOB_SPEC.replace(seed=7))
