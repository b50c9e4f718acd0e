"""The daemon in one process: a real gRPC coordinator and rank services on loopback (port 0)."""

from __future__ import annotations

import logging
import queue
import threading
import time

import grpc
import numpy as np
import pytest
from _jobs import InProcessJob, job_pool

from batchd.client import BatchClient, BatchdError, JobFailed
from batchd.core import JobSpec, PolicySpec, RankState
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc
from batchd.proto import wire
from batchd.service import CoordinatorClient, RankServiceCore, create_rank_server, create_server
from batchd.service.preprocess import IngestSource, SyntheticSource, synthetic_payload


@pytest.fixture
def job_factory():
    with job_pool() as make:
        yield make


def _consume_all(job, limit_s=60.0):
    """Each rank's received steps: (sample ids, input_ids shape, StepInfo)."""
    return job.drain(limit_s, lambda b, info: (b["sample_ids"].tolist(), b["input_ids"].shape, info))


def _lengths(n=400, seed=1):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4.0, 0.9, n), 2, 900).astype(int).tolist()


@pytest.mark.parametrize("policy", ["local", "balanced", "odb"])
def test_four_ranks_equal_steps_every_id_once(job_factory, policy):
    lengths = _lengths()
    spec = JobSpec(
        world_size=4, token_budget=1024, seed=3, policy=PolicySpec(name=policy, window=32, depth=4)
    )
    results = _consume_all(job_factory(spec, lengths))
    steps = [len(r) for r in results]
    assert len(set(steps)) == 1 and steps[0] > 0
    ids = [i for r in results for ids, _, _ in r for i in ids]
    assert sorted(ids) == list(range(len(lengths)))
    for s in range(steps[0]):
        infos = [r[s][2] for r in results]
        assert {i.step for i in infos} == {s}
        assert abs(sum(i.loss_scale for i in infos) - 4) < 1e-9 or all(i.is_idle for i in infos)
        for ids_, shape, info in (r[s] for r in results):
            assert info.local_samples == len(ids_)
            if ids_:
                assert shape[0] == len(ids_) and shape[0] * shape[1] <= 1024
                assert shape[1] == max(lengths[i] for i in ids_)
    if policy == "balanced":
        assert any(
            info.local_samples and any(i % 4 != r for i in ids_)
            for r, res in enumerate(results)
            for ids_, _, info in res
        ), "balanced moved nothing"


def test_batches_carry_the_payloads_collated(job_factory):
    lengths = _lengths(60)
    spec = JobSpec(
        world_size=2,
        token_budget=2048,
        seed=5,
        policy=PolicySpec(name="local", window=16, depth=2, collate="packed"),
    )
    job = job_factory(spec, lengths)
    with job.client(0) as c:
        batch, info = next(iter(c))
    ids = batch["sample_ids"].tolist()
    payloads = [synthetic_payload(i, lengths[i], 5, 512) for i in ids]
    assert batch["input_ids"].shape == (1, sum(lengths[i] for i in ids))
    np.testing.assert_array_equal(
        batch["input_ids"][0].numpy(), np.concatenate([p["input_ids"] for p in payloads])
    )
    assert batch["cu_seqlens"].tolist() == list(np.cumsum([0] + [lengths[i] for i in ids]))
    assert info.local_loss_tokens == int((batch["labels"] != -100).sum())


