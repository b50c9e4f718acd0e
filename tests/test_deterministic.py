"""`JobSpec.deterministic`: the same data, seed and config give the same batches whatever the timing.

Without it a rank reports whatever its source had ready by a short deadline, and the capacity its trainer
has freed: batches follow the speed of preprocessing and of the trainers. With it a rank reports only a
full window (or its source's end) and a fixed capacity (`report_capacity`, `fill_may_stop`). Checked here:
the two core rules (hypothesis), a rank's fill from a source that is slow at random moments, the flag on
the wire / in config files / on the command line, and in-process jobs whose sources and trainers run at
other random speeds (and one whose rank is killed and restarted from its journal) making exactly the
batches of a fast run, and of the simulator. The end-to-end check through `batchd demo` is in
tests/test_demo.py.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchd.core import JobSpec, PolicySpec, Simulator, fill_may_stop, report_capacity
from batchd.service import Limits, RankServiceCore
from batchd.service.preprocess import SyntheticSource
from batchd.testing import fixed_capacity


# -- the core rules --------------------------------------------------------------------------------
@given(depth=st.integers(1, 64), data=st.data(), deterministic=st.booleans())
def test_reported_capacity_fits_the_free_slots_and_is_fixed_when_deterministic(depth, data, deterministic):
    free = data.draw(st.integers(0, depth))
    c = report_capacity(free, depth, deterministic)
    if c is not None:
        assert 1 <= c <= free  # a round never makes more steps than fit
    if free == depth:
        assert c is not None  # a trainer that took every batch never blocks the next round
    if deterministic:
        assert c in (None, fixed_capacity(depth))  # never a function of the trainer's progress
        assert (c is None) == (free < fixed_capacity(depth))
        assert fixed_capacity(depth) == max(1, depth // 2)
    else:
        assert c == (free or None)


@given(room=st.integers(0, 8), exhausted=st.booleans(), buffered=st.integers(0, 8), past=st.booleans())
def test_a_deterministic_fill_stops_only_at_a_full_window_or_the_sources_end(room, exhausted, buffered, past):
    det = fill_may_stop(room, exhausted, buffered, True, past)
    default = fill_may_stop(room, exhausted, buffered, False, past)
    assert det == (room == 0 or exhausted)  # not the clock, not what happens to be buffered
    assert default >= det  # the default stops at least whenever deterministic mode does
    if room > 0 and not exhausted:
        assert default == (buffered > 0 or past)


def test_the_flag_travels_on_the_wire_in_config_files_and_on_the_command_line(tmp_path):
    from batchd.cli import build_parser
    from batchd.config import load_config
    from batchd.launch import spec_argv
    from batchd.proto import wire

    spec = JobSpec(world_size=2, token_budget=64, deterministic=True)
    assert wire.spec_from_pb(wire.spec_to_pb(spec)) == spec
    assert wire.spec_from_pb(wire.spec_to_pb(spec.replace(deterministic=False))).deterministic is False
    assert spec.diff(spec.replace(deterministic=False)) == {"deterministic": (True, False)}  # ranks agree
    cfg = tmp_path / "job.toml"
    cfg.write_text("[job]\nworld_size = 2\ntoken_budget = 64\ndeterministic = true\n")
    assert load_config(cfg, check_files=False).job == spec
    cfg.write_text("[job]\nworld_size = 2\ntoken_budget = 64\ndeterministic = 1\n")
    with pytest.raises(ValueError, match="deterministic"):
        load_config(cfg, check_files=False)
    assert "--deterministic" in spec_argv(spec) and "--no-deterministic" in spec_argv(
        spec.replace(deterministic=False)
    )
    parser = build_parser()
    for argv in (
        ["demo", "--deterministic"],
        ["bench", "--deterministic"],
        ["simulate", "--lengths", "x", "--deterministic"],
        ["rank", "--rank", "0", "--deterministic"],
        ["coordinator", "--deterministic"],
    ):
        assert parser.parse_args(argv).deterministic is True, argv
    assert parser.parse_args(["demo"]).deterministic is False


def test_the_simulator_reports_the_fixed_capacity():
    lengths = [int(x) for x in np.random.default_rng(0).integers(8, 120, 200)]
    spec = JobSpec(
        world_size=2,
        token_budget=256,
        deterministic=True,
        policy=PolicySpec(name="local", window=16, depth=6),
    )
    sim = Simulator(lengths, spec)
    while not sim.coordinator.done:
        assert sim.run_round() <= fixed_capacity(spec.policy.depth) == 3
        sim.pending = [type(q)() for q in sim.pending]  # the trainers took them


# -- a rank's fill ---------------------------------------------------------------------------------
class JitterySource(SyntheticSource):
    """A synthetic source whose samples are late at random moments (seeded): nothing is ready for a poll,
    or a poll waits a few ms first, like a `RaySource` whose actors are slow or busy."""

    def __init__(self, *args, jitter: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rng = random.Random(jitter) if jitter is not None else None

    def poll(self, timeout: float = 0.0):
        if self.rng is not None:
            x = self.rng.random()
            if x < 0.4:
                time.sleep(min(timeout, 0.002))
                return None
            if x < 0.5:
                time.sleep(0.002)
        return super().poll(timeout)


LENGTHS = [int(x) for x in np.random.default_rng(3).integers(8, 200, 240)]


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_deterministic_rank_reports_a_full_window_whatever_the_source_had_ready(deterministic):
    spec = JobSpec(
        world_size=2,
        token_budget=512,
        seed=5,
        deterministic=deterministic,
        policy=PolicySpec(name="local", window=24, depth=8),
    )
    fast = SyntheticSource(LENGTHS, 0, 2, spec.seed)
    expected = [fast.poll()[0].id for _ in range(spec.policy.window)]
    source = JitterySource(LENGTHS, 0, 2, spec.seed, jitter=1)
    core = RankServiceCore(0, spec, None, source, limits=Limits(fill_timeout_s=0.001))
    core._fill()
    got = [e.sample.id for e in core.state.buffer]
    if deterministic:
        assert got == expected and core.state.room == 0
    else:  # today's default: what was ready (a prefix of the view, its length by timing)
        assert got == expected[: len(got)] and len(got) < spec.policy.window


def test_a_deterministic_rank_refuses_a_source_in_completion_order():
    source = SyntheticSource(LENGTHS, 0, 2)
    source.ordered = False  # what a RaySource(ordered=False) says
    with pytest.raises(ValueError, match="deterministic=true needs a source that emits in its view's order"):
        RankServiceCore(
            0,
            JobSpec(
                world_size=2,
                token_budget=64,
                deterministic=True,
                policy=PolicySpec(name="local", window=512, depth=8),
            ),
            None,
            source,
        )
    RankServiceCore(
        0,
        JobSpec(world_size=2, token_budget=64, policy=PolicySpec(name="local", window=512, depth=8)),
        None,
        source,
    )  # the default mode takes it


# -- in-process jobs -------------------------------------------------------------------------------
def _run(
    spec: JobSpec, jitter: int | None, slow_trainer: bool, tmp_path=None, crash_round: int | None = None
):
    """Per rank, the sample ids of each step and the step's global loss-token total."""
    from _jobs import InProcessJob, drain_clients

    from batchd.core import CoordinatorError

    def source(r, salt=0):
        return JitterySource(
            LENGTHS, r, spec.world_size, spec.seed, jitter=None if jitter is None else jitter * 10 + r + salt
        )

    rng = random.Random(jitter)

    def project(b, info):
        if slow_trainer:
            time.sleep(rng.choice((0.0, 0.0, 0.002, 0.01)))
        return np.asarray(b["sample_ids"]).tolist(), info.global_loss_tokens, info.is_idle

    with InProcessJob(
        spec, sources=[source(r) for r in range(spec.world_size)], rank_state_dir=tmp_path, grace=30.0
    ) as job:
        crashed = threading.Event()
        if crash_round is not None:
            core = job.cores[1]
            align = core.coord.align

            def align_then_die(epoch, report):  # a kill -9 between the coordinator's decision and the journal
                decision = align(epoch, report)
                if report.round == crash_round and not crashed.is_set():
                    crashed.set()
                    threading.Thread(
                        target=job.restart_rank, args=(1, source(1, salt=5)), daemon=True
                    ).start()
                    core._stop.set()
                    raise CoordinatorError("killed")
                return decision

            core.coord.align = align_then_die
        results = drain_clients(
            lambda r: job.client(r, reconnect_timeout_s=30), spec.world_size, 1, 120.0, project
        )
        assert crash_round is None or crashed.is_set()
    return [r[0] for r in results]


