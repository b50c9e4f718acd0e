"""Resizing a job mid-epoch, the pure parts: the step ledger, the remainder's views (`ViewSource`,
`BlockView`), where an epoch may resume (`resume_point`), and the simulator resized at any step to any
world size, join and non-join, with and without optimizer updates of several steps: every id exactly
once (join) or the quota exact (non-join), equal steps per world size, the loss scale exact.
"""

from __future__ import annotations

import collections
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchd.core import (
    BlockLayout,
    BlockView,
    JobSpec,
    PolicySpec,
    Remainder,
    Simulator,
    StepLedger,
    Updates,
    ViewSource,
    resume_point,
    simulate,
)


def test_ledger_keeps_each_steps_ids_and_forgets_the_steps_after_a_resume():
    ledger = StepLedger(epoch=2)
    ledger.add([[3, 1], [], [7]], [10, 0, 4])
    ledger.add([[2, 5, 6]], [9])
    assert ledger.steps == 4
    assert ledger.rows(0, 4) == [[3, 1], [], [7], [2, 5, 6]]
    assert ledger.consumed(3) == {1, 3, 7}
    assert ledger.totals(4) == ([2, 0, 1, 3], [10, 0, 4, 9])
    copy = StepLedger(epoch=2)
    copy.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert list(copy) == list(ledger)
    copy.truncate(2)
    assert list(copy) == [[3, 1], []] and copy.consumed(2) == {1, 3}
    with pytest.raises(ValueError, match="epoch: saved 2, current 3"):
        StepLedger(epoch=3).load_state_dict(ledger.state_dict())


@given(
    n=st.integers(0, 300),
    world=st.integers(1, 9),
    seed=st.integers(0, 5),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_a_remainder_is_dealt_once_over_the_new_ranks(n, world, seed, shuffle, data):
    """The new views hold exactly the ids not consumed, each once, in sizes that differ by at most one;
    the bitmap round-trip keeps the remainder."""
    consumed = data.draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=n)) if n else set()
    rem = Remainder(epoch=1, step=7, world_size=world, generation=1, consumed=consumed)
    assert Remainder.from_json(json.loads(json.dumps(rem.to_json()))) == rem
    views = [list(ViewSource(n, r, world, seed, 1, shuffle, remainder=rem)._view) for r in range(world)]
    ids = [i for v in views for i in v]
    assert sorted(ids) == sorted(set(range(n)) - consumed)
    assert max(map(len, views)) - min(map(len, views)) <= 1


@given(
    blocks=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    world=st.integers(1, 6),
    window=st.integers(1, 400),
    data=st.data(),
)
@settings(max_examples=60)
def test_a_block_remainder_reads_only_its_units_and_each_id_once(blocks, world, window, data):
    """BlockView over a remainder: the new ranks' views partition the ids left; a rank reads only its
    units' blocks; a window's distinct blocks fit the budget unless it holds one unit."""
    n = sum(blocks)
    consumed = data.draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=n)) if n else set()
    rem = Remainder(epoch=0, step=3, world_size=world, generation=2, consumed=consumed)
    nbytes = [10 * b + 1 for b in blocks]
    views = [
        BlockView(BlockLayout(blocks, nbytes, window), r, world, 5, 0, remainder=rem) for r in range(world)
    ]
    ids = [i for v in views for i in v.ids()]
    assert sorted(ids) == sorted(set(range(n)) - consumed)
    starts = [sum(blocks[:k]) for k in range(len(blocks))]
    for v in views:
        held = {k for w in range(len(v.windows)) for k in v.window_blocks(w)}
        for i in v.ids():
            assert any(starts[k] <= i < starts[k] + blocks[k] for k in held)
        for w in range(len(v.windows)):
            assert len(v.windows[w]) == 1 or sum(nbytes[k] for k in v.window_blocks(w)) <= window


def test_view_states_name_the_resize_they_read():
    rem = Remainder(epoch=0, step=4, world_size=2, generation=1, consumed={0, 1})
    plain, resized = ViewSource(10, 0, 2), ViewSource(10, 0, 2, remainder=rem)
    with pytest.raises(ValueError, match="resize: saved None, current \\[1, 4\\]"):
        resized.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match="remainder of a resize of epoch 0 to world_size 2"):
        ViewSource(10, 0, 3, remainder=rem)
    assert resized.for_epoch(1).remainder is None and plain.for_epoch(0, rem).remainder == rem


def test_resume_point_refuses_a_step_inside_an_update_or_past_the_ledger():
    ledger = StepLedger()
    ledger.add([[0], [1], [2], [3]], [5, 5, 5, 5])
    windows = JobSpec(
        world_size=2,
        token_budget=64,
        updates=Updates(tokens_per_update=10),
        policy=PolicySpec(name="local", window=512, depth=8),
    ).update_windows()
    point = resume_point(ledger, 2, windows)
    assert point.emitted == 2 and point.windows["updates"] == 1
    spec = JobSpec(
        world_size=2,
        token_budget=64,
        updates=Updates(tokens_per_update=10),
        policy=PolicySpec(name="local", window=512, depth=8),
    )
    with pytest.raises(ValueError, match="inside optimizer update 1 \\(steps 2..; it ends at step 3\\)"):
        resume_point(ledger, 3, spec.update_windows())
    with pytest.raises(ValueError, match="committed only 4 step"):
        resume_point(ledger, 5, spec.update_windows())