@pytest.mark.parametrize("reply_bytes", [1, 16 << 20])
def test_moved_samples_arrive_intact_in_any_fetch_reply_size(job_factory, monkeypatch, reply_bytes):
    """The balanced plan moves samples: the training rank fetches their payloads from their home rank
    in one request per peer and round; a reply capped at 1 byte carries one sample at a time and the
    fetcher asks again for the rest. Every moved sample's tokens must arrive intact, in order."""
    from batchd.service.rank import Payloads, RankServicer

    monkeypatch.setattr(RankServicer, "fetch_reply_bytes", reply_bytes)
    calls = []
    real = Payloads.fetch_ids

    def counting(self, home, ids):
        out = real(self, home, ids)
        calls.append(len(ids))
        return out

    monkeypatch.setattr(Payloads, "fetch_ids", counting)
    lengths = _lengths(120)
    spec = JobSpec(
        world_size=2,
        token_budget=1024,
        seed=9,
        shuffle=False,
        policy=PolicySpec(name="balanced", window=24, depth=3, collate="packed"),
    )  # rank r's view: ids r, r + 2, ...
    job = job_factory(spec, lengths)
    results = job.drain(60, project=lambda b, info: (b["sample_ids"].tolist(), b["input_ids"][0].numpy()))
    ids = [i for r in results for step_ids, _ in r for i in step_ids]
    assert sorted(ids) == list(range(len(lengths)))
    moved = 0
    for r, res in enumerate(results):
        for step_ids, tokens in res:
            if step_ids:
                want = [synthetic_payload(i, lengths[i], 9, 512)["input_ids"] for i in step_ids]
                np.testing.assert_array_equal(tokens, np.concatenate(want))
                moved += sum(i % 2 != r for i in step_ids)
    assert moved > 0, "the plan moved nothing: the test would not exercise Fetch"
    assert sum(calls) == moved and len(calls) < moved  # batched: fewer requests than moved samples


def test_client_resumes_mid_epoch_from_its_state(job_factory):
    lengths = _lengths(200)
    spec = JobSpec(
        world_size=1, token_budget=512, seed=1, policy=PolicySpec(name="local", window=32, depth=3)
    )
    job = job_factory(spec, lengths)
    c = job.client(0)
    seen = []
    for k, (batch, _info) in enumerate(c):
        seen.append(batch["sample_ids"].tolist())
        if k == 4:
            break
    state = c.state_dict()
    c.close()
    assert state["next_step"] == 5
    c2 = job.client(0)
    c2.load_state_dict(state)
    seen += [b["sample_ids"].tolist() for b, _ in c2]
    assert sorted(i for ids in seen for i in ids) == list(range(200))
    with pytest.raises(ValueError, match="world_size: saved 1, current 2"):
        BatchClient(f"127.0.0.1:{job.ports[0]}", 0, 2).load_state_dict(state)
    with pytest.raises(ValueError, match="rank: saved 0, current 1"):
        BatchClient(f"127.0.0.1:{job.ports[0]}", 1, 2).load_state_dict(state)


@pytest.mark.parametrize("policy", ["local", "balanced"])
def test_each_epoch_serves_every_sample_once_in_a_new_order(job_factory, policy):
    n, epochs = 160, 3
    spec = JobSpec(
        world_size=2,
        token_budget=512,
        seed=3,
        epochs=epochs,
        policy=PolicySpec(name=policy, window=16, depth=3),
    )
    job = job_factory(spec, _lengths(n))
    got = job.drain_epochs(epochs, 60, lambda b, info: (b["sample_ids"].tolist(), info))
    orders = []
    for e in range(epochs):
        assert len(got[0][e]) == len(got[1][e]) > 0, "every rank runs the same steps in every epoch"
        for r in range(2):
            assert [info.step for _, info in got[r][e]] == list(range(len(got[r][e])))
        assert sorted(i for r in range(2) for ids, _ in got[r][e] for i in ids) == list(range(n))
        orders.append([i for ids, _ in got[0][e] for i in ids])
    assert len({tuple(o) for o in orders}) == epochs, "each epoch is a new seeded view"
    job.wait_state("done")
    assert job.state.epoch == epochs - 1
    with job.client(0) as c:  # the job runs `epochs` epochs: another one is refused, saying so
        assert c.job_epochs() == epochs
        c.set_epoch(epochs)
        with pytest.raises(BatchdError, match=f"the job runs {epochs} epoch"):
            list(c)


