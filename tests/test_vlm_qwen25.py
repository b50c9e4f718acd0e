"""`batchd.two_phase` on a third stock family, Qwen2.5-VL (windowed ViT, its own get_rope_index): in-process,
the padded and the packed batch give the loss and gradients of the stock model called per sample.

The multi-rank proofs (DDP, the exchange, controls) run on Qwen2-VL and LLaVA in tests/test_hf_vlm.py; this
file checks that the adapter's Qwen path (encoder call, M-RoPE of packed rows) holds for Qwen2.5-VL too.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_hf_vlm import sample_loss  # the stock model called the HF way on one sample

from batchd import core
from batchd.client import token_loss_sum, two_phase
from batchd.service.preprocess import Example, HFProcessor, StageContext
from batchd.testing import finalize, tiny_processor, to_torch

pytest.importorskip("transformers")


def _img(h: int, w: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


RECORDS = [
    {
        "messages": [
            {"role": "user", "content": "<image> what is this?"},
            {"role": "assistant", "content": "a cat."},
        ],
        "images": [(56, 84)],
    },
    {
        "messages": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi, how are you?"},
        ],
        "images": [],
    },
    {
        "messages": [
            {"role": "user", "content": "<image><image> two"},
            {"role": "assistant", "content": "yes, two of them"},
        ],
        "images": [(112, 56), (56, 56)],
    },
]


@pytest.fixture(scope="module")
def payloads(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen25_proc")
    proc = tiny_processor("qwen2_vl")  # Qwen2.5-VL ships the same processor layout and template
    proc.save_pretrained(path)
    stage = HFProcessor(path)
    out = []
    for k, rec in enumerate(RECORDS):
        images = [_img(h, w, 10 * k + j) for j, (h, w) in enumerate(rec["images"])]
        ex = Example(k, 0, "", [dict(m) for m in rec["messages"]], None, images)
        out.append(finalize(stage(ex, StageContext(k, 0, 0, 0)))[1])
    return proc.tokenizer, out


def _model(tok):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tok.convert_tokens_to_ids
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=64,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
    )
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(cfg).double()


def _reference(model, payloads):
    total = sum(sample_loss(model, p) for p in payloads)
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_qwen25_vl_padded_and_packed_equal_the_stock_model_per_sample(payloads, layout):
    tok, samples = payloads
    ref = _model(tok)
    adapted = two_phase(copy.deepcopy(ref))
    want, want_grads = _reference(ref, samples)
    batch = to_torch(core.collate_padded(samples) if layout == "padded" else core.collate_packed(samples))
    got = token_loss_sum(adapted(batch)["logits"], batch["labels"])[0]
    got.backward()
    torch.testing.assert_close(got.detach(), want, rtol=1e-10, atol=1e-10)
    grads = dict(adapted.named_parameters())
    assert all(p.grad is not None for p in grads.values())  # the anchor reaches every parameter
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name].grad, g, rtol=1e-8, atol=1e-10, msg=name)
