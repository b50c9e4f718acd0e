"""Prometheus metrics of the coordinator and the rank services, scraped over HTTP from real services.

An in-process job (a gRPC coordinator and rank services on loopback, port 0, each with its own
registry and metrics endpoint) is drained by real `BatchClient`s; every counter is then checked against
what the trainers received: samples, real and materialized tokens, padding efficiency, steps and IDLE
steps per rank, the per-rank cost and imbalance recomputed from the received batches, and the round
histograms against the coordinator's round count. Quarantine counts are checked against the samples an
`Ingest` stream sent and the ones that never reached the trainer. One slow test runs
`run_coordinator` / `run_rank` as processes and reads the metrics port from their port files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from _jobs import InProcessJob, job_pool
from prometheus_client.parser import text_string_to_metric_families

from batchd.client import BatchClient
from batchd.core import JobSpec, PolicySpec
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc
from batchd.proto import wire
from batchd.service import (
    CoordinatorMetrics,
    RankMetrics,
    RateWindow,
    start_metrics_server,
    stop_metrics_server,
)
from batchd.service.preprocess import IngestSource, synthetic_payload

REPO = Path(__file__).resolve().parents[1]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape of http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(m: dict, name: str, **labels: str) -> float:
    return m[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def jobs():
    with job_pool(metrics=True) as make:
        yield make


def _drain(job: InProcessJob, limit_s: float = 60.0) -> list[list[tuple[list[int], int, object]]]:
    """Each rank's received steps: (sample ids, input_ids elements, StepInfo)."""
    return job.drain(limit_s, lambda b, info: (b["sample_ids"].tolist(), int(b["input_ids"].numel()), info))


def skewed_lengths(n: int = 240, seed: int = 7) -> list[int]:
    """Even ids short, odd ids long: with an unshuffled 2-rank split, rank 0 runs out of groups first
    (IDLE)."""
    rng = np.random.default_rng(seed)
    return [int(rng.integers(8, 40)) if i % 2 == 0 else int(rng.integers(150, 500)) for i in range(n)]


