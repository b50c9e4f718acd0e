"""The daemon's lifecycle as a user meets it, with real processes: signals, kill -9, one Ray per host.

1. SIGINT / SIGTERM of `batchd demo` once its services run: exit 130 in one line, no traceback, no
   process or temp dir left behind.
2. kill -9 of `batchd demo` (Ray path) once its services run: its children, the Ray it started (raylet,
   GCS, workers, agents) and its temp dir are all gone within seconds (the reaper, PR_SET_PDEATHSIG).
3. Two `batchd rank --dataset` services started together on one host without `--ray-address` run on
   one Ray: one starts it, the other joins it, both report the same GCS address, and the Ray is gone
   once both have exited.

Processes are found by an environment marker every descendant inherits (`/proc/PID/environ`). Every
wait is a deadline on an event (a line on stderr, a file, an exit) and fails naming what did not happen.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from _procs import descendants, processes_with_marker, start_times, still_alive

from batchd.core import JobSpec, PolicySpec
from batchd.launch import Processes, spec_argv, start_services

pytestmark = pytest.mark.slow

STARTED = "training one epoch"  # the demo's progress line once its coordinator and rank services listen


def wait_until(what: str, done, timeout: float, detail=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout:g}s\n{detail()}")
        time.sleep(0.1)


class Demo:
    """`batchd demo` as a subprocess whose stderr lines are collected by a thread."""

    def __init__(self, *args: str) -> None:
        self.marker = f"BATCHD_TEST_LIFECYCLE={uuid.uuid4().hex}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", self.marker.split("=")[0]: self.marker.split("=")[1]}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "batchd", "demo", *args],
            env=env,
            text=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, text: str, timeout: float) -> str:
        wait_until(
            f"the demo printing {text!r}",
            lambda: any(text in ln for ln in self.lines) or self.proc.poll() is not None,
            timeout,
            lambda: self.stderr[-3000:],
        )
        assert self.proc.poll() is None, (
            f"the demo exited ({self.proc.returncode}) before {text!r}:\n{self.stderr}"
        )
        return next(ln for ln in self.lines if text in ln)

    def work_dir(self) -> Path:
        line = self.wait_line("logs and temporary files in", 60)
        return Path(re.search(r"files in (\S+)", line).group(1))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def assert_nothing_left(marker: str, work: Path, timeout: float, tree: dict[int, str] | None = None) -> None:
    """No process with `marker`, none of the `descendants` snapshot `tree`, and no `work` left."""

    def left() -> list[str]:
        return sorted(set(processes_with_marker(marker)) | set(still_alive(tree or {})))

    wait_until("every process of the demo exiting", lambda: not left(), timeout, lambda: "\n".join(left()))
    wait_until(f"the demo's temp dir {work} being removed", lambda: not work.exists(), timeout)


@pytest.mark.parametrize(
    "sig, ray", [(signal.SIGINT, False), (signal.SIGTERM, True)], ids=["sigint-synthetic", "sigterm-ray"]
)
def test_an_interrupted_demo_exits_130_in_one_line_and_leaves_nothing(sig, ray):
    args = ["--num-samples", "64", "--no-baseline"] + ([] if ray else ["--synthetic"])
    demo = Demo(*args)
    try:
        work = demo.work_dir()
        demo.wait_line(STARTED, 240 if ray else 120)
        tree = descendants(demo.proc.pid)
        demo.proc.send_signal(sig)
        try:
            code = demo.proc.wait(10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the demo did not exit within 10s of {sig.name}:\n{demo.stderr[-3000:]}")
        demo.reader.join(10)
        assert code == 130, demo.stderr[-3000:]
        assert "Traceback" not in demo.stderr, demo.stderr
        assert demo.lines[-1] == f"batchd demo: interrupted by {sig.name}", demo.stderr
        assert_nothing_left(demo.marker, work, 10, tree)
    finally:
        demo.kill()


def test_a_killed_demo_leaves_no_process_or_temp_dir():
    demo = Demo("--num-samples", "64", "--no-baseline")
    try:
        work = demo.work_dir()
        demo.wait_line(STARTED, 240)
        tree = descendants(demo.proc.pid)
        ray_procs = [p for p in still_alive(tree) if "raylet" in p or "ray::" in p or "gcs_server" in p]
        assert ray_procs, "the demo should have started Ray:\n" + "\n".join(still_alive(tree))
        demo.proc.kill()
        demo.proc.wait()
        assert_nothing_left(demo.marker, work, 10, tree)
    finally:
        demo.kill()


# A demo stand-in for the reaper test: it starts the reaper, then a marked child A that starts B without
# the marker (as a process that sets its title hides it), and a marked child that starts C without it
# and exits 3 s later (as a raylet that ran a while dies before its agents, which are reparented). It
# prints the pids and waits to be killed.
_TREE = r"""
import os, subprocess, sys, time
from pathlib import Path
from batchd.launch import MARKER_ENV, Reaper
work, marker = Path(sys.argv[1]), sys.argv[2]
reaper = Reaper(work, marker)
bare = {k: v for k, v in os.environ.items() if k != MARKER_ENV}
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
a = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                      "b = subprocess.Popen(sys.argv[1:], env={}); "
                      "print(b.pid, flush=True); time.sleep(600)", *sleeper],
                     env={**bare, MARKER_ENV: marker}, stdout=subprocess.PIPE, text=True)
