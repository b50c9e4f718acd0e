"""Which Ray a rank service / node agent runs on (`share_ray`): its own job's, never another job's.

Issue 19: a node agent started beside a `batchd demo` joined the demo's private Ray and died with it.
Without an address a service joins only the Ray its own job (`job_key`: coordinator address and spec)
started on this host, else starts its own; a host's running Ray is joined only when asked (`auto`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest
from _readme_job import end_job

from batchd.core import JobSpec, PolicySpec
from batchd.preprocess import RayLost, SharedRay, job_key
from batchd.testing import ray_lost

PROBE = Path(__file__).with_name("_share_ray_probe.py")


def test_job_key_names_one_job():
    spec = JobSpec(world_size=2, token_budget=1024, policy=PolicySpec(name="local", window=512, depth=8))
    assert job_key("127.0.0.1:7000", spec) == job_key(
        "127.0.0.1:7000",
        JobSpec(world_size=2, token_budget=1024, policy=PolicySpec(name="local", window=512, depth=8)),
    )
    assert job_key("127.0.0.1:7000", spec) != job_key("127.0.0.1:7001", spec)  # another coordinator
    assert job_key("127.0.0.1:7000", spec) != job_key("127.0.0.1:7000", spec.replace(seed=spec.seed + 1))


def test_a_ray_is_judged_gone_by_its_gcs_and_raylet_refusing_connections():
    gcs, raylet = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    g, r = (f"127.0.0.1:{s.getsockname()[1]}" for s in (gcs, raylet))
    try:
        assert ray_lost(g, r) is None
        raylet.close()
        lost = ray_lost(g, r)
        assert (
            isinstance(lost, RayLost)
            and str(lost) == f"its Ray at {g} went away (the raylet of this node at {r} is unreachable)"
        ), lost
        shared = SharedRay(g, started=False)  # not connected to Ray: watches the GCS only
        seen: list[RayLost] = []
        told = threading.Event()
        shared.watch(lambda lost: (seen.append(lost), told.set()), every_s=0.1)
        try:
            assert shared.check() is None  # its GCS is there: nothing to say
            gcs.close()
            assert told.wait(30), "the watch did not notice the GCS going away"
            assert (
                str(seen[0]) == f"its Ray at {g} went away (its GCS at {g} is unreachable)" and len(seen) == 1
            )
        finally:
            shared.close()
    finally:
        gcs.close()
        raylet.close()


@pytest.mark.slow
def test_same_job_shares_other_job_ray_ignored_auto_joins(tmp_path):
    # One temp root for all of them, as on a user's host (/tmp): only the job key tells the Rays apart.
    ray_tmp = tempfile.mkdtemp(prefix="bds-", dir="/tmp")
    marker = f"BATCHD_TEST_SHARE={uuid.uuid4().hex}"
    env = {
        **os.environ,
        "TMPDIR": ray_tmp,
        marker.split("=")[0]: marker.split("=")[1],
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("RAY_ADDRESS", None)
    holders: list[subprocess.Popen] = []

    def probe(address: str, job: str, hold: bool = False) -> dict:
        p = subprocess.Popen(
            [sys.executable, str(PROBE), address, job],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        holders.append(p)
        line = p.stdout.readline()  # the probe's one line once connected (or EOF when it failed)
        if not hold:
            out, err = p.communicate("", timeout=120)
            assert p.returncode == 0, err
        assert line, p.stderr.read() if hold else err
        return json.loads(line)

    try:
        a = probe("-", "job-a", hold=True)  # job A's first service: starts its Ray
        assert a["started"]
        b = probe("-", "job-b")  # another job on the same host: its own Ray, not A's
        assert b["started"] and b["gcs"] != a["gcs"], (a, b)
        a2 = probe("-", "job-a")  # A's second service: joins A's
        assert not a2["started"] and a2["gcs"] == a["gcs"], (a, a2)
        auto = probe("auto", "job-c")  # asked explicitly: the Ray running on this host (A's, the only one)
        assert not auto["started"] and auto["gcs"] == a["gcs"], (a, auto)
    finally:
        for p in holders:
            if p.poll() is None:
                try:
                    p.communicate("", timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        left = end_job(marker)  # the Ray A started stops once its last user (A's first) has exited
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, left


def test_a_ray_start_that_times_out_is_tried_again_and_other_errors_raise(monkeypatch):
    """Ray's start timeouts (GCS port file, raylet registration) judge speed; on a busy host
    `start_local_ray` starts Ray again, up to START_ATTEMPTS times, instead of failing the job. Ray's
    start is faked: the test is of the retry, not of Ray."""
    import ray

    from batchd.service.preprocess import start_local_ray
    from batchd.testing import START_ATTEMPTS

    calls = []
    errors = [
        "Timed out waiting for file /tmp/ray/session_x/gcs_server_port_abc",
        "The current node timed out during startup. This could happen because ...",
    ]

    def fake_init(**kwargs):
        calls.append(kwargs)
        if len(calls) <= len(errors):
            raise RuntimeError(errors[len(calls) - 1])

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)  # never the session's Ray
    start_local_ray(num_cpus=1)
    assert calls == [{"num_cpus": 1}] * 3

    def always_slow(**kwargs):
        calls.append(kwargs)
        raise RuntimeError(errors[0])

    calls.clear()
    monkeypatch.setattr(ray, "init", always_slow)
    with pytest.raises(RuntimeError, match="Timed out waiting for file"):
        start_local_ray(num_cpus=1)
    assert len(calls) == START_ATTEMPTS

    def broken_init(**kwargs):
        raise RuntimeError("some other start failure")

    monkeypatch.setattr(ray, "init", broken_init)
    with pytest.raises(RuntimeError, match="some other start failure"):
        start_local_ray(num_cpus=1)
