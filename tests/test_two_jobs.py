"""Two jobs on one host, each started by the README's commands (issue 19): a `batchd demo` and the
real-job recipe ("A real job", run by bash as in tests/test_readme_job.py), with the same temp root.

The recipe's node agent must start its own Ray (not join the demo's), both jobs must finish with every
id once, and ending one must leave the other running: the demo ends (its Ray shut down) while the
recipe's agent is up with its actors started and its trainers not yet started (they wait for a file
the test writes once the demo has exited), and the recipe then still trains its epoch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from _procs import free_block, processes_with_marker
from _readme_job import RECORDS, end_job, job_env, readme_script, trained_ids

from batchd.service.preprocess import demo_bad_ids

pytestmark = pytest.mark.slow

DEMO_RECORDS = 48


def wait_until(what, cond, timeout, log=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout:g}s\n{log()}")


def demo_gcs(marker: str) -> str | None:
    """The GCS address of the demo's Ray once its raylet runs (a process of the demo naming it)."""
    for entry in processes_with_marker(marker):
        try:
            argv = Path(f"/proc/{entry.split(':', 1)[0]}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if os.path.basename(argv[0]) == "raylet":
            return next((a.split("=", 1)[1] for a in argv if a.startswith("--gcs-address=")), None)
    return None


def test_a_demo_and_the_readme_job_on_one_host_each_on_its_own_ray(tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="bd2-", dir="/tmp")  # ONE temp root for both jobs, as a user's /tmp
    demo_marker, job_marker = (f"BATCHD_TEST_TWO_{k}={uuid.uuid4().hex}" for k in ("DEMO", "JOB"))
    (tmp_path / "demo").mkdir()
    (tmp_path / "job").mkdir()
    demo_out, demo_err = (open(tmp_path / "demo" / n, "w") for n in ("out.json", "err.log"))
    job_err = tmp_path / "job.err"
    cport, rport = free_block(1), free_block(2)
    # The demo's trainers take 15 s a step (a real model's pace; its 48 records make about 4 steps), so
    # the demo is still training once the recipe's agent is up.
    demo = subprocess.Popen([sys.executable, "-m", "batchd", "demo", "--json", "--num-samples", str(DEMO_RECORDS),
                             "--no-baseline", "--step-time", "15"], cwd=tmp_path / "demo",
                            env=job_env(ray_tmp, demo_marker), stdout=demo_out, stderr=demo_err)
    job = None
    try:
        wait_until("the demo's Ray running", lambda: demo_gcs(demo_marker) or demo.poll() is not None, 120)
        gcs_demo = demo_gcs(demo_marker)
        assert gcs_demo, (tmp_path / "demo" / "err.log").read_text()
        script = readme_script(cport, rport, train_args="--ids-log ids-{rank}.jsonl",
                               before_train=("while [ ! -e go ]; do sleep 0.2; done",))  # the test's gate
        with open(job_err, "w") as err:
            job = subprocess.Popen(["bash", "-c", "\n".join(script)], cwd=tmp_path / "job",
                                   env=job_env(ray_tmp, job_marker), stdout=subprocess.DEVNULL, stderr=err)
        log = lambda: job_err.read_text()[-6000:]  # noqa: E731
        wait_until("the recipe's node agent serving its ranks",
                   lambda: "serving ranks [0, 1]" in job_err.read_text() or job.poll() is not None, 180, log)
        assert job.poll() is None, log()
        started = re.findall(r"rank 0: started an embedded Ray for this job \(gcs (\S+)\)", log())
        assert len(started) == 1 and started[0] != gcs_demo and "joined" not in log(), (gcs_demo, log())
        assert demo.poll() is None, "the demo ended before the recipe's agent was up: " + log()

        demo.wait(240)  # the demo ends (its Ray shut down) while the recipe's agent waits for its trainers
        assert demo.returncode == 0, (tmp_path / "demo" / "err.log").read_text()[-4000:]
        s = json.loads((tmp_path / "demo" / "out.json").read_text().strip().splitlines()[-1])
        assert s["missing"] == 0 and s["duplicates"] == 0 and s["emitted"] > 0, s
        assert s["preprocess"]["accounting_ok"] is True, s["preprocess"]

        (tmp_path / "job" / "go").touch()
        job.wait(300)
        assert job.returncode == 0, log()
        ids = trained_ids(tmp_path / "job")
        expected = set(range(RECORDS)) - set(demo_bad_ids(RECORDS, 0))
        assert len(ids) == len(set(ids)) and set(ids) == expected, (sorted(ids), sorted(expected))
        assert "went away" not in log() and "Traceback" not in log(), log()
    finally:
        for p in (demo, job):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        demo_out.close()
        demo_err.close()
        left = end_job(demo_marker) + end_job(job_marker)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, "processes outlived the jobs:\n" + "\n".join(left)
