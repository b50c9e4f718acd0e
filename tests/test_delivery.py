"""The lifecycle state machines, driven by hand-moved clocks: `Delivery` (a rank's steps to its trainer)
and `Liveness` (the coordinator's view of who is alive). Pure code, so every interleaving hypothesis
finds is a real one, and every timeout is judged at the exact instants that matter.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchd.core import ATTACHED, END, SEND_END, WAIT, Delivery, Liveness
from batchd.testing import REFUSED

GRACE, TRAINER = 30.0, 1800.0


def _delivery(epochs=1, depth=3, now=0.0) -> Delivery:
    return Delivery(0, epochs, depth, GRACE, TRAINER, now)


# -- Delivery: a driven model of the round loop and a trainer that may be slow, leave and come back --------

ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["make", "take", "ack", "leave", "back", "wait"]),
        st.floats(min_value=0.0, max_value=3600.0),
    ),
    max_size=120,
)


@given(
    steps_per_epoch=st.lists(st.integers(0, 12), min_size=1, max_size=3),
    depth=st.integers(1, 4),
    credits=st.integers(1, 4),
    actions=ACTIONS,
)
def test_every_step_reaches_the_trainer_once_in_order_and_timeouts_judge_only_absence(
    steps_per_epoch, depth, credits, actions
):
    """Whatever the order of events and however long the trainer takes per step, the trainer receives
    every step of every epoch exactly once, in order (a restarted trainer resumes at the step after its
    last consumed one), then the end of each epoch after acknowledging all of it; a failure is only
    ever raised while no trainer is connected, after the grace (gone mid-epoch) or trainer timeout."""
    epochs = len(steps_per_epoch)
    d = Delivery(0, epochs, depth, GRACE, TRAINER, 0.0)
    now, client, n_clients = 0.0, "t0", 0
    consumed: list[list[int]] = [[] for _ in range(epochs)]
    in_flight: list[int] = []  # sent, not yet consumed (lost if the trainer leaves)
    attached = d.connect(client, 0, 0, credits, now).outcome == ATTACHED
    trainer_epoch = 0
    for kind, dt in actions + [("drain", 0.0)] * 200:
        if d.finished:
            break
        now += dt
        failure = d.check(now)
        if failure is not None:
            assert not attached, f"failed while a trainer was connected: {failure}"
            assert d.gone_since is not None or not d.end_sent
            return
        if kind in ("make", "drain") and not d.done:  # the round loop: one round, up to its capacity
            todo = steps_per_epoch[d.epoch] - d.made
            k = min(d.capacity, todo, 2)
            if k > 0:
                d.add(list(range(d.made, d.made + k)))
            if d.made == steps_per_epoch[d.epoch]:
                d.close()
        if d.can_advance:
            d.advance(now)
        if kind == "leave" and attached:
            d.disconnect(client, now)
            attached, in_flight = False, []
            continue
        if kind in ("back", "drain") and not attached:
            n_clients += 1
            client = f"t{n_clients}"
            start = len(consumed[trainer_epoch])
            c = d.connect(client, trainer_epoch, start, credits, now)
            if c.outcome == END:
                trainer_epoch += 1
                continue
            if c.outcome == WAIT:
                continue
            assert c.outcome == ATTACHED, c
            attached = True
        if not attached:
            continue
        nxt = d.next_for(client)
        if nxt == SEND_END:
            d.mark_end_sent(client)
            assert consumed[trainer_epoch] == list(range(steps_per_epoch[trainer_epoch]))
            d.disconnect(client, now)
            attached, in_flight = False, []
            trainer_epoch += 1
            continue
        if nxt is not None and kind in ("take", "drain", "make", "wait"):
            in_flight.append(nxt)
            d.sent(client, nxt)
        if kind in ("ack", "drain", "take") and in_flight:
            step = in_flight.pop(0)
            consumed[trainer_epoch].append(step)
            d.ack(client, step + 1)
    assert d.finished, f"the drain did not finish the job: {d.state_dict()}"
    if d.finished:
        assert trainer_epoch == epochs
        for e in range(epochs):
            assert consumed[e] == list(range(steps_per_epoch[e])), f"epoch {e}"
        assert d.check(now + 10 * TRAINER) is None, "a finished rank never fails"


def test_a_slow_trainer_never_fails_however_long_a_step_takes():
    d = _delivery(depth=2)
    assert d.connect("t", 0, 0, 2, 0.0).outcome == ATTACHED
    d.add([0, 1])
    for step, now in ((0, 1e3), (1, 1e6)):  # ~12 days for the second step
        assert d.next_for("t") == step
        d.sent("t", step)
        assert d.check(now) is None
        d.ack("t", step + 1)
    d.close()
    assert d.next_for("t") == SEND_END and d.check(1e9) is None


def test_a_trainer_gone_mid_epoch_fails_after_the_grace_naming_the_rank():
    d = Delivery(3, 1, 2, GRACE, TRAINER, 0.0)
    d.connect("t", 0, 0, 2, 0.0)
    d.add([0])
    d.disconnect("t", 100.0)
    assert d.check(100.0 + GRACE) is None  # exactly the grace: still allowed
    assert d.check(100.0 + GRACE + 0.01) == "trainer of rank 3 disconnected and did not reconnect within 30s"
    assert d.connect("t2", 0, 0, 2, 120.0).outcome == ATTACHED  # back in time: no failure
    assert d.check(1e6) is None


def test_a_trainer_that_never_connects_fails_after_the_trainer_timeout_only_once_batches_wait():
    d = _delivery()
    assert d.check(10 * TRAINER) is None, "nothing is ready: nobody is kept waiting"
    d.add([0])  # made at 2 * TRAINER; waiting counts from the last time a trainer was there (never)
    assert "no trainer connected to rank 0's service for 1800s" in d.check(10 * TRAINER)


def test_the_next_epoch_may_start_after_a_long_evaluation():
    d = _delivery(epochs=2)
    d.connect("t", 0, 0, 1, 0.0)
    d.add([0])
    d.close()
    d.sent("t", d.next_for("t"))
    d.ack("t", 1)
    d.mark_end_sent("t")
    d.disconnect("t", 10.0)
    d.advance(10.0)
    d.add([0])  # epoch 1's first step waits while the trainer evaluates
    assert d.check(10.0 + TRAINER - 1) is None, "the grace does not apply between epochs"
    assert d.check(10.0 + TRAINER + 1) is not None


def test_end_of_epoch_waits_for_every_acknowledgement():
    d = _delivery(depth=3)
    d.connect("t", 0, 0, 3, 0.0)
    d.add([0, 1])
    d.close()
    for s in (0, 1):
        assert d.next_for("t") == s
        d.sent("t", s)
    d.ack("t", 1)
    assert d.next_for("t") is None and d.ready == [1], "step 1 stays held for a restarted trainer"
    with pytest.raises(ValueError, match="not due"):
        d.mark_end_sent("t")
    d.ack("t", 2)
    assert d.next_for("t") == SEND_END and d.ready == []


def test_credits_bound_what_is_sent_ahead():
    d = _delivery(depth=4)
    d.connect("t", 0, 0, 2, 0.0)
    d.add([0, 1, 2, 3])
    sent = []
    while (n := d.next_for("t")) is not None:
        sent.append(n)
        d.sent("t", n)
    assert sent == [0, 1]
    d.ack("t", 1)
    assert d.next_for("t") == 2


def test_refusals_name_the_problem():
    d = _delivery(epochs=2, depth=2)
    assert d.connect("a", 0, 0, 1, 0.0).outcome == ATTACHED
    busy = d.connect("b", 0, 0, 1, 0.0)
    assert busy.outcome == REFUSED and "already stream to trainer a" in busy.reason
    d.add([0, 1])
    d.ack("a", 2)
    d.checkpoint("a", 0, 2, durable=True)  # the trainer saved at step 2: steps before it are freed
    d.disconnect("a", 1.0)
    freed = d.connect("b", 0, 1, 1, 1.0)
    assert (
        freed.outcome == REFUSED
        and "at step 1 of epoch 0, but this rank holds steps only from epoch 0 step 2 on" in freed.reason
    )
    ahead = d.connect("b", 0, 5, 1, 1.0)
    assert ahead.outcome == REFUSED and "made 2 step(s) so far" in ahead.reason
    early = d.connect("b", 1, 0, 1, 1.0)
    assert early.outcome == REFUSED and "has not taken that epoch's last step" in early.reason
    beyond = d.connect("b", 7, 0, 1, 1.0)
    assert beyond.outcome == REFUSED and "the job runs 2 epoch(s), 0..1" in beyond.reason


def test_epoch_hand_off_wait_and_a_lost_end():
    d = _delivery(epochs=2, depth=1)
    d.connect("a", 0, 0, 1, 0.0)
    d.add([0])
    d.close()
    d.sent("a", 0)
    d.ack("a", 1)
    d.mark_end_sent("a")
    d.checkpoint("a", 0, 1, durable=True)  # saved at the epoch's end: epoch 0 is no longer held
    d.disconnect("a", 1.0)
    assert d.connect("b", 1, 0, 1, 1.0).outcome == WAIT, "epoch 1 starts once the loop hands off"
    d.advance(1.0)
    assert d.connect("c", 0, 1, 1, 1.0).outcome == END, "took every step of epoch 0 but lost the end"
    assert d.connect("c", 0, 0, 1, 1.0).outcome == REFUSED
    assert d.connect("b", 1, 0, 1, 1.0).outcome == ATTACHED


def test_state_round_trip_resumes_delivery():
    d = _delivery(epochs=2, depth=3)
    d.connect("a", 0, 0, 3, 0.0)
    d.add([0, 1, 2])
    d.ack("a", 1)
    state = d.state_dict()
    e = _delivery(epochs=2, depth=3, now=50.0)
    e.load_state_dict(state, 50.0)
    assert e.state_dict() == state and e.holder is None and e.ready == [1, 2]
    assert e.connect("b", 0, 1, 3, 50.0).outcome == ATTACHED and e.next_for("b") == 1


# -- Liveness ------------------------------------------------------------------------------------------


@given(
    world=st.integers(1, 5),
    lease=st.floats(0.5, 100),
    startup=st.floats(1, 1000),
    events=st.lists(
        st.tuples(
            st.sampled_from(["register", "seen", "finish", "tick"]), st.integers(0, 4), st.floats(0, 200)
        ),
        max_size=60,
    ),
)
def test_liveness_fails_exactly_when_a_party_is_gone(world, lease, startup, events):
    """`check` fails iff some rank never registered within the start-up timeout, or some registered,
    unfinished rank has been silent for longer than the lease; the message names that rank."""
    lv = Liveness(world, lease, startup, 0.0)
    now = 0.0
    last: dict[int, float] = {}
    finished: set[int] = set()
    for kind, rank, dt in events:
        now += dt
        rank %= world
        if kind == "register":
            lv.register(rank, now)
            last[rank] = now
        elif kind == "seen":
            lv.seen(rank, now)
            if rank in last:
                last[rank] = now
        elif kind == "finish":
            lv.finish(rank, now)
            last.setdefault(rank, now)
            finished.add(rank)
        missing = [r for r in range(world) if r not in last]
        silent = [r for r in sorted(last) if r not in finished and now - last[r] > lease]
        failure = lv.check(now)
        if missing and now > startup:
            assert failure is not None and f"rank(s) {missing} did not register" in failure
        elif silent:
            assert failure is not None and f"rank {silent[0]} missed its lease" in failure
        else:
            assert failure is None
        assert lv.all_finished == (len(finished) == world)


def test_liveness_restore_gives_every_rank_a_fresh_lease():
    lv = Liveness(2, 10.0, 60.0, 0.0)
    lv.register(0, 0.0)
    lv.register(1, 0.0)
    lv.finish(1, 5.0)
    state = lv.state_dict()
    restarted = Liveness(2, 10.0, 60.0, 500.0)
    restarted.load_state_dict(state, 500.0)
    assert restarted.check(509.0) is None and "rank 0 missed its lease" in restarted.check(511.0)
    assert restarted.finished == {1} and restarted.waiting(500.0) is None


def test_liveness_says_whom_it_waits_for():
    lv = Liveness(3, 10.0, 60.0, 0.0)
    lv.register(1, 0.0)
    assert (
        lv.waiting(12.0)
        == "waiting for rank(s) [0, 2] to register (12s so far, 48s left of the start-up timeout)"
    )


# -- Delivery to a model-parallel group: several processes share one rank's steps ---------------------------

GROUP_ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["make", "take", "ack", "leave", "back", "wait"]),
        st.integers(0, 3),
        st.floats(min_value=0.0, max_value=100.0),
    ),
    max_size=150,
)


@given(
    steps_per_epoch=st.lists(st.integers(0, 8), min_size=1, max_size=2),
    depth=st.integers(1, 4),
    group=st.integers(1, 3),
    credits=st.integers(1, 3),
    actions=GROUP_ACTIONS,
)
def test_every_member_of_a_group_gets_every_step_once_and_a_step_is_freed_only_when_all_took_it(
    steps_per_epoch, depth, group, credits, actions
):
    """Whatever the interleaving of the members (each slow, leaving and coming back on its own), every
    member receives every step of every epoch exactly once, in order; a step leaves `ready` only once
    every member acknowledged it; a member gets the end of an epoch only once all acknowledged all of it;
    a failure is raised only while a member is absent, naming that member."""
    epochs = len(steps_per_epoch)
    d = Delivery(0, epochs, depth, GRACE, TRAINER, 0.0)
    now = 0.0
    consumed = [[[] for _ in range(epochs)] for _ in range(group)]
    in_flight: list[list[int]] = [[] for _ in range(group)]
    client: list[str | None] = [None] * group
    epoch_of = [0] * group
    n = 0

    def attach(k: int) -> None:
        nonlocal n
        n += 1
        name = f"m{k}-{n}"
        c = d.connect(name, epoch_of[k], len(consumed[k][epoch_of[k]]), credits, now, k, group)
        if c.outcome == END:
            epoch_of[k] += 1
        elif c.outcome == ATTACHED:
            client[k] = name
        else:
            assert c.outcome == WAIT, c

    for kind, k, dt in actions + [("drain", k, 0.0) for _ in range(150) for k in range(group)]:
        if d.finished:
            break
        k %= group
        now += dt
        failure = d.check(now)
        if failure is not None:
            assert group == 1 or "group member" in failure
            gone = [j for j in range(group) if client[j] is None]
            assert gone and any(f"member {j} of {group}" in failure for j in gone) or group == 1, failure
            return
        if kind in ("make", "drain") and not d.done:
            todo = steps_per_epoch[d.epoch] - d.made
            if (m := min(d.capacity, todo, 2)) > 0:
                d.add(list(range(d.made, d.made + m)))
            if d.made == steps_per_epoch[d.epoch]:
                d.close()
        if d.can_advance:
            d.advance(now)
        if epoch_of[k] >= epochs:
            continue
        if kind == "leave" and client[k] is not None:
            d.disconnect(client[k], now)
            client[k], in_flight[k] = None, []
            continue
        if kind in ("back", "drain") and client[k] is None:
            attach(k)
        if client[k] is None:
            continue
        nxt = d.next_for(client[k])
        if nxt == SEND_END:
            assert all(len(consumed[j][epoch_of[k]]) == steps_per_epoch[epoch_of[k]] for j in range(group)), (
                "the end went to a member before every member took every step"
            )
            d.mark_end_sent(client[k])
            d.disconnect(client[k], now)
            client[k], in_flight[k] = None, []
            epoch_of[k] += 1
            continue
        if nxt is not None and kind in ("take", "drain", "make", "wait"):
            in_flight[k].append(nxt)
            d.sent(client[k], nxt)
        if kind in ("ack", "drain", "take") and in_flight[k]:
            step = in_flight[k].pop(0)
            consumed[k][epoch_of[k]].append(step)
            d.ack(client[k], step + 1)
        if d.epoch == epoch_of[k]:  # a step is held until the slowest member of the group consumed it
            slowest = min(len(consumed[j][d.epoch]) for j in range(group))
            assert d.ready == [s for s in range(slowest, d.made)], (d.ready, slowest, d.made)
    assert d.finished, f"the drain did not finish the job: {d.state_dict()}"
    for k in range(group):
        for e in range(epochs):
            assert consumed[k][e] == list(range(steps_per_epoch[e])), f"member {k}, epoch {e}"


def test_a_group_refuses_another_size_and_a_second_process_for_a_member():
    d = _delivery(depth=2)
    assert d.connect("a0", 0, 0, 1, 0.0, 0, 2).outcome == ATTACHED
    other = d.connect("x", 0, 0, 1, 0.0, 1, 3)
    assert (
        other.outcome == REFUSED
        and "form a group of 2 process(es), but this trainer says its group has 3" in other.reason
    )
    assert d.connect("a1", 0, 0, 1, 0.0, 1, 2).outcome == ATTACHED
    twice = d.connect("b1", 0, 0, 1, 0.0, 1, 2)
    assert (
        twice.outcome == REFUSED
        and "rank 0's group member 1's batches already stream to trainer a1" in twice.reason
    )
    with pytest.raises(ValueError, match="member"):
        d.connect("c", 0, 0, 1, 0.0, 2, 2)


def test_a_group_member_gone_fails_the_job_naming_the_member_and_the_group_restores():
    d = Delivery(1, 1, 2, GRACE, TRAINER, 0.0)
    d.connect("a0", 0, 0, 2, 0.0, 0, 2)
    d.connect("a1", 0, 0, 2, 0.0, 1, 2)
    d.add([0, 1])
    d.sent("a0", 0)
    d.ack("a0", 1)
    assert d.ready == [0, 1] and d.acked == 0, "member 1 has not taken step 0: it stays held"
    d.sent("a1", 0)
    d.ack("a1", 1)
    assert d.ready == [1] and d.acked == 1
    d.disconnect("a1", 10.0)
    assert d.check(10.0 + GRACE) is None
    assert d.check(10.0 + GRACE + 0.01) == (
        "trainer of rank 1 (group member 1 of 2) disconnected and did not reconnect within 30s"
    )
    e = Delivery(1, 1, 2, GRACE, TRAINER, 50.0)
    e.load_state_dict(json.loads(json.dumps(d.state_dict())), 50.0)
    assert e.group_size == 2 and e.ready == [1] and e.holder is None
    assert e.connect("b0", 0, 1, 2, 50.0, 0, 3).outcome == REFUSED, "the restored group keeps its size"
    assert e.connect("b0", 0, 1, 2, 50.0, 0, 2).outcome == ATTACHED and e.next_for("b0") == 1


def test_a_restored_finished_group_gives_a_member_that_lost_the_end_the_end_again():
    d = _delivery(depth=2)
    for k in range(2):
        d.connect(f"a{k}", 0, 0, 2, 0.0, k, 2)
    d.add([0])
    d.close()
    for k in range(2):
        d.sent(f"a{k}", 0)
        d.ack(f"a{k}", 1)
    for k in range(2):
        d.mark_end_sent(f"a{k}")
    assert d.finished
    e = _delivery(depth=2)
    e.load_state_dict(d.state_dict(), 1.0)
    assert e.connect("b1", 0, 1, 2, 1.0, 1, 2).outcome == ATTACHED and e.next_for("b1") == SEND_END
