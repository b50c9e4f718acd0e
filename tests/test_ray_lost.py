"""A node agent whose Ray goes away under it (issue 19): the job fails at once, naming the Ray.

Real parts: `batchd coordinator` (a short lease), `batchd node` with a dataset (its own embedded Ray,
one actor per rank) and two real gloo trainers (`batchd._train.demo`) that are taking batches. The test
kills the agent's Ray (kill -9 of its GCS and raylet, found by the GCS address the agent logged), then
checks that the coordinator, the agent and both trainers end well within the start-up timeout, each
with a message naming that Ray, without a traceback, and that nothing of the job is left.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path

import grpc
import pytest
from _procs import processes_with_marker, wait_until

from batchd.core import JobSpec, PolicySpec
from batchd.demo import IMAGE_TOKEN
from batchd.launch import Processes, spec_argv, start_node_agents, start_trainers
from batchd.preprocess import make_demo_dataset
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc
from batchd.service.preprocess import TokenizerRef, demo_tokenizer
from batchd.testing import demo_vocab_size as _vocab_size

pytestmark = pytest.mark.slow

LEASE_S = 6.0
STARTUP_S = 600.0  # the default: what every party waited out before the fix


def ray_processes_of(gcs: str) -> list[int]:
    """pids of the raylet of the Ray whose GCS is at `gcs` (host:port) and of the GCS server of its
    session."""
    cmds = {}
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            cmds[int(proc.name)] = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
    exe = lambda argv: os.path.basename(argv[0])  # noqa: E731
    raylets = [pid for pid, argv in cmds.items() if exe(argv) == "raylet" and f"--gcs-address={gcs}" in argv]
    sessions = {m for pid in raylets for m in re.findall(r"/session_[^/\s]+", " ".join(cmds[pid]))}
    servers = [
        pid
        for pid, argv in cmds.items()
        if exe(argv) == "gcs_server" and any(s + "/" in " ".join(argv) for s in sessions)
    ]
    return raylets + servers


def next_step(port: int, rank: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            return (
                pb_grpc.RankServiceStub(ch).RankStatus(pb.RankStatusRequest(rank=rank), timeout=5).next_step
            )
        except grpc.RpcError:
            return 0


def test_ray_killed_under_a_running_node_agent_fails_the_job_naming_it(tmp_path):
    data = make_demo_dataset(tmp_path / "data", num_samples=200, seed=0, max_image_side=64)
    tok = demo_tokenizer()
    model_cfg = {
        "vocab_size": _vocab_size(tok),
        "image_token_id": TokenizerRef(tok).token_id(IMAGE_TOKEN),
        "d_model": 32,
        "n_layers": 1,
        "n_heads": 2,
    }
    ray_tmp = tempfile.mkdtemp(prefix="bdk-", dir="/tmp")  # short socket paths; isolation is not its job
    marker = f"BATCHD_TEST_RAY_LOST={uuid.uuid4().hex}"
    procs = Processes(tmp_path, {"TMPDIR": ray_tmp, marker.split("=")[0]: marker.split("=")[1]})
    spec = spec_argv(
        JobSpec(world_size=2, token_budget=1024, policy=PolicySpec(name="balanced", window=32, depth=2))
    )
    names = ["coordinator", "node-0", "batchd-0", "batchd-1"]
    logs = lambda: "\n".join(f"--- {n}\n{procs.log(n)}" for n in names)  # noqa: E731
    try:
        _, ports = start_node_agents(
            procs,
            tmp_path,
            spec,
            2,
            2,
            None,
            coordinator_args=["--lease", str(LEASE_S)],
            node_args=["--dataset", str(data.path), "--tokenizer", str(tok), "--num-actors", "1"],
        )
        start_trainers(
            procs,
            tmp_path,
            "batchd",
            2,
            {"mode": "batchd", "seed": 0, "model_cfg": model_cfg, "step_time": 0.5},
            [{"service": f"127.0.0.1:{ports[r]}"} for r in range(2)],
        )
        wait_until(
            "both trainers taking batches",
            lambda: all(next_step(ports[r], r) > 0 for r in range(2)),
            180,
            logs,
        )
        gcs = re.search(r"started an embedded Ray[^(]*\(gcs (\S+)\)", procs.log("node-0")).group(1)
        victims = ray_processes_of(gcs)
        assert len(victims) == 2, (gcs, victims)
        t0 = time.monotonic()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        # Every party ends well within the start-up timeout: the agent fails the job itself at once, the
        # coordinator and the trainers learn within a lease (plus the agent's linger to tell them).
        limit = 60.0
        wait_until(
            "every party ending", lambda: all(procs.get(n).poll() is not None for n in names), limit, logs
        )
        took = time.monotonic() - t0
        assert took < STARTUP_S / 5, took
        assert {n: procs.get(n).returncode for n in names} == {n: 1 for n in names}, logs()
        named = f"rank 0: its Ray at {gcs} went away"
        for n in names:  # whole logs: Ray's raylet dump may follow the line, past Processes.log's tail
            full = (tmp_path / f"{n}.log").read_text()
            assert named in full, (n, logs())
            assert "Traceback" not in full, (n, logs())
        assert "did not register" not in logs()
        # nothing of the job is left: the agent's Ray workers and agents end with their raylet
        wait_until(
            "the job's processes ending",
            lambda: not processes_with_marker(marker),
            30,
            lambda: "\n".join(processes_with_marker(marker)),
        )
    finally:
        procs.stop()
        for entry in processes_with_marker(marker):  # this test's own processes, by pid
            with contextlib.suppress(OSError):
                os.kill(int(entry.split(":", 1)[0]), signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