def test_rank_service_restarted_in_a_later_epoch_resumes_it(tmp_path):
    """A rank service restarted from its journal in epoch 1 (of 3) reloads that epoch's view, and the
    trainer's restored client finishes it and the next one: every id once per epoch."""
    n, epochs = 90, 3
    spec = JobSpec(
        world_size=1,
        token_budget=512,
        seed=5,
        epochs=epochs,
        policy=PolicySpec(name="local", window=16, depth=3),
    )
    lengths = _lengths(n)
    server, port, state = create_server("127.0.0.1:0", spec, lease_s=30, startup_timeout_s=60)
    server.start()
    started: list = []

    def start_rank():
        coord = CoordinatorClient(f"127.0.0.1:{port}", 0, spec, startup_timeout_s=5)
        core = RankServiceCore(
            0, spec, coord, SyntheticSource(lengths, 0, 1, spec.seed, 0, spec.shuffle), state_dir=tmp_path
        )
        rank_server, rank_port = create_rank_server("127.0.0.1:0", core)
        rank_server.start()
        core.start(f"127.0.0.1:{rank_port}")
        started.append((core, coord, rank_server))
        return core, f"127.0.0.1:{rank_port}"

    def stop(core, coord, rank_server):
        core.stop()
        core.join(10)
        coord.close()
        rank_server.stop(0)

    try:
        core, address = start_rank()
        seen: list[list[int]] = [[] for _ in range(epochs)]
        with BatchClient(address, 0, 1) as c:
            seen[0] += [i for b, _ in c for i in b["sample_ids"].tolist()]
            c.set_epoch(1)
            for k, (b, _) in enumerate(c):
                seen[1] += b["sample_ids"].tolist()
                if k == 2:
                    break
            saved = c.state_dict()
        stop(*started[-1])  # the service dies mid-epoch 1
        assert core.epoch == 1
        core, address = start_rank()
        assert core.epoch == 1 and core.state.epoch == 1 and core.source.view.epoch == 1
        with BatchClient(address, 0, 1) as c:
            c.load_state_dict(saved)
            c.set_epoch(1)  # the current epoch: keeps the restored position
            seen[1] += [i for b, _ in c for i in b["sample_ids"].tolist()]
            c.set_epoch(2)
            seen[2] += [i for b, _ in c for i in b["sample_ids"].tolist()]
        for e in range(epochs):
            assert sorted(seen[e]) == list(range(n)), f"epoch {e}"
        deadline = time.monotonic() + 30
        while state.state != "done":  # the rank tells the coordinator once its trainer took the last step
            assert time.monotonic() < deadline, f"coordinator still {state.state!r}: {state.failure}"
            time.sleep(0.05)
        # Killed after the job ended and the coordinator left: a restart needs no coordinator; it gives a
        # trainer that lost the last end that end again, and is done.
        stop(*started[-1])
        state.close()
        server.stop(0)
        core, address = start_rank()
        deadline = time.monotonic() + 10
        while not core.finished:
            assert time.monotonic() < deadline and core.failure is None, core.failure
            time.sleep(0.05)
        with BatchClient(address, 0, 1) as c:
            c.load_state_dict({**c.state_dict(), "epoch": epochs - 1, "next_step": core.delivery.made})
            assert list(c) == [] and c.finished
        assert core.failure is None
    finally:
        for parts in started:
            stop(*parts)
        state.close()
        server.stop(0)


def test_next_epoch_needs_the_end_of_this_one(job_factory):
    spec = JobSpec(
        world_size=1, token_budget=512, seed=1, epochs=2, policy=PolicySpec(name="local", window=16, depth=3)
    )
    job = job_factory(spec, _lengths(80))
    with job.client(0) as c:
        first = next(iter(c))
        c.set_epoch(1)  # skips the rest of epoch 0
        with pytest.raises(
            BatchdError,
            match="trainer asked for epoch 1, but rank 0 is in epoch 0 and its "
            "trainer has not taken that epoch's last step",
        ):
            list(c)
    assert first[1].step == 0


