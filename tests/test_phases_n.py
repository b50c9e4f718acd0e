"""N encoder phases (issue 25): each encoder (vision, audio) planned on its own per step (by `plan_phases`
and by the coordinator, round by round), the audio clips' cost model, and `Sample.audio` and the audio
exchange through JSON, the wire and the workload CSV."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchd.core import (
    AudioCost,
    JobSpec,
    Phases,
    PolicySpec,
    RoundDecision,
    Sample,
    Step,
    VisionCost,
    format_workload,
    parse_workload,
    plan_phases,
    plan_vision,
    simulate,
)
from batchd.proto import wire
from batchd.proto.wire import sample_from_pb, sample_to_pb
from batchd.testing import phase_loads, plan_phase, plan_vision_round, single_phase, vision_bound

EPS = 1e-9
ENCODERS = (VisionCost(), AudioCost())


@st.composite
def rows(draw, max_ranks=12, max_samples=5):
    """(row, nodes): samples with images and audio clips; some rows have no clip, some one rank holds every
    clip."""
    n = draw(st.integers(1, max_ranks))
    audio_ranks = draw(st.sampled_from(["all", "none", "one"]))  # which ranks' samples may carry audio clips
    one = draw(st.integers(0, n - 1))
    ids = itertools.count()
    row = []
    for r in range(n):
        group = []
        for _ in range(draw(st.integers(0, max_samples))):
            images = tuple(draw(st.lists(st.tuples(st.integers(1, 4096), st.integers(1, 1024)), max_size=3)))
            clips = ()
            if audio_ranks == "all" or (audio_ranks == "one" and r == one):
                clips = tuple(
                    draw(st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 750)), max_size=4))
                )
            text = draw(st.integers(0, 64))
            length = max(1, text + sum(t for _, t in images) + sum(t for _, t in clips))
            group.append(Sample(next(ids), length, -1, draw(st.integers(0, n - 1)), (), 0, images, clips))
        row.append(group)
    nodes = draw(st.one_of(st.none(), st.integers(1, n).map(lambda k: [r // k for r in range(n)])))
    return row, nodes


@given(rows())
def test_each_phase_encodes_each_of_its_items_once_and_returns_it_to_its_owner(case):
    row, nodes = case
    n = len(row)
    plans = plan_phases(row, ENCODERS, nodes)
    assert list(plans) == ["vision", "audio"]
    for enc in ENCODERS:
        ex = plans[enc.name]
        items = Counter((s.id, k) for g in row for s in g for k in range(len(enc.items(s))))
        assert Counter((im.sample_id, im.index) for e in ex for im in e.encode) == items  # a permutation
        where = {(im.sample_id, im.index): e.rank for e in ex for im in e.encode}
        for group, e in zip(row, ex, strict=True):
            own = [(s.id, k) for s in group for k in range(len(enc.items(s)))]
            assert list(e.sources) == [where[key] for key in own]
            assert list(e.tokens) == [t for s in group for _, t in enc.items(s)]
            for im in e.encode:
                sample = next(s for s in row[im.owner] if s.id == im.sample_id)
                assert enc.items(sample)[im.index] == (im.patches, im.tokens)
        for a, b in itertools.product(range(n), repeat=2):
            assert ex[a].send_splits()[b] == ex[b].recv_splits()[a]


@given(rows())
def test_each_phase_is_between_its_bound_and_the_single_phase_plan(case):
    row, nodes = case
    plans = plan_phases(row, ENCODERS, nodes)
    for enc in ENCODERS:
        loads = phase_loads(plans[enc.name], enc)
        single = phase_loads(single_phase(row, enc), enc)
        costs = [enc.item(size) for g in row for s in g for size, _ in enc.items(s)]
        assert max(loads) <= max(single) * (1 + EPS) + EPS
        assert max(loads) >= vision_bound(costs, len(row)) * (1 - EPS) if costs else max(loads) == 0


@given(rows(max_ranks=6))
def test_phases_are_planned_independently(case):
    """The vision plan is the same with or without an audio phase beside it (each phase its own subproblem);
    `plan_phase` is `plan_vision`."""
    row, nodes = case
    assert plan_phases(row, ENCODERS, nodes)["vision"] == plan_vision(row, VisionCost(), nodes)
    assert plan_phases(row, [AudioCost()], nodes)["audio"] == plan_phase(row, AudioCost(), nodes)


def test_one_rank_holding_every_clip_spreads_them_and_a_step_without_audio_moves_nothing():
    clips = tuple((1000, 250) for _ in range(8))
    row = [[Sample(0, 2000, audio=clips)], [Sample(1, 10)], [Sample(2, 10)], [Sample(3, 10)]]
    audio = plan_phases(row, ENCODERS)["audio"]
    assert [len(e.encode) for e in audio] == [2, 2, 2, 2]
    assert Counter(audio[0].sources) == {0: 2, 1: 2, 2: 2, 3: 2}  # the owner gets each clip back
    assert list(audio[0].recv_splits()) == [500, 500, 500, 500]
    silent = plan_phases([[Sample(0, 5, images=((16, 4),))], [Sample(1, 5)]], ENCODERS)["audio"]
    assert all(e.encode == () and e.sources == () for e in silent)


def test_audio_cost_by_hand_and_validation():
    a = AudioCost(frontend=0.5, linear=2.0, stride=2, quadratic=100)
    assert a.item(40) == pytest.approx(0.5 * 40 + 2.0 * 20 + 20 * 20 / 100)
    assert AudioCost(quadratic=0).item(3000) == pytest.approx(0.25 * 3000 + 1500)
    assert AudioCost().item(3000) > 2 * AudioCost().item(1500)  # attention within the clip
    assert a.items(Sample(0, 9, audio=((40, 9),))) == ((40, 9),) and a.name == "audio"
    for kwargs, match in [
        ({"frontend": -1}, "audio_frontend"),
        ({"linear": 0}, "audio_linear"),
        ({"stride": 0}, "audio_stride"),
        ({"quadratic": -1}, "audio_quadratic"),
    ]:
        with pytest.raises(ValueError, match=match):
            AudioCost(**kwargs)
    with pytest.raises(ValueError, match="distinct names"):
        plan_phases([[Sample(0, 1)]], [VisionCost(), VisionCost(quadratic=0)])


def test_the_simulator_plans_with_the_exact_option_and_never_peaks_higher():
    rng = random.Random(5)
    data = [
        Sample(k, 200 + rng.randrange(400), images=tuple((rng.randrange(64, 2048), 16) for _ in range(k % 4)))
        for k in range(48)
    ]
    spec = JobSpec(
        world_size=3,
        token_budget=2048,
        shuffle=False,
        policy=PolicySpec(name="balanced", window=16, depth=8),
        phases=Phases(count=2),
    )
    plain = simulate(data, spec)
    exact = simulate(data, spec.replace(phase_exact_nodes=200))  # the key: phases.exact_nodes
    assert exact["steps"] == plain["steps"] and exact["llm_imbalance"] == plain["llm_imbalance"]
    assert exact["vision_imbalance_two"] <= plain["vision_imbalance_two"] + 1e-9
    assert wire.spec_from_pb(wire.spec_to_pb(spec.replace(phase_exact_nodes=200))).phases.exact_nodes == 200


def test_the_job_sets_the_audio_cost_and_the_wire_carries_it():
    spec = JobSpec(
        world_size=2,
        token_budget=64,
        policy=PolicySpec(name="balanced", window=512, depth=8),
        phases=Phases(count=2, audio_quadratic=1000),
    )
    assert spec.audio_cost() == AudioCost(quadratic=1000)
    assert (
        JobSpec(
            world_size=2, token_budget=64, policy=PolicySpec(name="local", window=512, depth=8)
        ).audio_cost()
        == AudioCost()
    )
    assert wire.spec_from_pb(wire.spec_to_pb(spec)) == spec
    with pytest.raises(ValueError, match="audio_quadratic"):
        JobSpec(
            world_size=2,
            token_budget=64,
            phases=Phases(audio_quadratic=-1),
            policy=PolicySpec(name="local", window=512, depth=8),
        )
    # the simulator plans the audio phase with the job's cost: a clip of 3,000 frames weighs more with q=1000
    heavy = simulate([Sample(0, 40, audio=((3000, 750),)), Sample(1, 40, audio=((100, 25),))], spec)
    light = simulate(
        [Sample(0, 40, audio=((3000, 750),)), Sample(1, 40, audio=((100, 25),))],
        spec.replace(audio_quadratic=0),
    )
    assert heavy["audio_imbalance_single"] != light["audio_imbalance_single"]


def test_sample_audio_round_trips_json_wire_and_the_workload_csv():
    s = Sample(3, 1300, -1, 1, (("text", 50),), 0, ((256, 64),), ((3000, 750), (400, 436)))
    assert Sample.from_json(s.to_json()) == s
    assert sample_from_pb(sample_to_pb(s)) == s
    with pytest.raises(ValueError, match=r"audio\[0\] tokens"):
        Sample(0, 5, audio=((10, 0),))
    with pytest.raises(ValueError, match=r"audio entries must be \(frames, tokens\)"):
        Sample(0, 5, audio=((10,),))
    text = format_workload([s.replace(id=0, home_rank=0, modality_tokens=()), Sample(1, 7)])
    assert text.splitlines() == [
        "text_tokens,image_patches,image_tokens,audio_frames,audio_tokens",
        "50,256,64,3000 400,750 436",
        "7,,,,",
    ]
    back = parse_workload(text.splitlines())
    assert [x.audio for x in back] == [((3000, 750), (400, 436)), ()]
    assert back[0].length == 1300 and dict(back[0].modality_tokens) == {
        "text": 50,
        "vision": 64,
        "audio": 1186,
    }
    assert format_workload(back) == text
    assert format_workload([Sample(0, 7)]).splitlines()[0] == "text_tokens,image_patches,image_tokens"
    with pytest.raises(
        ValueError, match="w.csv:2: audio_frames and audio_tokens must list one entry per audio"
    ):
        parse_workload([text.splitlines()[0], "5,,,1 2,3"], "w.csv")


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 5), st.sampled_from([None, 2]))
def test_the_coordinator_plans_the_audio_phase_of_every_step_and_the_wire_carries_it(seed, world, local):
    """Through the core coordinator (the simulator runs the daemon's code): every step of a round with clips
    carries an audio exchange on every rank that encodes each clip of the step exactly once and returns it
    to its owner; the round's decision and each step survive the wire and JSON."""
    rng = random.Random(seed)
    samples = []
    for i in range(rng.randint(20, 80)):
        clips = tuple((rng.randint(50, 3000), rng.randint(1, 200)) for _ in range(rng.choice([0, 0, 1, 3])))
        images = tuple((rng.randint(16, 1024), rng.randint(1, 64)) for _ in range(rng.choice([0, 1])))
        samples.append(
            Sample(i, rng.randint(1, 300) + sum(t for _, t in clips + images), -1, 0, (), 0, images, clips)
        )
    spec = JobSpec(
        world_size=world,
        token_budget=4096,
        seed=seed,
        policy=PolicySpec(name="balanced", window=8, depth=8),
        phases=Phases(count=2),
    )
    seen: Counter[tuple[int, int]] = Counter()

    def check(step):
        clips = Counter((x.id, k) for s in step for x in s.samples for k in range(len(x.audio)))
        if not clips:
            return
        assert all(s.audio_exchange is not None for s in step)
        encoded = Counter((im.sample_id, im.index) for s in step for im in s.audio_exchange.encode)
        assert encoded == clips
        seen.update(encoded)
        for s in step:
            assert list(s.audio_exchange.tokens) == [t for x in s.samples for _, t in x.audio]
            assert Step.from_json(json.loads(json.dumps(s.to_json()))) == s

    result = simulate(samples, spec, on_step=check, local_ranks=local)
    assert result["missing"] == 0 and result["duplicates"] == 0
    assert seen == Counter((x.id, k) for x in samples for k in range(len(x.audio)))
    assert (result["audio_imbalance_two"] is None) == (not seen)
    plan = [[[x for x in samples[r::world][:3]]] for r in range(world)]
    decision = RoundDecision(
        0, 1, tuple(tuple(map(tuple, p)) for p in plan), plan_vision_round(plan, VisionCost()),
        plan_vision_round(plan, AudioCost())
    )  # fmt: skip
    assert wire.decision_from_pb(wire.decision_to_pb(decision, 0)) == decision
    assert (
        wire.decision_from_pb(wire.decision_to_pb(dataclasses.replace(decision, audio=None), 0)).audio is None
    )