@pytest.mark.parametrize("policy, align", [("balanced", "min"), ("local", "min"), ("odb", "odb")])
def test_a_deterministic_job_makes_the_same_batches_whatever_the_speed_of_sources_and_trainers(policy, align):
    spec = JobSpec(
        world_size=2,
        token_budget=512,
        seed=5,
        deterministic=True,
        policy=PolicySpec(name=policy, window=16, depth=4, align=align),
    )
    fast = _run(spec, None, False)
    slow = _run(spec, 7, True)
    assert slow == fast
    assert sorted(i for r in fast for ids, _, _ in r for i in ids) == list(range(len(LENGTHS)))
    # ... and they are the simulator's (its loss-token counts are synthetic): a function of data,
    # seed, config.
    sim = [
        [([x.id for x in s.samples], s.info.is_idle) for s in steps]
        for steps in zip(*Simulator(LENGTHS, spec), strict=False)
    ]
    assert [[(ids, idle) for ids, _, idle in r] for r in fast] == sim


def test_a_deterministic_rank_killed_mid_job_resumes_the_same_batches(tmp_path):
    """kill -9 after a decided round, restart from the journal with a source of other timing: every sample
    once (exactly-once), and the very batches of a run without the crash."""
    spec = JobSpec(
        world_size=2,
        token_budget=512,
        seed=5,
        deterministic=True,
        policy=PolicySpec(name="balanced", window=16, depth=4),
    )
    plain = _run(spec, None, False)
    crashed = _run(spec, 3, True, tmp_path, crash_round=3)
    assert crashed == plain