def test_end_of_epoch_waits_until_every_step_is_acknowledged(job_factory):
    """A trainer that holds its last batch unacknowledged does not get end of epoch, and the batch stays
    held for a restart; acknowledging it ends the stream with nothing left held."""
    spec = JobSpec(
        world_size=1, token_budget=512, seed=1, policy=PolicySpec(name="local", window=16, depth=3)
    )
    job = job_factory(spec, _lengths(60))
    core = job.cores[0]
    requests: queue.Queue = queue.Queue()
    received: queue.Queue = queue.Queue()
    stub = pb_grpc.RankServiceStub(grpc.insecure_channel(job.rank_address(0)))
    call = stub.Batches(iter(requests.get, None))

    def receive():
        try:
            for b in call:
                received.put(b)
        except grpc.RpcError as exc:  # the test's own cancel at the end
            assert exc.code() == grpc.StatusCode.CANCELLED, exc

    threading.Thread(target=receive, daemon=True).start()
    requests.put(pb.BatchRequest(start_step=0, credits=8, epoch=0))
    last = -1
    deadline = time.monotonic() + 60
    try:
        while True:  # acknowledge every step but the one just received, until the epoch's last one came
            assert time.monotonic() < deadline, "the epoch did not end"
            try:
                batch = received.get(timeout=0.5)
            except queue.Empty:
                with core.cond:  # the last step came and was not acknowledged: nothing is due
                    # (that no end follows is the state machine's contract, tested on a driven clock:
                    # test_delivery.py::test_end_of_epoch_waits_for_every_acknowledgement)
                    if core.done and last == core.delivery.made - 1 and core.delivery.acked == last:
                        assert core.delivery.next_for(core.delivery.holder) is None
                        break
                continue
            assert not batch.end_of_epoch, "end of epoch before the last step was acknowledged"
            assert batch.info.step == last + 1
            last = batch.info.step
            requests.put(pb.BatchRequest(ack_step=last))
        assert core.done and last > 2
        assert core.delivery.ready == [last] and not core.delivery.end_sent
        requests.put(pb.BatchRequest(ack_step=last + 1))
        assert received.get(timeout=10).end_of_epoch
        assert core.delivery.ready == [] and core.delivery.end_sent
    finally:
        requests.put(None)
        call.cancel()


def _coord_stub(job):
    return pb_grpc.CoordinatorStub(grpc.insecure_channel(job.address))