@pytest.mark.parametrize(
    "policy,collate,quota",
    [("local", "padded", None), ("balanced", "packed", None), ("local", "padded", 301)],
)
def test_counters_equal_what_the_trainers_received(jobs, policy, collate, quota):
    lengths = skewed_lengths()
    mode = "join" if quota is None else "non-join"  # non-join: 301 samples, the last step is cut mid-group
    spec = JobSpec(
        world_size=2,
        token_budget=1024,
        seed=2,
        shuffle=False,
        mode=mode,
        quota=quota,
        policy=PolicySpec(name=policy, window=24, depth=3, collate=collate),
    )
    job = jobs(spec, lengths)
    got = _drain(job)
    job.wait_state("done")  # every rank told the coordinator its trainer took the last step
    t_scrape0 = time.monotonic()
    coord = scrape(job.coordinator_metrics_port)
    ranks = [scrape(job.rank_metrics_port(r)) for r in range(2)]
    t_scrape1 = time.monotonic()
    rounds = job.state.core.round
    assert rounds > 1
    cost = spec.cost_model().cost
    n_steps = len(got[0])
    assert len(got[1]) == n_steps > 0

    for r, (steps, m) in enumerate(zip(got, ranks, strict=False)):
        rk = {"rank": str(r)}
        real = [s for s in steps if not s[2].is_idle]
        samples = sum(len(ids) for ids, _, _ in real)
        tokens = sum(lengths[i] for ids, _, _ in real for i in ids)
        padded = sum(n for _, n, _ in real)
        idle = len(steps) - len(real)
        assert samples > 0 and tokens == sum(s[2].local_tokens for s in steps)
        assert value(m, "batchd_samples_total", **rk) == samples
        assert value(m, "batchd_real_tokens_total", **rk) == tokens
        assert value(m, "batchd_padded_tokens_total", **rk) == padded
        assert value(m, "batchd_padding_efficiency", **rk) == pytest.approx(tokens / padded, rel=1e-12)
        if collate == "packed":
            assert padded == tokens
        else:
            assert padded > tokens  # padded rows: the efficiency gauge is not trivially 1
        assert value(m, "batchd_steps_total", **rk) == len(steps)
        assert value(m, "batchd_idle_steps_total", **rk) == idle
        assert value(m, "batchd_rounds_total", **rk) == rounds
        assert value(m, "batchd_round_latency_seconds_count", **rk) == rounds
        assert value(m, "batchd_round_latency_seconds_bucket", le="+Inf", **rk) == rounds
        assert 0 < value(m, "batchd_round_latency_seconds_sum", **rk) < t_scrape0 - job.t_created
        # end of epoch comes only after the trainer acknowledged every step: nothing is left held
        assert job.cores[r].delivery.acked == len(steps)
        assert value(m, "batchd_ready_batches", **rk) == len(job.cores[r].delivery.ready) == 0
        # join mode drains every window; non-join stops at the quota with samples still buffered
        assert value(m, "batchd_buffer_depth", **rk) == len(job.cores[r].state.buffer)
        assert value(m, "batchd_rank_epoch", **rk) == job.cores[r].epoch == 0
        assert (len(job.cores[r].state.buffer) == 0) == (quota is None)
        assert value(m, "batchd_output_wait_seconds_total", **rk) >= 0
        # Rates: every round lies in the 10 s window (the job is younger), so rate = total / service age.
        sps = value(m, "batchd_samples_per_second", **rk)
        if t_scrape1 - job.t_created < 10.0:  # (on a very busy machine the job may be older: bounds only)
            assert samples / (t_scrape1 - job.t_created) <= sps <= samples / (t_scrape0 - job.t_started)
        else:
            assert 0 < sps <= samples / (t_scrape0 - job.t_started)
        # the three rates share one time span: their ratios are exact
        assert value(m, "batchd_real_tokens_per_second", **rk) / sps == pytest.approx(
            tokens / samples, rel=1e-12
        )
        assert value(m, "batchd_padded_tokens_per_second", **rk) / sps == pytest.approx(
            padded / samples, rel=1e-12
        )
        assert not any(k[0] == "batchd_quarantined_total" for k in m), "nothing was quarantined"
        assert value(coord, "batchd_job_idle_steps_total", **rk) == idle
        assert value(coord, "batchd_job_rank_cost_total", **rk) == pytest.approx(
            sum(cost([lengths[i] for i in ids]) for ids, _, _ in real), rel=1e-12
        )

    if policy == "local" and quota is None:
        assert value(ranks[0], "batchd_idle_steps_total", rank="0") > 0, (
            "the skewed split must make IDLE steps"
        )
    assert value(coord, "batchd_job_steps_total") == n_steps
    received = [i for steps in got for ids, _, _ in steps for i in ids]
    assert len(received) == (len(lengths) if quota is None else quota)
    assert value(coord, "batchd_job_samples_total") == len(received)
    assert value(coord, "batchd_job_real_tokens_total") == sum(lengths[i] for i in received)
    step_costs = [[cost([lengths[i] for i in got[r][s][0]]) for r in range(2)] for s in range(n_steps)]
    assert value(coord, "batchd_job_step_cost_max_total") == pytest.approx(sum(max(c) for c in step_costs))
    assert value(coord, "batchd_job_step_cost_mean_total") == pytest.approx(
        sum(sum(c) / 2 for c in step_costs)
    )
    last_round = max(info.round for _, _, info in got[0])
    last = [c for c, (_, _, info) in zip(step_costs, got[0], strict=False) if info.round == last_round]
    expect = sum(max(c) for c in last) / sum(sum(c) / 2 for c in last)
    assert value(coord, "batchd_rank_imbalance") == pytest.approx(expect, rel=1e-12)
    assert 1.0 <= expect <= 2.0
    for h in (
        "batchd_align_latency_seconds",
        "batchd_align_barrier_wait_seconds",
        "batchd_align_round_seconds",
    ):
        assert value(coord, f"{h}_count") == rounds, h
    assert value(coord, "batchd_job_rounds_total") == rounds
    assert value(coord, "batchd_align_round_seconds_sum") >= value(coord, "batchd_align_latency_seconds_sum")
    assert value(coord, "batchd_job_state", batchd_job_state="done") == 1
    assert value(coord, "batchd_job_state", batchd_job_state="running") == 0
    assert value(coord, "batchd_job_state", batchd_job_state="failed") == 0
    assert value(coord, "batchd_ranks_registered") == 2
    assert value(coord, "batchd_job_epoch") == 0