LENGTHS = [int(x) for x in "12 700 40 300 5 900 64 128 33 250 410 17 8 600 90 75 3 512 44 260".split()] * 12


@given(
    policy=st.sampled_from(["balanced", "local", "odb"]),
    mode=st.sampled_from(["join", "non-join"]),
    world=st.integers(1, 5),
    changes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 5)), max_size=3),
    per_update=st.sampled_from([None, 900, 2500]),
    seed=st.integers(0, 3),
)
@settings(max_examples=60, deadline=None)
def test_a_resize_at_any_step_keeps_every_id_once_and_the_loss_scale_exact(
    policy, mode, world, changes, per_update, seed
):
    """Join: every id exactly once over all world sizes; non-join: the quota exact. Every world size's
    steps are equal on its ranks, every update's loss scale exact, every change made at an update's
    first step."""
    spec = JobSpec(
        world_size=world,
        token_budget=1024,
        mode=mode,
        seed=seed,
        quota=len(LENGTHS) - 7 if mode == "non-join" else None,
        policy=PolicySpec(name=policy, window=16, depth=4),
        updates=Updates(tokens_per_update=per_update),
    )
    out = simulate(LENGTHS, spec, resize=changes)
    assert out["loss_scale_error"] < 1e-9
    if mode == "join":
        assert (out["missing"], out["duplicates"]) == (0, 0)
    else:
        assert out["emitted"] == len(LENGTHS) - 7
    for seg in out.get("segments", []):
        assert len(set(seg["steps_per_rank"])) <= 1, seg
    for made in out.get("resizes", []):
        assert made["step"] is None or made["step"] >= made["asked"]


def test_a_resized_simulator_resumes_from_its_state_exactly():
    """Saved after a resize (mid-epoch, steps pending), a new simulator of the original job restores
    the resized parties and yields the same steps."""
    spec = JobSpec(
        world_size=4,
        token_budget=1024,
        seed=3,
        policy=PolicySpec(name="balanced", window=16, depth=8),
        updates=Updates(tokens_per_update=1500),
    )
    sim = Simulator(LENGTHS, spec)
    while sim.taken < 6 or sim.update_open:
        sim.next_step()
    rem = sim.resize(2)
    assert rem.world_size == 2 and rem.step == sim.taken
    for _ in range(3):
        sim.next_step()
    state = json.loads(json.dumps(sim.state_dict()))
    rest = [[s.samples for s in step] for step in sim]
    again = Simulator(LENGTHS, spec)
    again.load_state_dict(state)
    assert [[s.samples for s in step] for step in again] == rest


def test_simulate_reports_each_change_and_what_the_epoch_lost_none_of():
    lengths = [random.Random(i).randint(8, 900) for i in range(400)]
    out = simulate(
        lengths,
        JobSpec(world_size=4, token_budget=2048, policy=PolicySpec(name="balanced", window=32, depth=8)),
        resize=[(5, 2), (9, 3), (10**6, 2)],
    )
    assert (out["missing"], out["duplicates"]) == (0, 0)
    assert [s["world_size"] for s in out["segments"]] == [4, 2, 3]
    first, second, never = out["resizes"]
    assert (first["step"], first["from"], first["to"]) == (5, 4, 2)
    assert (second["step"], second["from"], second["to"]) == (9, 2, 3)
    assert never["step"] is None
    assert 0 < first["after"]["padding_efficiency"] <= 1 and first["after"]["steps"] == 4
    counts = collections.Counter(s["world_size"] for s in out["segments"])
    assert counts == {4: 1, 2: 1, 3: 1}


def test_batchd_simulate_resize_prints_each_world_size_and_change(tmp_path, capsys):
    """`batchd simulate --resize STEP:W` as the docs show it: text and --json; a bad item is refused."""
    from batchd.cli import main

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(16 + (37 * i) % 500) for i in range(300)) + "\n")
    args = ["simulate", "--lengths", str(lengths), "--world-size", "4", "--token-budget", "1024", "--policy"]
    assert main([*args, "balanced", "--resize", "3:2,6:3", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "W=4" in text and "W=2" in text and "W=3" in text and "step 3 (asked 3): W 4 -> 2" in text
    assert main([*args, "balanced", "--resize", "3:2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["missing"], out["duplicates"]) == (0, 0) and out["resizes"][0]["to"] == 2
    with pytest.raises(SystemExit):
        main([*args, "balanced", "--resize", "3:0"])
    assert "expected STEP:W" in capsys.readouterr().err