b = int(a.stdout.readline())
c_parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                             "print(subprocess.Popen(sys.argv[1:], env={}).pid, flush=True); "
                             "time.sleep(3)", *sleeper],
                            env={**bare, MARKER_ENV: marker}, stdout=subprocess.PIPE, text=True)
c = int(c_parent.stdout.readline())
c_parent.wait()  # C is reparented now, and carries no marker
print(a.pid, b, c, reaper.proc.pid, flush=True)
time.sleep(600)
"""


def test_the_reaper_ends_descendants_and_orphans_that_hide_the_marker(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    marker = uuid.uuid4().hex
    parent = subprocess.Popen(
        [sys.executable, "-c", _TREE, str(work), marker], stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 4, pids
        tree = {**descendants(parent.pid), **start_times(pids)}
        assert len(tree) == 4, tree
        assert set(pids[2:3]).isdisjoint(descendants(parent.pid)), "C should have been reparented"
        parent.kill()
        parent.wait()
        wait_until(
            "the reaper ending A, B (no marker) and C (no marker, reparented), and removing the work dir",
            lambda: not still_alive(tree) and not work.exists(),
            15,
            lambda: "\n".join(still_alive(tree)),
        )
    finally:
        parent.kill()
        for pid, start in locals().get("tree", {}).items():
            if start_times([pid]).get(pid) != start:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_rank_services_on_one_host_share_one_ray(tmp_path):
    from batchd.client import BatchClient, ClientOptions
    from batchd.preprocess import make_demo_dataset

    world = 2
    data = make_demo_dataset(tmp_path / "data", num_samples=24, seed=1, max_image_side=64)
    # A fresh TMPDIR isolates this test's Ray from any other on the host (Ray's temp root and batchd's
    # lock files live under it); short, for Ray's socket paths.
    ray_tmp = tempfile.mkdtemp(prefix="bdr-", dir="/tmp")
    marker = f"BATCHD_TEST_SHARED_RAY={uuid.uuid4().hex}"
    procs = Processes(tmp_path, {"TMPDIR": ray_tmp, marker.split("=")[0]: marker.split("=")[1]})
    spec = spec_argv(
        JobSpec(world_size=world, token_budget=1024, policy=PolicySpec(name="balanced", window=32, depth=2))
    )
    try:
        _, ports = start_services(
            procs,
            tmp_path,
            spec,
            world,
            None,
            rank_args=lambda r: [
                "--dataset",
                str(data.path),
                "--num-actors",
                "1",
                "--stats-file",
                str(tmp_path / f"stats-{r}.json"),
                "--max-bad-fraction",
                "1",
            ],
        )  # the sample data's 7 bad records are 30% of 24: not what is tested here
        tree = {**descendants(procs.get("rank-0").pid), **descendants(procs.get("rank-1").pid)}
        errors: list[BaseException] = []

        def drain(r: int) -> None:
            try:
                with BatchClient(
                    f"127.0.0.1:{ports[r]}", r, world, options=ClientOptions(reconnect_timeout_s=60)
                ) as client:
                    for _batch in client:
                        pass
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=drain, args=(r,), daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for r in range(world):
            wait_until(
                f"rank service {r} exiting after the epoch",
                lambda r=r: procs.get(f"rank-{r}").poll() is not None,
                120,
                lambda: procs.log("rank-0") + procs.log("rank-1"),
            )
        assert not errors, errors
        assert [procs.get(f"rank-{r}").returncode for r in range(world)] == [0, 0], procs.log("rank-0")
        logs = [procs.log(f"rank-{r}") for r in range(world)]
        started = [re.search(r"started an embedded Ray for this job \(gcs (\S+)\)", log) for log in logs]
        joined = [re.search(r"joined this job's Ray on this host \(gcs (\S+)\)", log) for log in logs]
        assert sum(m is not None for m in started) == 1 and sum(m is not None for m in joined) == 1, logs
        addresses = {m.group(1) for m in started + joined if m is not None}
        stats = [json.loads((tmp_path / f"stats-{r}.json").read_text()) for r in range(world)]
        assert {s["ray_address"] for s in stats} == addresses and len(addresses) == 1, (stats, addresses)

        def left() -> list[str]:
            return processes_with_marker(marker) + still_alive(tree)

        wait_until(
            "the shared Ray stopping after the last rank service",
            lambda: not left(),
            15,
            lambda: "\n".join(left()),
        )
    finally:
        procs.stop()
        import shutil

        shutil.rmtree(ray_tmp, ignore_errors=True)
