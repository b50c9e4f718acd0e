"""The coordinator's journal: the file format, its failure modes, and a coordinator restarted mid-job."""

from __future__ import annotations

import logging
import threading

import pytest
from _jobs import InProcessJob

from batchd.core import JobSpec, PolicySpec
from batchd.service import Journal, JournalError, decode_records, encode_record
from batchd.service.coordinator import JOURNAL, create_server

JOB = {"world_size": 2, "token_budget": 512}


def test_records_round_trip_and_a_torn_tail_is_cut_with_a_log_line(tmp_path, caplog):
    path = tmp_path / "j"
    j = Journal(path, JOB)
    assert j.open() == []
    for k in range(3):
        j.append({"kind": "decision", "round": k})
    j.close()
    whole = path.read_bytes()
    path.write_bytes(whole + encode_record({"kind": "totals", "round": 3})[:-7])  # a crash mid-write
    with caplog.at_level(logging.ERROR, logger="batchd.journal"):
        records = Journal(path, JOB).open()
    assert [r["round"] for r in records] == [0, 1, 2]
    assert path.read_bytes() == whole, "the torn record is cut off the file"
    assert any("torn write" in r.message and "bytes dropped" in r.message for r in caplog.records)


def test_a_corrupt_record_cuts_the_journal_there(tmp_path, caplog):
    path = tmp_path / "j"
    j = Journal(path, JOB)
    j.open()
    for k in range(4):
        j.append({"kind": "decision", "round": k})
    j.close()
    lines = path.read_bytes().split(b"\n")
    lines[3] = lines[3].replace(b'"round":2', b'"round":7')  # a flipped digit: the checksum no longer holds
    path.write_bytes(b"\n".join(lines))
    with caplog.at_level(logging.ERROR, logger="batchd.journal"):
        records = Journal(path, JOB).open()
    assert [r["round"] for r in records] == [0, 1]
    assert any("checksum does not match" in r.message for r in caplog.records)
    records, valid, bad = decode_records(path.read_bytes())
    assert bad is None and valid == path.stat().st_size


def test_a_journal_of_another_job_or_version_is_refused_naming_why(tmp_path):
    path = tmp_path / "j"
    Journal(path, JOB).open()
    with pytest.raises(
        JournalError, match=r"journal of another job \(token_budget: journal 512, this job 1024\)"
    ):
        Journal(path, {**JOB, "token_budget": 1024}).open()
    path.write_bytes(encode_record({"kind": "header", "version": 99, "job": JOB}))
    with pytest.raises(JournalError, match="journal version 99, this build reads version 1"):
        Journal(path, JOB).open()
    path.write_bytes(b"hello\n")
    with pytest.raises(JournalError, match="not a batchd journal"):
        Journal(path, JOB).open()


def test_coordinator_refuses_a_journal_of_another_job(tmp_path):
    spec = JobSpec(world_size=2, token_budget=512, policy=PolicySpec(name="local", window=8, depth=8))
    server, _, state = create_server("127.0.0.1:0", spec, state_dir=tmp_path)
    state.close()
    server.stop(0)
    assert (tmp_path / JOURNAL).exists()
    with pytest.raises(JournalError, match=r"another job \(.*window: journal 8, this job 16"):
        create_server("127.0.0.1:0", spec.replace(window=16), state_dir=tmp_path)


def test_a_compaction_keeps_the_record_that_triggered_it(tmp_path):
    """Compacting on every record: each snapshot is taken after the state took in the record that made
    the journal due (a registration, a decision, totals), so a restart still finds all of them."""
    from batchd.core import RankCommit, RankReport
    from batchd.service import CoordinatorState

    spec = JobSpec(world_size=1, token_budget=512, policy=PolicySpec(name="local", window=8, depth=8))
    state = CoordinatorState(spec, state_dir=tmp_path, compact_every=1)
    state.register(0, spec, "127.0.0.1:1")
    decision = state.submit_align(0, [RankReport(0, 0, 1, 0, 0, False, ())])
    totals = state.submit_commit(0, [RankCommit(0, 0, ((),) * decision.target, 0, False)])
    pending = state.submit_align(0, [RankReport(0, 1, 1, 0, 0, False, ())])
    state.close()
    again = CoordinatorState(spec, state_dir=tmp_path)
    try:
        assert again.restored and again.addresses == {0: "127.0.0.1:1"} and again.core.round == 1
        assert again.submit_commit(0, [RankCommit(0, 0, ((),) * decision.target, 0, False)]) == totals
        assert again.submit_align(0, [RankReport(0, 1, 1, 0, 0, False, ())]) == pending
    finally:
        again.close()


@pytest.mark.parametrize("policy", ["local", "balanced"])
def test_coordinator_restarted_mid_epoch_resumes_the_job(tmp_path, policy):
    """The coordinator is killed three times while two trainers read two epochs; each new one resumes from
    the journal: every id once per epoch, equal steps, and the job ends done."""
    n, epochs = 240, 2
    spec = JobSpec(
        world_size=2,
        token_budget=512,
        seed=5,
        epochs=epochs,
        policy=PolicySpec(name=policy, window=16, depth=2),
    )
    lengths = [8 + (i * 37) % 200 for i in range(n)]
    with InProcessJob(spec, lengths, lease_s=20, coordinator_state_dir=str(tmp_path)) as job:
        steps_seen = threading.Semaphore(0)
        got: list = [None, None]
        errors: list = []

        def consume(r):
            try:
                with job.client(r, reconnect_timeout_s=30) as c:
                    out = []
                    for e in range(epochs):
                        c.set_epoch(e)
                        ep = []
                        for b, info in c:
                            ep.append((b["sample_ids"].tolist(), info.step))
                            steps_seen.release()
                        out.append(ep)
                    got[r] = out
            except Exception as exc:  # noqa: BLE001
                errors.append((r, exc))

        threads = [threading.Thread(target=consume, args=(r,), daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        restarts = 0
        for _ in range(3):
            for _ in range(12):  # a few steps between kills
                if not steps_seen.acquire(timeout=60):
                    break
            if job.state.rounds_done:
                break
            job.restart_coordinator()
            restarts += 1
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert restarts >= 2, "the job ended before the coordinator was restarted twice"
        for e in range(epochs):
            assert len(got[0][e]) == len(got[1][e]) > 0
            for r in range(2):
                assert [s for _, s in got[r][e]] == list(range(len(got[r][e])))
            assert sorted(i for r in range(2) for ids, _ in got[r][e] for i in ids) == list(range(n)), (
                f"epoch {e}"
            )
        job.wait_state("done")
        assert job.state.restored