def test_counters_span_every_epoch_and_gauges_name_the_epoch(jobs):
    lengths = skewed_lengths(120)
    spec = JobSpec(
        world_size=2,
        token_budget=1024,
        seed=2,
        epochs=3,
        policy=PolicySpec(name="balanced", window=24, depth=3),
    )
    job = jobs(spec, lengths)
    got = job.drain_epochs(3, 60, lambda b, info: (b["sample_ids"].tolist(), info))
    job.wait_state("done")
    coord = scrape(job.coordinator_metrics_port)
    ranks = [scrape(job.rank_metrics_port(r)) for r in range(2)]
    for r, m in enumerate(ranks):
        rk = {"rank": str(r)}
        assert value(m, "batchd_rank_epoch", **rk) == 2
        assert value(m, "batchd_samples_total", **rk) == sum(len(ids) for ep in got[r] for ids, _ in ep)
        assert value(m, "batchd_steps_total", **rk) == sum(len(ep) for ep in got[r])
    assert value(coord, "batchd_job_epoch") == 2
    assert value(coord, "batchd_job_samples_total") == 3 * len(lengths)
    assert value(coord, "batchd_job_steps_total") == sum(len(ep) for ep in got[0])
    assert value(coord, "batchd_job_state", batchd_job_state="done") == 1


def test_live_gauges_while_the_trainer_is_behind(jobs):
    lengths = skewed_lengths(400)
    spec = JobSpec(
        world_size=1,
        token_budget=1024,
        seed=1,
        shuffle=False,
        policy=PolicySpec(name="local", window=32, depth=3),
    )
    job = jobs(spec, lengths)
    deadline = time.monotonic() + 20
    while True:  # no trainer yet: the service fills its output slots and its window, then waits
        m = scrape(job.rank_metrics_port(0))
        if value(m, "batchd_ready_batches", rank="0") == spec.policy.depth and value(
            m, "batchd_steps_total", rank="0"
        ):
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    assert value(m, "batchd_steps_total", rank="0") == spec.policy.depth
    assert value(m, "batchd_buffer_depth", rank="0") == len(job.cores[0].state.buffer) > 0
    assert value(scrape(job.coordinator_metrics_port), "batchd_job_state", batchd_job_state="running") == 1
    got = _drain(job)[0]
    assert value(scrape(job.rank_metrics_port(0)), "batchd_steps_total", rank="0") == len(got)


def test_quarantined_records_by_reason():
    spec = JobSpec(
        world_size=1,
        token_budget=64,
        policy=PolicySpec(name="local", window=4, depth=8, over_budget="reject"),
    )
    with InProcessJob(spec, sources=[IngestSource(capacity=4)], connect_timeout_s=30, metrics=True) as job:
        rport, hport = job.ports[0], job.rank_metrics_port(0)
        stub = pb_grpc.RankServiceStub(grpc.insecure_channel(f"127.0.0.1:{rport}"))

        def req(i, n, loss=None):
            p = synthetic_payload(i, n, 0, 100)
            k = int((p["labels"][1:] != -100).sum()) if loss is None else loss
            return pb.IngestRequest(
                meta=pb.SampleMeta(id=i, length=n, loss_tokens=k), tensors=wire.tensors_to_pb(p)
            )

        wrong_length = req(2, 7)
        wrong_length.meta.length = 9
        msgs = [
            req(0, 10),
            req(1, 12, loss=0),
            wrong_length,
            req(3, 200),
            req(4, 9),
            req(5, 300),
            pb.IngestRequest(end_of_epoch=True),
        ]
        reply = stub.Ingest(iter(msgs), timeout=20)
        assert reply.accepted == 4 and len(reply.quarantined) == 2
        with BatchClient(f"127.0.0.1:{rport}", 0, 1) as c:
            got = sorted(i for b, _ in c for i in b["sample_ids"].tolist())
        assert got == [0, 4]  # 3 and 5 exceed the 64-token budget and are rejected
        m = scrape(hport)
        assert value(m, "batchd_quarantined_total", rank="0", reason="invalid_ingest") == len(
            reply.quarantined
        )
        assert value(m, "batchd_quarantined_total", rank="0", reason="over_budget") == 2
        assert value(m, "batchd_samples_total", rank="0") == 2
        assert value(m, "batchd_real_tokens_total", rank="0") == 10 + 9


def test_a_failing_metrics_update_never_fails_the_job(jobs, caplog):
    lengths = skewed_lengths(120)
    spec = JobSpec(
        world_size=2,
        token_budget=1024,
        seed=0,
        shuffle=False,
        policy=PolicySpec(name="local", window=16, depth=2),
    )
    wrong = CoordinatorMetrics(1, spec.cost_model())  # one per-rank series: rank 1's update raises IndexError
    job = jobs(spec, lengths, coordinator_metrics=wrong)
    got = _drain(job)
    assert sorted(i for steps in got for ids, _, _ in steps for i in ids) == list(range(len(lengths)))
    job.wait_state("done")
    assert any("metrics update failed" in r.message for r in caplog.records)


