"""The model of `batchd bench --model tiny-qwen2vl`: the stock HF Qwen2VLForConditionalGeneration adapted by
`batchd.two_phase`, on the bench's own synthetic Qwen2-VL-layout payloads (two images in one sample, so M-RoPE
must tell adjacent images apart): the packed row's loss is the padded batch's, and the vision timer the bench
reports its vision share with sees the tower's forward and backward. The bench itself, every system on 256
samples, is measured in docs/benchmarks.md (a CLI run of it here cost CI more time than it has).
"""

from __future__ import annotations

import pytest
import torch


def test_tiny_qwen2vl_trains_padded_and_packed_alike():
    """The bench's model on the bench's payloads: the packed row's loss is the padded batch's (per-sample
    M-RoPE and restarting positions), and the vision timer sees the tower's forward and backward."""
    from batchd.client import collate_packed, collate_padded, forward_logits, token_loss_sum
    from batchd.testing import VisionTimer, hf_pixels, vision_module
    from batchd.testing import bench_model as build_model
    from batchd.testing import bench_payload as payload

    images = [[[16, 4]], [[32, 8], [8, 2]], []]  # sample 1: two images, one text token between them
    lengths = [40, 60, 20]
    model = build_model("tiny-qwen2vl", 0, 100)
    timer = VisionTimer(vision_module(model))
    samples = [payload(i, lengths, 0, images) for i in range(3)]
    losses = []
    for collate in (collate_padded, collate_packed):
        batch = hf_pixels(
            {k: torch.as_tensor(v) if not isinstance(v, int) else v for k, v in collate(samples).items()}
        )
        assert batch["pixel_values"].shape == (56, 1176)
        timer.on = True
        logits = forward_logits(model, batch)
        s, n = token_loss_sum(logits, batch["labels"])
        (s / n).backward()
        timer.on = False
        assert timer.take() > 0
        losses.append(float(s.detach()))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
