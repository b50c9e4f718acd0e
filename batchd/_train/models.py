"""The one `build_model` of batchd's trainers, and what the bench measures of a model.

Kinds (`MODELS`): `tiny`, the demo's and the reference trainer's `TinyCausalLM` (its sizes overridable);
`llama-100m`, the bench's Llama-style decoder for the GPU run (12 layers, d_model 768, 12 heads, SwiGLU
2048, vocab 32000, tied head: 24.6M embedding + 12 x 7.1M = 109.5M parameters); either behind
`TinyMLLM`'s encoders when images are asked for (`images=True`, or an ``image_token_id`` among the
sizes); and `tiny-qwen2vl`, the stock HF Qwen2VLForConditionalGeneration of `batchd._vlm_tiny` (2-block ViT,
2-layer M-RoPE LM) adapted by `batchd.two_phase`, for the synthetic samples.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from batchd.service.preprocess import SYNTHETIC_MELS, SYNTHETIC_PATCH_DIM

from .._mllm import TinyMLLM
from .._model import TinyCausalLM

MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"vocab_size": 512, "d_model": 128, "n_layers": 2, "n_heads": 4, "max_len": 4096},
    "llama-100m": {"vocab_size": 32000, "d_model": 768, "n_layers": 12, "n_heads": 12, "max_len": 32768},
    "tiny-qwen2vl": {},
}
HF_MODELS = ("tiny-qwen2vl",)
SYNTHETIC_VOCAB = 512  # token ids of the synthetic samples (SyntheticSource's default vocabulary)
HF_PATCH_DIM = 3 * 2 * 14 * 14  # Qwen2-VL's patch row: channels x temporal patch x 14 x 14
_MM_KEYS = ("image_token_id", "audio_token_id", "n_mels", "patch_dim", "d_vision", "d_audio")


def build_model(
    kind: str = "tiny",
    seed: int = 0,
    max_len: int = 0,
    images: bool = False,
    audio: bool = False,
    *,
    dtype: torch.dtype = torch.float32,
    **sizes: Any,
) -> torch.nn.Module:
    """The model `kind` (module docstring), randomly initialised from `seed` (identical on every rank).

    Args:
        kind: One of `MODELS`.
        seed: The initialisation seed.
        max_len: Positions the model must reach (the preset's, or `sizes`' max_len, when larger).
        images: `TinyMLLM`'s vision encoder in front (its image token: the synthetic vocabulary's last id,
            its patch rows the synthetic samples'); with `audio`, its audio encoder too (the clips'
            placeholder: the vocabulary's id - 2). `tiny-qwen2vl` reads images either way.
        dtype: The parameters' dtype.
        **sizes: `TinyCausalLM` / `TinyMLLM` arguments over the preset's; an ``image_token_id`` (not None)
            makes it a `TinyMLLM` (the demo's multimodal jobs), an ``audio_token_id`` adds its audio encoder.

    Raises:
        ValueError: naming an unknown `kind`, or a bad size.
    """
    if kind not in MODELS:
        raise ValueError(f"unknown model, expected one of {sorted(MODELS)}, got {kind=}")
    if kind in HF_MODELS:
        return hf_qwen2vl(seed, max_len).to(dtype)
    cfg = {**MODELS[kind], **sizes}
    cfg["max_len"] = max(cfg["max_len"], max_len)
    if images:
        cfg.setdefault("image_token_id", SYNTHETIC_VOCAB - 1)
        cfg.setdefault("patch_dim", SYNTHETIC_PATCH_DIM)
        if audio:
            cfg.setdefault("audio_token_id", SYNTHETIC_VOCAB - 2)
            cfg.setdefault("n_mels", SYNTHETIC_MELS)
    torch.manual_seed(seed)
    if cfg.get("image_token_id") is not None:
        return TinyMLLM(**cfg).to(dtype)
    for key in _MM_KEYS:
        cfg.pop(key, None)
    return TinyCausalLM(**cfg).to(dtype)


def hf_qwen2vl(seed: int, max_len: int) -> torch.nn.Module:
    """The tiny stock Qwen2-VL for the synthetic samples, adapted by `batchd.two_phase`: vocabulary 515,
    image token 511 (the synthetic samples' placeholder, `SYNTHETIC_VOCAB - 1`, which their text never
    uses), video / vision start / vision end 512..514 (never in a sample: the payloads carry no vision
    markers, and two_phase derives mm_token_type_ids from the image token); pad 0, sdpa attention."""
    from transformers import Qwen2VLForConditionalGeneration

    from batchd._vlm_tiny import Qwen2VLTokens, tiny_qwen2vl_config
    from batchd.client import two_phase

    tokens = Qwen2VLTokens(
        SYNTHETIC_VOCAB + 3,
        image_token_id=SYNTHETIC_VOCAB - 1,
        video_token_id=SYNTHETIC_VOCAB,
        vision_start_token_id=SYNTHETIC_VOCAB + 1,
        vision_end_token_id=SYNTHETIC_VOCAB + 2,
        pad_token_id=0,
    )
    cfg = tiny_qwen2vl_config(tokens, max_position_embeddings=max(8192, max_len))
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration._from_config(cfg, attn_implementation="sdpa").train()
    return two_phase(model)


def hf_pixels(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with its synthetic patch rows ([P, SYNTHETIC_PATCH_DIM], what every system's data path
    carries) widened to Qwen2-VL's [P, 1176] by tiling, the same for every system: the ViT's patch embedding
    runs at its real width while the wire and the collate move the small rows (`synthetic_image_payload`)."""
    pixels = batch.get("pixel_values")
    if pixels is None or pixels.shape[-1] == HF_PATCH_DIM:
        return batch
    reps = -(-HF_PATCH_DIM // pixels.shape[-1])
    return {**batch, "pixel_values": pixels.repeat(1, reps)[:, :HF_PATCH_DIM].contiguous()}


def patches(batch: dict[str, Any]) -> int:
    """Vision-encoder patches a rank runs this step: the rows of its `pixel_values` (0 without images)."""
    pixels = batch.get("pixel_values")
    return int(pixels.shape[0]) if pixels is not None and pixels.ndim > 0 else 0


def vision_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision tower whose forward + backward `VisionTimer` times: HF Qwen2-VL's ``model.visual`` (ViT and
    merger), `TinyMLLM`'s ``vision``; None for a text-only model."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "visual"):
        return inner.visual
    return getattr(model, "vision", None)


class VisionTimer:
    """Times a vision tower's forward and backward inside the training step, without a collective or a sync
    (CPU autograd runs on the calling thread): forward from the tower's pre-hook to its forward hook;
    backward from the first gradient reaching the tower's output (after the two-phase exchange's own
    backward) to the last gradient accumulated into a tower parameter (its patch embedding, the first
    layer of the forward, comes last). A step whose rank encodes nothing counts 0 (only the zero-weight
    anchor reaches the tower's parameters then). On CUDA the times are host times (kernels are async),
    unless `sync`: then every timestamp waits for the device first (one synchronization per parameter
    tensor in the backward: a measurement, not a training setting).
    The reference trainer times its whole model with it (`batchd.train`'s cost check)."""

    def __init__(self, module: torch.nn.Module, sync: bool = False) -> None:
        self.on = False
        self.now = time.perf_counter if not sync else self._synced
        self.reset()
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._acc)

    @staticmethod
    def _synced() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    def reset(self) -> None:
        self.fwd_s, self.t_fwd, self.t_bwd, self.t_acc = 0.0, None, None, None

    def _pre(self, module, args) -> None:
        if self.on:
            self.t_fwd = self.now()

    def _post(self, module, args, output) -> None:
        if not self.on or self.t_fwd is None:
            return
        self.fwd_s += self.now() - self.t_fwd
        values = (
            output.values()
            if isinstance(output, dict)  # a ModelOutput; a tensor has .values() too
            else output
            if isinstance(output, (tuple, list))
            else (output,)
        )
        for t in values:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._grad)

    def _grad(self, grad: torch.Tensor) -> None:
        if self.t_bwd is None:
            self.t_bwd = self.now()

    def _acc(self, param: torch.Tensor) -> None:
        if self.on and self.t_bwd is not None:
            self.t_acc = self.now()

    def take(self) -> float:
        """The last step's vision forward + backward seconds; resets."""
        bwd = self.t_acc - self.t_bwd if self.t_bwd is not None and self.t_acc is not None else 0.0
        total = self.fwd_s + bwd
        self.reset()
        return total
