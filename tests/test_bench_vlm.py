"""`batchd bench --model tiny-qwen2vl`: the stock HF Qwen2VLForConditionalGeneration, adapted by
`batchd.two_phase`, trained by batchd two-phase and packed on the same synthetic Qwen2-VL-layout samples, through `python -m batchd.bench --json`.

The smallest run: 24 samples of a multimodal .csv written here (0..3 images of 4..16 tokens, some samples
with two or three images so M-RoPE must tell adjacent images apart), L=600, 2 gloo ranks, one epoch. What
it checks: every system trained every id exactly once, finite losses, the packed system one row per step,
and the vision tower's share of rank 0's time reported in (0, 1).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from batchd import bench

NUM = 24


def _mm_workload(tmp_path: Path, n: int) -> Path:
    rng = np.random.default_rng(5)
    rows = ["text_tokens,image_patches,image_tokens"]
    for _ in range(n):
        tokens = [int(t) for t in rng.choice([4, 8, 16], size=int(rng.choice([0, 1, 1, 2, 3])))]
        text = int(rng.integers(8, 120))
        rows.append(f"{text},{' '.join(str(4 * t) for t in tokens)},{' '.join(map(str, tokens))}")
    path = tmp_path / "mm.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_tiny_qwen2vl_trains_padded_and_packed_alike():
    """The bench's model on the bench's payloads: the packed row's loss is the padded batch's (per-sample
    M-RoPE and restarting positions), and the vision timer sees the tower's forward and backward."""
    from batchd._bench_trainer import VisionTimer, build_model, hf_pixels, payload, vision_module
    from batchd.client import collate_packed, collate_padded, forward_logits, token_loss_sum

    images = [[[16, 4]], [[32, 8], [8, 2]], []]  # sample 1: two images, one text token between them
    lengths = [40, 60, 20]
    model = build_model("tiny-qwen2vl", 0, 100)
    timer = VisionTimer(vision_module(model))
    samples = [payload(i, lengths, 0, images) for i in range(3)]
    losses = []
    for collate in (collate_padded, collate_packed):
        batch = hf_pixels({k: torch.as_tensor(v) if not isinstance(v, int) else v
                           for k, v in collate(samples).items()})
        assert batch["pixel_values"].shape == (56, 1176)
        timer.on = True
        logits = forward_logits(model, batch)
        s, n = token_loss_sum(logits, batch["labels"])
        (s / n).backward()
        timer.on = False
        assert timer.take() > 0
        losses.append(float(s.detach()))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


@pytest.mark.slow
def test_bench_tiny_qwen2vl_every_system_trains_every_id_once(tmp_path):
    workload = _mm_workload(tmp_path, NUM + 4)
    # the two systems whose model calls only the stock HF model makes here (the two-phase exchange, packed rows);
    # fixed, odb-0.1.2 and batchd-balanced make padded one-phase calls (the fast test above) and run in the
    # measured bench (docs/benchmarks.md)
    systems = ["batchd-2phase", "batchd-packed"]
    assert set(systems) <= set(bench.HF_VLM_SYSTEMS)
    proc = subprocess.run(
        [sys.executable, "-m", "batchd.bench", "--json", "--model", "tiny-qwen2vl", "--workload", str(workload),
         "--num-samples", str(NUM), "--heldout", "4", "--token-budget", "600", "--window", "8", "--depth", "2",
         "--systems", ",".join(systems)],
        capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["model"] == "tiny-qwen2vl" and s["images"] > 0
    assert list(s["systems"]) == systems
    for name, r in s["systems"].items():
        assert (r["samples"], r["missing"], r["duplicates"], r["unexpected"]) == (NUM, 0, 0, 0), (name, r)
        assert np.isfinite(r["final_loss"]) and np.isfinite(r["heldout_loss"]), (name, r)
        assert r["params"] > 100_000 and r["encoder_patches"] > 0, (name, r)
        assert 0 < r["vision_share"] < 1 and 0 < r["vision_share_mean"] < 1, (name, r)
    assert s["systems"]["batchd-packed"]["padding_efficiency"] == 1.0  # one packed row per step, no pads