def test_rate_window_with_a_clock():
    now = [100.0]
    w = RateWindow(2, window_s=10.0, clock=lambda: now[0])
    assert w.rates() == (0.0, 0.0)
    now[0] = 102.0
    w.add(10, 1000)
    assert w.rates() == (5.0, 500.0)  # a 2 s old window: divided by its age, not by 10 s
    now[0] = 110.0
    w.add(30, 500)
    assert w.rates() == (4.0, 150.0)
    now[0] = 112.5  # the first event (t=102) has left the window (102.5, 112.5]
    assert w.rates() == (3.0, 50.0)
    now[0] = 121.0
    assert w.rates() == (0.0, 0.0)
    with pytest.raises(ValueError, match="window_s"):
        RateWindow(1, window_s=0)
    with pytest.raises(ValueError, match="values"):
        w.add(1)


def test_endpoint_starts_on_a_free_port_and_stops():
    a, b = RankMetrics(0), RankMetrics(0)  # two services in one process: separate registries, no clash
    srv, port = start_metrics_server(a.registry, "127.0.0.1", 0)
    assert port > 0
    assert ("batchd_samples_total", (("rank", "0"),)) in scrape(port)
    stop_metrics_server(srv)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    assert b.registry is not a.registry
    with pytest.raises(ValueError, match="port=70000"):
        start_metrics_server(b.registry, port=70000)
    with pytest.raises(ValueError, match="certfile"):
        start_metrics_server(b.registry, certfile="x.pem")
    with pytest.raises(ValueError, match="rank=-1"):
        RankMetrics(-1)
    with pytest.raises(ValueError, match="world_size=0"):
        CoordinatorMetrics(0)


def _wait_json(path: Path, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return json.loads(path.read_text())


@pytest.mark.slow
def test_run_coordinator_and_run_rank_serve_metrics(tmp_path):
    lengths = skewed_lengths(80)
    spec_kw = "world_size=1, token_budget=1024, policy='local', window=16, depth=2, seed=0"
    coord_code = (
        "from batchd.core import JobSpec; from batchd.service import Endpoint, run_coordinator; import sys; "
        f"sys.exit(run_coordinator(JobSpec.from_keys({spec_kw}), "
        f"Endpoint(port_file={str(tmp_path / 'c.json')!r}, metrics_port=0)))"
    )
    coord = subprocess.Popen([sys.executable, "-c", coord_code])
    procs = [coord]
    try:
        cinfo = _wait_json(tmp_path / "c.json")
        rank_code = (
            "from batchd.core import JobSpec; import sys; "
            "from batchd.service import Endpoint, ServiceConfig, SourceOptions, run_rank; "
            f"config = ServiceConfig(SourceOptions({lengths!r}), "
            f"Endpoint(port_file={str(tmp_path / 'r.json')!r}, metrics_port=0)); "
            f"sys.exit(run_rank(JobSpec.from_keys({spec_kw}), 0, '127.0.0.1:{cinfo['port']}', config))"
        )
        rank = subprocess.Popen([sys.executable, "-c", rank_code])
        procs.append(rank)
        rinfo = _wait_json(tmp_path / "r.json")
        assert rinfo["metrics_port"] > 0 and cinfo["metrics_port"] > 0
        deadline = time.monotonic() + 30
        while value(m := scrape(rinfo["metrics_port"]), "batchd_ready_batches", rank="0") < 2:  # slots full
            assert time.monotonic() < deadline, m
            time.sleep(0.05)
        assert (
            value(m, "batchd_steps_total", rank="0") == 2 and value(m, "batchd_samples_total", rank="0") > 0
        )
        with BatchClient(f"127.0.0.1:{rinfo['port']}", 0, 1) as c:
            got = [b["sample_ids"].tolist() for b, _ in c]
        deadline = time.monotonic() + 30  # done once the rank told it its trainer took the last step
        while value(m := scrape(cinfo["metrics_port"]), "batchd_job_state", batchd_job_state="done") != 1:
            assert time.monotonic() < deadline, m  # (the coordinator then lingers 2 s)
            time.sleep(0.05)
        assert value(m, "batchd_job_samples_total") == len(lengths)
        assert value(m, "batchd_job_steps_total") == len(got)
        assert value(m, "batchd_job_state", batchd_job_state="done") == 1
        assert coord.wait(30) == 0 and rank.wait(30) == 0
        for port in (
            cinfo["metrics_port"],
            rinfo["metrics_port"],
        ):  # both endpoints closed with their process
            with pytest.raises(urllib.error.URLError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