def test_coordinator_rejects_bad_messages_with_status_codes(caplog):
    spec = JobSpec(world_size=2, token_budget=100, policy=PolicySpec(name="local", window=4, depth=8))
    server, port, state = create_server("127.0.0.1:0", spec, 60, 60)
    server.start()
    try:
        stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        other = spec.replace(window=8)
        with caplog.at_level(logging.WARNING, logger="batchd.coordinator"):
            with pytest.raises(grpc.RpcError) as e:
                stub.Register(pb.RegisterRequest(rank=0, spec=wire.spec_to_pb(other), address="x"), timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "window" in e.value.details()
        assert any("window" in r.message for r in caplog.records), "no log line for the refused call"
        with pytest.raises(grpc.RpcError) as e:  # the epoch count is part of the spec, over the wire
            stub.Register(
                pb.RegisterRequest(rank=0, spec=wire.spec_to_pb(spec.replace(epochs=3)), address="x"),
                timeout=5,
            )
        assert (
            e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            and "epochs: coordinator 1, rank 3" in e.value.details()
        )
        stub.Register(pb.RegisterRequest(rank=0, spec=wire.spec_to_pb(spec), address="x"), timeout=5)
        with pytest.raises(grpc.RpcError) as e:  # out of order: round 7 while the coordinator is at 0
            stub.Align(pb.AlignRequest(rank=0, epoch=0, round=7, capacity=1), timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "round" in e.value.details()
        bad = pb.AlignRequest(
            rank=0,
            epoch=0,
            round=0,
            capacity=1,
            buffered=1,
            groups=1,
            pool=[pb.PoolEntry(sample=pb.SampleMeta(id=1, length=3, loss_tokens=9))],
        )
        with pytest.raises(grpc.RpcError) as e:  # malformed: more loss tokens than tokens
            stub.Align(bad, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "loss_tokens" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Align(pb.AlignRequest(rank=9, epoch=0, round=0), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rank 9" in e.value.details()
        blob = pb.ModalityTokens(name="x" * (65 << 20), tokens=1)
        huge = pb.AlignRequest(
            rank=0, pool=[pb.PoolEntry(sample=pb.SampleMeta(id=1, length=1, modality_tokens=[blob]))]
        )
        with pytest.raises(grpc.RpcError) as e:  # oversized: beyond the 64 MiB message limit
            stub.Align(huge, timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert state.state == "running", "a bad message must not fail or crash the job"
        with pytest.raises(grpc.RpcError) as e:  # the rank is checked before its (empty) spec
            stub.Register(pb.RegisterRequest(rank=99), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == "Register from rank 99, but the job has ranks 0..1 (world_size=2)"
        with pytest.raises(grpc.RpcError) as e:
            stub.Register(pb.RegisterRequest(rank=1), timeout=5)
        assert "Register from rank 1 carries an invalid job spec: policy must be one of" in e.value.details()
    finally:
        state.close()
        server.stop(0)


def test_a_second_trainer_and_bad_fetches_are_refused_naming_the_problem(job_factory):
    spec = JobSpec(
        world_size=2, token_budget=512, seed=1, policy=PolicySpec(name="local", window=16, depth=2)
    )
    job = job_factory(spec, _lengths(80))
    with job.client(0) as first, job.client(0) as second:
        it = iter(first)
        next(it)  # the first trainer holds rank 0's stream
        t0 = time.monotonic()
        with pytest.raises(
            BatchdError,
            match=r"FAILED_PRECONDITION: rank 0's batches already stream to trainer "
            r"ipv4:127\.0\.0\.1:\d+; a rank serves one trainer",
        ):
            next(iter(second))
        assert time.monotonic() - t0 < 30, "the second trainer must be refused, not left waiting"
        it.close()
    stub = pb_grpc.RankServiceStub(grpc.insecure_channel(job.rank_address(0)))
    with pytest.raises(grpc.RpcError) as e:
        stub.Fetch(pb.FetchRequest(ids=[1], epoch=77), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Fetch of samples of epoch 77, but rank 0 is in epoch 0" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.Fetch(pb.FetchRequest(ids=[10_000], epoch=0), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "rank 0 has no payload for sample 10000 of epoch 0" in e.value.details()
    assert "not in this dataset of 80 samples" in e.value.details()


def test_rank_started_long_before_its_coordinator_registers_in_time():
    """Services start in any order: a rank that has been refused for 6 s registers within its 8 s connect
    timeout once the coordinator is up. (With gRPC's default reconnect backoff its channel would be waiting
    out a ~4-6 s backoff then, and miss the deadline.)"""
    from batchd.launch import free_port

    spec = JobSpec(world_size=1, token_budget=100, policy=PolicySpec(name="local", window=4, depth=8))
    port = free_port()
    client = CoordinatorClient(f"127.0.0.1:{port}", 0, spec, startup_timeout_s=8)
    started: list = []

    def start_late():
        time.sleep(6.0)
        server, _, state = create_server(f"127.0.0.1:{port}", spec)
        server.start()
        started.append((server, state))

    t = threading.Thread(target=start_late, daemon=True)
    t.start()
    try:
        reply = client.register("127.0.0.1:1")
        assert reply.epoch == 0 and started
    finally:
        t.join()
        client.close()
        for server, state in started:
            state.close()
            server.stop(0)


def test_round_waits_for_a_live_rank_and_fails_on_a_gone_one():
    """Timeouts judge liveness, not speed: a round waits for rank 1 for three leases while it heartbeats;
    once rank 1 goes silent, the next round fails every waiting rank with a message naming it."""
    spec = JobSpec(world_size=3, token_budget=100, policy=PolicySpec(name="local", window=4, depth=8))
    server, port, state = create_server("127.0.0.1:0", spec, lease_s=1.0, startup_timeout_s=30)
    server.start()
    clients = [CoordinatorClient(f"127.0.0.1:{port}", r, spec, startup_timeout_s=10) for r in range(3)]
    try:
        failures: list = []
        for c in clients:
            c.register("x")
            c.start_heartbeats(failures.append)
        ranks = [RankState(spec.replace(world_size=3, token_budget=100, window=4), r) for r in range(3)]
        results: dict = {}

        def report(r, delay=0.0):
            time.sleep(delay)  # rank 1 is slow to report, but alive
            try:
                results[r] = clients[r].align(0, ranks[r].report(1))
            except Exception as exc:  # noqa: BLE001
                results[r] = exc

        threads = [threading.Thread(target=report, args=(r, 3.0 if r == 1 else 0.0)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(
            not isinstance(results.get(r), Exception) and results.get(r) is not None for r in range(3)
        ), results
        assert not failures and state.state == "running"
        clients[1].close()  # rank 1 is gone: no commit, no heartbeat
        commits: dict = {}

        def commit(r):
            try:
                commits[r] = clients[r].commit(0, ranks[r].apply(results[r]))
            except Exception as exc:  # noqa: BLE001
                commits[r] = exc

        threads = [threading.Thread(target=commit, args=(r,)) for r in (0, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(commits) == [0, 2], "a commit barrier did not end"
        for r in (0, 2):
            assert "rank 1 missed its lease" in str(commits[r]), commits[r]
        assert state.state == "failed" and "rank 1 missed its lease" in state.failure
        with pytest.raises(Exception, match=r"ABORTED.*rank 1 missed its lease"):
            clients[0].register("x")  # every later call gets the failure
    finally:
        for c in clients:
            c.close()
        state.close()
        server.stop(0)


def test_rank_that_never_registers_fails_the_job_at_the_startup_timeout():
    spec = JobSpec(world_size=2, token_budget=100, policy=PolicySpec(name="local", window=4, depth=8))
    server, port, state = create_server("127.0.0.1:0", spec, lease_s=30, startup_timeout_s=1.0)
    server.start()
    client = CoordinatorClient(f"127.0.0.1:{port}", 0, spec, startup_timeout_s=10)
    try:
        client.register("x")
        with pytest.raises(Exception, match=r"ABORTED.*rank\(s\) \[1\] did not register within the start-up"):
            client.align(0, RankState(spec.replace(world_size=2, token_budget=100, window=4), 0).report(1))
    finally:
        client.close()
        state.close()
        server.stop(0)


def test_silent_rank_misses_its_lease():
    spec = JobSpec(world_size=2, token_budget=100, policy=PolicySpec(name="local", window=4, depth=8))
    server, port, state = create_server("127.0.0.1:0", spec, lease_s=0.6, startup_timeout_s=30)
    server.start()
    try:
        c0, c1 = (CoordinatorClient(f"127.0.0.1:{port}", r, spec, startup_timeout_s=2) for r in (0, 1))
        c0.register("a")
        c1.register("b")
        failures = []
        c0.start_heartbeats(failures.append)
        deadline = time.monotonic() + 5
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failures and "rank 1 missed its lease" in failures[0]
        c0.close()
    finally:
        state.close()
        server.stop(0)


def test_dead_trainer_fails_every_party_naming_its_rank(job_factory):
    lengths = _lengths(300)
    spec = JobSpec(
        world_size=2, token_budget=512, seed=2, policy=PolicySpec(name="local", window=16, depth=2)
    )
    job = job_factory(spec, lengths, lease_s=3, grace=0.5)
    c0, c1 = job.client(0), job.client(1)
    it1 = iter(c1)
    next(it1)
    c1.close()  # rank 1's trainer goes away and does not come back
    t0 = time.monotonic()
    with pytest.raises(JobFailed, match="rank 1"):
        for _ in c0:
            pass
    assert time.monotonic() - t0 < 15
    assert job.state.state == "failed" and "rank 1" in job.state.failure


@pytest.mark.parametrize("epochs", [1, 2])
def test_trainer_that_never_connects_fails_the_job_naming_its_rank(job_factory, epochs):
    """Rank 1's trainer never connects (epochs=1) or does not come back for epoch 1 (epochs=2): once its
    ready batches waited trainer_timeout_s, rank 0's trainer gets JobFailed naming rank 1."""
    spec = JobSpec(
        world_size=2,
        token_budget=512,
        seed=2,
        epochs=epochs,
        policy=PolicySpec(name="local", window=16, depth=2),
    )
    job = job_factory(spec, _lengths(200), trainer_timeout_s=3.0)
    if epochs == 2:
        got = job.drain(30)  # both trainers take epoch 0; then only rank 0's comes back
        assert len(got[0]) == len(got[1]) > 0
    with job.client(0) as c0:
        c0.set_epoch(epochs - 1)
        with pytest.raises(JobFailed, match=r"rank 1: no trainer connected to rank 1's service for 3s"):
            for _ in c0:
                pass
    assert job.state.state == "failed" and "rank 1" in job.state.failure


def test_ingest_producer_of_the_next_epoch_waits_for_it():
    """A producer pushes epoch 0 and then epoch 1 (the same ids again) in one stream: the epoch-1 samples
    wait until the trainer has taken epoch 0, then fill epoch 1."""
    spec = JobSpec(
        world_size=1, token_budget=64, epochs=2, policy=PolicySpec(name="local", window=4, depth=8)
    )
    n = 12
    with InProcessJob(spec, sources=[IngestSource(capacity=4)], connect_timeout_s=30) as job:
        stub = pb_grpc.RankServiceStub(grpc.insecure_channel(job.rank_address(0)))

        def stream():
            for epoch in range(2):
                for i in range(n):
                    p = synthetic_payload(i, 5 + i, epoch, 100)
                    k = int((p["labels"][1:] != -100).sum())
                    yield pb.IngestRequest(
                        meta=pb.SampleMeta(id=i, length=5 + i, loss_tokens=k),
                        tensors=wire.tensors_to_pb(p),
                        epoch=epoch,
                    )
                yield pb.IngestRequest(end_of_epoch=True, epoch=epoch)

        replies: list = []
        producer = threading.Thread(
            target=lambda: replies.append(stub.Ingest(stream(), timeout=60)), daemon=True
        )
        producer.start()
        seen = []
        with job.client(0) as c:
            for epoch in range(2):
                c.set_epoch(epoch)
                seen.append(sorted(i for b, _ in c for i in b["sample_ids"].tolist()))
        producer.join(30)
        assert seen == [list(range(n))] * 2
        assert replies and replies[0].accepted == 2 * n and not replies[0].quarantined


def test_ingest_validates_quarantines_and_pushes_back(caplog):
    spec = JobSpec(world_size=1, token_budget=64, policy=PolicySpec(name="local", window=4, depth=8))
    with InProcessJob(spec, sources=[IngestSource(capacity=4)], connect_timeout_s=30) as job:
        rport = job.ports[0]
        stub = pb_grpc.RankServiceStub(grpc.insecure_channel(f"127.0.0.1:{rport}"))

        def req(i, n, loss=None, ids=None, epoch=0):
            p = synthetic_payload(i, n, 0, 100)
            if ids is not None:
                p["input_ids"] = ids
            k = int((p["labels"][1:] != -100).sum()) if loss is None else loss
            return pb.IngestRequest(
                meta=pb.SampleMeta(id=i, length=n, loss_tokens=k), tensors=wire.tensors_to_pb(p), epoch=epoch
            )

        bad_bytes = req(3, 5)
        bad_bytes.tensors[0].data = b"\x00\x01"
        msgs = [
            req(0, 10),
            req(1, 12, loss=0),
            req(2, 7, ids=np.zeros(3, np.int32)),
            bad_bytes,
            req(4, 9),
            pb.IngestRequest(end_of_epoch=True),
        ]
        with caplog.at_level(logging.WARNING, logger="batchd.rank"):
            reply = stub.Ingest(iter(msgs), timeout=20)
        assert reply.accepted == 2
        reasons = {q.id: q.reason for q in reply.quarantined}
        assert set(reasons) == {1, 2, 3}
        assert "loss_tokens" in reasons[1] and "length" in reasons[2] and "bytes" in reasons[3]
        assert sum("quarantined" in r.message for r in caplog.records) == 3
        with pytest.raises(grpc.RpcError) as e:
            stub.Ingest(iter([req(5, 4, epoch=3)]), timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "epoch" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Ingest(iter([req(0, 10)]), timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with BatchClient(f"127.0.0.1:{rport}", 0, 1) as c:
            got = sorted(i for b, _ in c for i in b["sample_ids"].tolist())
        assert got == [0, 4]
