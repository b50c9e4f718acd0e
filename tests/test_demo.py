"""`batchd demo --json` through the Ray preprocessing pipeline, as a user runs it (a subprocess).

The demo generates its dataset (conversations, images, audio clips in a tenth of the records and a few
deliberately bad records), starts one local Ray, the coordinator, a node agent whose two ranks each
preprocess their view with a Ray actor, two gloo trainers, then the fixed-batching baseline on the same
preprocessed samples. Checked: equal steps per rank, every good record trained on exactly once, `emitted +
quarantined == records read`, exactly the generated bad records quarantined (no record with clips among
them), the `preprocess` keys, every generated clip preprocessed and encoded exactly once by each system's
audio encoders (batchd's two-phase, the baseline's one-phase), and that no process of the demo (its
children, Ray's raylet, GCS and workers) outlives it: they are found by an environment marker they all
inherit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid

import pytest
from _procs import processes_with_marker

from batchd.demo import DEMO_AUDIO_FRACTION
from batchd.service.preprocess import demo_records
from batchd.testing import demo_bad_ids

pytestmark = pytest.mark.slow

NUM = 64  # small enough that one view holds over 10% bad records: the baseline must judge as the agent


def test_demo_runs_through_the_ray_pipeline():
    marker = f"BATCHD_TEST_DEMO={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "batchd", "demo", "--json", "--num-samples", str(NUM)],
        capture_output=True,
        text=True,
        # a liveness bound, not a speed one: ~1.5 min alone, over 4 min beside CI's other test process and
        # two CPU burners on 2 cores (Ray's actors, 2 services and 4 trainers share them)
        timeout=600,
        env=env,
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])

    steps = s["steps_per_rank"]
    assert len(steps) == 2 and steps[0] == steps[1] > 0, steps
    assert s["missing"] == 0 and s["duplicates"] == 0, s

    pre = s["preprocess"]
    assert {"actors", "samples", "quarantined", "samples_per_s", "stall_fraction"} <= set(pre), pre
    bad = demo_bad_ids(NUM, 0)
    assert pre["quarantined"] == len(bad) > 0, pre
    assert pre["samples"] + pre["quarantined"] == pre["records_read"] == pre["records"] == NUM, pre
    assert s["emitted"] == pre["samples"] == NUM - len(bad), (s["emitted"], pre)
    assert pre["accounting_ok"] is True and pre["actors"] == 2, pre
    assert 0.0 <= pre["stall_fraction"] < 1.0 and pre["samples_per_s"] > 0, pre

    b = s["baseline"]
    assert b["steps"] > 0 and b["batch_size"] == 2 and s["speedup"] > 0, b  # B=2, as batchd bench
    # Image data, policy balanced: two-phase by default; the trainers' TinyMLLM encoded images, exchanged.
    assert s["phases"] == 2 and s["vision_imbalance"] is not None and s["vision_imbalance"] >= 1.0, s
    assert b["vision_imbalance"] is not None, b
    # Audio: a tenth of the generated good records carry 1-2 clips (none of them is quarantined); the chain
    # turned each into audio tokens and features, and each system's audio encoders encoded every clip once
    # (batchd: two-phase, the coordinator's audio plan; the baseline: its own clips, one phase).
    records, _ = demo_records(NUM, 0, audio_fraction=DEMO_AUDIO_FRACTION)
    clips = sum(len(r["audios"]) for r in records if r is not None)
    assert clips > 0 and pre["expected_clips"] == clips, (clips, pre)
    assert "unsupported_audio" not in pre["reasons"] and "bad_audio" not in pre["reasons"], pre
    assert s["clips"] == b["clips"] == clips, (s["clips"], b["clips"], clips)
    assert s["audio_imbalance"] >= 1.0 and b["audio_imbalance"] >= 1.0, (s, b)

    deadline = time.monotonic() + 15  # Ray's processes are killed by ray.shutdown(); allow them to exit
    left = processes_with_marker(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = processes_with_marker(marker)
    assert not left, "processes outlived the demo:\n" + "\n".join(left)
    print(f"demo: {elapsed:.1f}s, stall {pre['stall_fraction']:.3f}, {pre['samples_per_s']:.0f} samples/s")


def test_demo_with_trainers_that_take_5s_per_step():
    """Real models take seconds per step: the demo's job still ends cleanly (the coordinator stays until
    every trainer took its last step; nothing judges a trainer's speed). Off a terminal the demo logs the
    batchd run's progress, samples of every rank out of the total, every $BATCHD_PROGRESS_S seconds."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchd",
            "demo",
            "--synthetic",
            "--num-samples",
            "40",
            "--no-baseline",
            "--depth",
            "2",
            "--step-time",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "BATCHD_PROGRESS_S": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = json.loads(re.search(r"^steps per rank +(\[[\d, ]+\])", proc.stdout, re.M).group(1))
    assert steps[0] == steps[1] >= 3, proc.stdout
    assert re.search(r"^samples +40 emitted, 0 missing, 0 duplicated", proc.stdout, re.M), proc.stdout
    wall = float(re.search(r"^epoch wall time +([\d.]+)s", proc.stdout, re.M).group(1))
    assert wall >= 5 * steps[0], proc.stdout
    # >= 3 steps of >= 5 s and a line every 1 s: some line falls between two steps, before the end
    progress = re.findall(
        r"\[batchd demo\] batchd run: (\d+)/40 samples \(\d+%\), \d+ steps, "
        r"(?:[\d.]+ samples/s, )?ETA \S+",
        proc.stderr,
    )
    assert any(0 < int(n) < 40 for n in progress), proc.stderr[-4000:]
    assert re.search(
        r"\[batchd demo\] batchd run: 40/40 samples \(100%\), \d+ steps, done in", proc.stderr
    ), proc.stderr[-4000:]


def _demo_json(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "batchd", "demo", "--json", *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_deterministic_demo_runs_make_the_same_batches_steps_and_losses_at_other_speeds():
    """`--deterministic`: the same data, seed and config give the same batches (a digest of every rank's
    sample ids per step), steps and loss curve, bit for bit, although the second run has twice the
    preprocessing actors and trainers that take 50 ms more per step (without the flag, batches follow
    both speeds). The actors' count is not part of the job: each rank's source emits in its view's order."""
    common = (
        "--deterministic",
        "--num-samples",
        "96",
        "--window",
        "8",
        "--depth",
        "4",
        "--seed",
        "3",
        "--no-baseline",
    )
    a = _demo_json(*common, "--num-actors", "2")
    b = _demo_json(*common, "--num-actors", "4", "--step-time", "0.05")
    assert a["deterministic"] is b["deterministic"] is True
    assert a["preprocess"]["actors"] == 2 and b["preprocess"]["actors"] == 4
    assert a["missing"] == a["duplicates"] == b["missing"] == b["duplicates"] == 0
    assert a["steps_per_rank"] == b["steps_per_rank"] and a["steps_per_rank"][0] > 5, (
        a["steps_per_rank"],
        b["steps_per_rank"],
    )
    assert len(a["step_digests"]) == a["steps_per_rank"][0]
    assert a["step_digests"] == b["step_digests"], "the runs made other batches"
    assert a["losses"] == b["losses"] and a["loss_last"] == b["loss_last"], "the same batches, other losses"
