"""Two jobs on one host, each started by the README's commands (issue 19): a `batchd demo` and the
real-job recipe ("A real job", run by bash as in tests/test_readme_job.py), with the same temp root.

The recipe's node agent must start its own Ray (not join the demo's), both jobs must finish with every
id once, and ending either one must leave the other running. Two recipes run beside one demo, in two
directories:

- the first trains its epoch and ends (its agent stops its own Ray) while the demo is still training:
  the demo then still finishes;
- the second's agent is up with its actors started and its trainers held back (they wait for a file the
  test writes once the demo has exited) when the demo ends and shuts its Ray down: the recipe then still
  trains its epoch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from _procs import free_block, processes_with_marker, wait_until
from _readme_job import RECORDS, end_job, job_env, readme_script, trained_ids

from batchd.testing import demo_bad_ids

pytestmark = [pytest.mark.slow, pytest.mark.beside]  # CI: the second lane (.ci/run)

DEMO_RECORDS = 48


def demo_gcs(marker: str) -> str | None:
    """The GCS address of the demo's Ray once its raylet runs (a process of the demo naming it)."""
    for entry in processes_with_marker(marker):
        try:
            argv = (
                Path(f"/proc/{entry.split(':', 1)[0]}/cmdline")
                .read_bytes()
                .decode(errors="replace")
                .split("\0")
            )
        except OSError:
            continue
        if os.path.basename(argv[0]) == "raylet":
            return next((a.split("=", 1)[1] for a in argv if a.startswith("--gcs-address=")), None)
    return None


def _start_recipe(work: Path, ray_tmp: str, marker: str, gate: bool) -> tuple[subprocess.Popen, Path]:
    """The README recipe in `work` (its trainers log their ids; with `gate`, held until `work/go` exists)."""
    cport, rport = free_block(1), free_block(2)
    script = readme_script(
        cport,
        rport,
        train_args="--ids-log ids-{rank}.jsonl",
        before_train=("while [ ! -e go ]; do sleep 0.2; done",) if gate else (),
    )
    err = work.with_suffix(".err")
    with open(err, "w") as f:
        proc = subprocess.Popen(
            ["bash", "-c", "\n".join(script)],
            cwd=work,
            env=job_env(ray_tmp, marker),
            stdout=subprocess.DEVNULL,
            stderr=f,
        )
    return proc, err


def _check_recipe(proc: subprocess.Popen, work: Path, err: Path, timeout: float) -> None:
    """The recipe ended 0, its trainers took every good id exactly once, nothing of it failed."""
    proc.wait(timeout)
    full = err.read_text()
    log = full[-6000:]
    assert proc.returncode == 0, log
    ids = trained_ids(work)
    expected = set(range(RECORDS)) - set(demo_bad_ids(RECORDS, 0))
    assert len(ids) == len(set(ids)) and set(ids) == expected, (sorted(ids), sorted(expected))
    assert "went away" not in full and "Traceback" not in full, log


def test_a_demo_and_the_readme_job_on_one_host_each_on_its_own_ray(tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="bd2-", dir="/tmp")  # ONE temp root for all jobs, as a user's /tmp
    markers = {k: f"BATCHD_TEST_TWO_{k}={uuid.uuid4().hex}" for k in ("DEMO", "FIRST", "SECOND")}
    for d in ("demo", "first", "second"):
        (tmp_path / d).mkdir()
    demo_out, demo_err = (open(tmp_path / "demo" / n, "w") for n in ("out.json", "err.log"))
    # The demo's trainers take 15 s a step (a real model's pace; its 48 records make about 4 steps), so
    # the demo is still training once the first recipe has ended and the second one's agent is up.
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchd",
            "demo",
            "--json",
            "--num-samples",
            str(DEMO_RECORDS),
            "--no-baseline",
            "--step-time",
            "15",
        ],
        cwd=tmp_path / "demo",
        env=job_env(ray_tmp, markers["DEMO"]),
        stdout=demo_out,
        stderr=demo_err,
    )
    first = second = None
    try:
        wait_until(
            "the demo's Ray running", lambda: demo_gcs(markers["DEMO"]) or demo.poll() is not None, 120
        )
        gcs_demo = demo_gcs(markers["DEMO"])
        assert gcs_demo, (tmp_path / "demo" / "err.log").read_text()
        first, first_err = _start_recipe(tmp_path / "first", ray_tmp, markers["FIRST"], gate=False)
        second, second_err = _start_recipe(tmp_path / "second", ray_tmp, markers["SECOND"], gate=True)
        for proc, err in ((first, first_err), (second, second_err)):
            log = lambda err=err: err.read_text()[-6000:]  # noqa: E731
            wait_until(
                "the recipe's node agent serving its ranks",
                lambda proc=proc, err=err: (
                    "serving ranks [0, 1]" in err.read_text() or proc.poll() is not None
                ),
                600,  # the agent's own start-up bound (its actors may take up to 600 s on a loaded host)
                log,
            )
            full = err.read_text()  # whole: under load the waiting lines push this one past log()'s tail
            started = re.findall(r"rank 0: started an embedded Ray for this job \(gcs (\S+)\)", full)
            assert len(started) == 1 and started[0] != gcs_demo and "joined" not in full, (gcs_demo, log())

        _check_recipe(first, tmp_path / "first", first_err, 300)  # one job ends (its Ray stopped) ...
        assert demo.poll() is None, "the demo ended before the first recipe: the test proves nothing"
        assert second.poll() is None, second_err.read_text()[-4000:]

        demo.wait(300)  # ... the demo goes on and ends (its Ray shut down) while the second agent waits
        assert demo.returncode == 0, (tmp_path / "demo" / "err.log").read_text()[-4000:]
        s = json.loads((tmp_path / "demo" / "out.json").read_text().strip().splitlines()[-1])
        assert s["missing"] == 0 and s["duplicates"] == 0 and s["emitted"] > 0, s
        assert s["preprocess"]["accounting_ok"] is True, s["preprocess"]
        assert "went away" not in (tmp_path / "demo" / "err.log").read_text()

        (tmp_path / "second" / "go").touch()
        _check_recipe(second, tmp_path / "second", second_err, 300)
    finally:
        for p in (demo, first, second):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        demo_out.close()
        demo_err.close()
        left = [x for m in markers.values() for x in end_job(m)]
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, "processes outlived the jobs:\n" + "\n".join(left)
