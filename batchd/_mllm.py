"""A tiny Qwen2-VL-style multimodal LM in plain torch: the two-phase exchange's test model.

Architecture. A vision encoder turns a batch's ``pixel_values`` [P, 1176] (Qwen2-VL layout: each image's
patches contiguous, in the 2x2-merge order, so every 4 consecutive rows are one merged token; see
`batchd.service.preprocess.Qwen2VLVision`) into image-token embeddings [P / 4, d_model]:

    patch embedding   Linear(1176 -> d_vision)
    n_vision_layers x pre-norm block: x + attn(norm(x)), x + mlp(norm(x)); the attention is bidirectional
                      and block-diagonal per image (``image_grid_thw`` gives each image's t x h x w patches:
                      a patch attends to the patches of its own image only), the MLP is GELU (4 x d_vision)
    merger            RMSNorm, then 4 consecutive patch rows -> one row of 4 x d_vision,
                      Linear(4 d_vision -> d_model) -> GELU -> Linear(d_model -> d_model)

The encoder has no position embedding (within an image it is permutation-equivariant); it exists to
make the exchange's equivalences measurable, not to see. Every op is per row or per image, so an
image's embedding does not depend on which other images a rank encodes with it: that is what makes a
two-phase step (images encoded on other ranks, `batchd.client.exchange_image_embeddings` sending them
home) equal to a one-phase step to rounding. The LM is `batchd._model.TinyCausalLM`, fed
``inputs_embeds``: the token embeddings with the image embeddings written at the image-token positions
(``input_ids == image_token_id`` on real tokens, in row-major order = the LLM image order).

Size and cost. With the defaults (the LM's vocab 512, d_model 128, 2 layers, 4 heads, tied head:
467,584 parameters; d_vision 64, 2 vision layers, 2 heads) the encoder adds 223,040 parameters: patch
embedding 1176 d_v = 75,264; per vision block 4 d_v^2 = 16,384 (attention) + 8 d_v^2 = 32,768 (MLP)
+ 2 d_v (norms) = 49,280; merger 4 d_v d + d^2 + d_v = 49,216 (total 690,624). Forward matmul FLOPs per
*image token* (4 patches): 2 x 4 x (75,264 + 2 x 49,152) + 2 x 49,152 = 1.49 MFLOP in the encoder
(plus its attention, 4 x n_vision_layers x d_v x p per patch of an image of p patches), against
2 x 466,944 = 0.93 MFLOP per token in the LM (block matmuls and head). So an image token costs the
encoder ~1.6 x what any token costs the LM, and the encoder's share of a step's FLOPs (forward and
backward alike) is 1.6 f / (1.6 f + 1) for a fraction f of image tokens: ~44% at f = 1/2, ~28% at
f = 1/4. (Qwen2-VL-7B's 675M-parameter ViT costs ~0.35 x its LM per image token: the tiny encoder's
1,176-wide patch embedding weighs more at this scale.) That share is why a step whose images crowd
onto one rank is imbalanced even when its LLM tokens are balanced, which `batchd.core.plan_vision`
corrects.

Initialisation is deterministic given `torch.manual_seed` (normal(0, 0.02) for matrices, ones for norms;
the encoder is built before the LM), so every DDP rank and a single-process reference agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from batchd.client import exchange_audio_embeddings, exchange_image_embeddings

from ._model import RMSNorm, TinyCausalLM, _check_positive

PATCH_DIM = 3 * 2 * 14 * 14  # channels x temporal patch x 14 x 14 (Qwen2-VL)
MERGE = 4  # 2 x 2 patches per image token


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    raise ValueError(f"{name} must be a torch tensor or numpy array, got {type(value).__name__=}")


def image_patches(image_grid_thw: torch.Tensor) -> list[int]:
    """Each image's patch count t x h x w; ValueError unless the grid is int [n, 3] with even h and w."""
    grid = image_grid_thw
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.is_floating_point():
        raise ValueError(
            f"image_grid_thw must be an integer [images, 3] array, got {tuple(grid.shape)=} {grid.dtype=}"
        )
    out = []
    for t, h, w in grid.tolist():
        if t < 1 or h < 2 or w < 2 or h % 2 or w % 2:
            raise ValueError(
                f"an image grid needs t >= 1 and even h, w >= 2 (2x2 merge), got grid={(t, h, w)}"
            )
        out.append(t * h * w)
    return out


class VisionBlock(nn.Module):
    """Pre-norm ViT block with attention restricted to each image's patches (no causality, no positions)."""

    def __init__(self, d_vision: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm, self.mlp_norm = RMSNorm(d_vision), RMSNorm(d_vision)
        self.qkv = nn.Linear(d_vision, 3 * d_vision, bias=False)
        self.out = nn.Linear(d_vision, d_vision, bias=False)
        self.fc1 = nn.Linear(d_vision, 4 * d_vision, bias=False)
        self.fc2 = nn.Linear(4 * d_vision, d_vision, bias=False)

    def attention(self, x: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        p, d = x.shape
        q, k, v = self.qkv(x).view(p, 3, self.n_heads, d // self.n_heads).permute(1, 2, 0, 3)  # [H, P, Dh]
        if bounds:
            y = torch.cat(
                [F.scaled_dot_product_attention(q[:, s:e], k[:, s:e], v[:, s:e]) for s, e in bounds], dim=1
            )
        else:  # no image: keep qkv in the graph (zero rows), so DDP still sees its gradient
            y = v
        return self.out(y.transpose(0, 1).reshape(p, d))

    def forward(self, x: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x), bounds)
        return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x))))


class VisionEncoder(nn.Module):
    """pixel_values [P, 1176] + image_grid_thw [n, 3] -> image-token embeddings [P / 4, d_model].

    Args:
        d_model: Width of the LM the embeddings feed.
        d_vision: Encoder width (divisible by `n_heads`).
        n_layers: Vision blocks.
        n_heads: Vision attention heads.
        patch_dim: Values per patch (1176 for Qwen2-VL's 3 x 2 x 14 x 14).
    """

    def __init__(
        self,
        d_model: int,
        d_vision: int = 64,
        n_layers: int = 2,
        n_heads: int = 2,
        patch_dim: int = PATCH_DIM,
    ) -> None:
        super().__init__()
        for name, value in (
            ("d_model", d_model),
            ("d_vision", d_vision),
            ("n_vision_layers", n_layers),
            ("n_vision_heads", n_heads),
            ("patch_dim", patch_dim),
        ):
            _check_positive(name, value)
        if d_vision % n_heads:
            raise ValueError(f"d_vision must split into n_heads heads, got {d_vision=} {n_heads=}")
        self.patch_dim = patch_dim
        self.patch_embed = nn.Linear(patch_dim, d_vision, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(d_vision, n_heads) for _ in range(n_layers))
        self.merge_norm = RMSNorm(d_vision)
        self.merge_in = nn.Linear(MERGE * d_vision, d_model, bias=False)
        self.merge_out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Image-token embeddings in the order of the images and of their patch rows.

        Raises:
            ValueError: unless pixel_values is [sum of the grid's patches, patch_dim].
        """
        patches = image_patches(image_grid_thw)
        if (
            pixel_values.ndim != 2
            or pixel_values.shape[1] != self.patch_dim
            or pixel_values.shape[0] != sum(patches)
        ):
            raise ValueError(
                f"pixel_values must be [sum of patches = {sum(patches)}, {self.patch_dim}] for "
                f"image_grid_thw, got {tuple(pixel_values.shape)=}"
            )
        ends = np.cumsum(patches).tolist()
        bounds = list(zip([0, *ends[:-1]], ends, strict=False))
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        for block in self.blocks:
            x = block(x, bounds)
        x = self.merge_norm(x).reshape(-1, MERGE * x.shape[-1])  # 4 consecutive patches -> one token
        return self.merge_out(F.gelu(self.merge_in(x)))


def clip_tokens(frames: int) -> int:
    """Tokens the audio encoder makes of a clip of `frames` log-mel frames: a stride-2 convolution, then a
    stride-2 average pool (Qwen2-Audio's rule, `batchd.service.preprocess.qwen2_audio_tokens`)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


class AudioEncoder(nn.Module):
    """audio_features [F, n_mels] + audio_frames [clips] -> clip-token embeddings [sum of tokens, d_model].

    A Qwen2-Audio / Whisper-style encoder in miniature, per clip (nothing crosses a clip's boundary, so a
    clip's embedding does not depend on which other clips a rank encodes with it): Conv1d(n_mels -> d_audio,
    kernel 3) -> GELU -> Conv1d(kernel 3, stride 2) -> GELU, `n_layers` pre-norm blocks attending within the
    clip (`VisionBlock`), AvgPool1d(2, 2), RMSNorm and Linear(d_audio -> d_model): `clip_tokens(frames)`
    rows per clip. No position embedding: it exists to make the audio path measurable, not to hear.

    Args:
        d_model: Width of the LM the embeddings feed.
        n_mels: Mel bins of the features (128, the built-in chain's).
        d_audio: Encoder width (divisible by `n_heads`).
        n_layers, n_heads: Its blocks.
    """

    def __init__(
        self, d_model: int, n_mels: int = 128, d_audio: int = 64, n_layers: int = 1, n_heads: int = 2
    ):
        super().__init__()
        for name, value in (("n_mels", n_mels), ("d_audio", d_audio), ("n_audio_layers", n_layers)):
            _check_positive(name, value)
        if d_audio % n_heads:
            raise ValueError(f"d_audio must split into n_heads heads, got {d_audio=} {n_heads=}")
        self.n_mels = n_mels
        self.conv1 = nn.Conv1d(n_mels, d_audio, 3, padding=1)
        self.conv2 = nn.Conv1d(d_audio, d_audio, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(VisionBlock(d_audio, n_heads) for _ in range(n_layers))
        self.norm = RMSNorm(d_audio)
        self.proj = nn.Linear(d_audio, d_model, bias=False)

    def forward(self, features: torch.Tensor, frames: list[int]) -> torch.Tensor:
        """Clip-token embeddings, clip by clip in order (zero rows without clips; every parameter stays in
        the graph). Raises ValueError unless features is [sum(frames), n_mels]."""
        if features.ndim != 2 or features.shape[1] != self.n_mels or features.shape[0] != sum(frames):
            raise ValueError(
                f"audio_features must be [sum of audio_frames = {sum(frames)}, {self.n_mels}], got "
                f"{tuple(features.shape)=}"
            )
        features = features.to(self.conv1.weight.dtype)
        outs, start = [], 0
        for f in frames:
            x = F.gelu(self.conv1(features[start : start + f].T[None]))
            x = F.gelu(self.conv2(x))[0].T  # [(f - 1) // 2 + 1, d_audio]
            for block in self.blocks:
                x = block(x, [(0, x.shape[0])])
            x = F.avg_pool1d(x.T[None], 2, 2)[0].T  # [clip_tokens(f), d_audio]
            outs.append(self.proj(self.norm(x)))
            start += f
        if outs:
            return torch.cat(outs)
        zero = sum(p.sum() for p in self.parameters()) * 0.0  # no clip: the graph still holds every weight
        return self.proj.weight.new_zeros((0, self.proj.weight.shape[0])) + zero


@dataclass(frozen=True)
class MLLMConfig:
    """`TinyMLLM`'s sizes (its image token apart).

    Args:
        vocab_size, d_model, n_layers, n_heads, d_ff, max_len, tie_embeddings: The LM's (`TinyCausalLM`).
        d_vision, n_vision_layers, n_vision_heads, patch_dim: The encoder's (`VisionEncoder`).
        audio_token_id: The placeholder id of audio tokens (None: no audio encoder); n_mels, d_audio: its
            encoder's (`AudioEncoder`), built after the LM so the image model's initialisation is unchanged.

    Raises:
        ValueError: naming a size that is not a positive int.
    """

    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None
    max_len: int = 4096
    tie_embeddings: bool = True
    d_vision: int = 64
    n_vision_layers: int = 2
    n_vision_heads: int = 2
    patch_dim: int = PATCH_DIM
    audio_token_id: int | None = None
    n_mels: int = 128
    d_audio: int = 64

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("tie_embeddings", "audio_token_id") or f.name == "d_ff" and value is None:
                continue  # the audio token is checked against the vocabulary by `TinyMLLM`
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be an int >= 1, got {f.name}={value!r}")


class TinyMLLM(nn.Module):
    """`VisionEncoder` + `TinyCausalLM` (module docstring for sizes and cost), and with `audio_token_id`
    an `AudioEncoder` whose clip embeddings go to the audio-token positions: the clips this rank encodes,
    sent to their owners when the batch carries the audio exchange (`batchd.client.exchange_audio_embeddings`,
    a collective like the vision one), else its own samples' clips.

    Args:
        image_token_id: The placeholder id of image tokens in input_ids (in [1, vocab_size): 0 is the pad).
        config: Its sizes (`MLLMConfig`; default: its defaults).
        **sizes: `MLLMConfig` fields that replace `config`'s (`TinyMLLM(5, vocab_size=64)`).
    """

    takes_batch = True  # `batchd.client.forward_logits` passes the whole batch (pixels, the exchange)

    def __init__(self, image_token_id: int, config: MLLMConfig | None = None, **sizes: Any) -> None:
        """`sizes`: `MLLMConfig` fields, over `config` (or its defaults)."""
        super().__init__()
        cfg = replace(config or MLLMConfig(), **sizes)
        vocab_size, audio_token_id = cfg.vocab_size, cfg.audio_token_id
        for name, token in (("image_token_id", image_token_id), ("audio_token_id", audio_token_id)):
            if (token is not None or name == "image_token_id") and (
                isinstance(token, bool) or not isinstance(token, int) or not 0 < token < vocab_size
            ):
                raise ValueError(f"{name} must be an int in [1, {vocab_size=}), got {name}={token!r}")
        self.config = cfg
        self.image_token_id, self.audio_token_id = image_token_id, audio_token_id
        self.vision = VisionEncoder(
            cfg.d_model, cfg.d_vision, cfg.n_vision_layers, cfg.n_vision_heads, cfg.patch_dim
        )
        self.vision.apply(TinyCausalLM._init)
        lm = (
            cfg.vocab_size,
            cfg.d_model,
            cfg.n_layers,
            cfg.n_heads,
            cfg.d_ff,
            cfg.max_len,
            cfg.tie_embeddings,
        )
        self.lm = TinyCausalLM(*lm)
        self.audio: AudioEncoder | None = None
        if audio_token_id is not None:
            self.audio = AudioEncoder(cfg.d_model, cfg.n_mels, cfg.d_audio)
            self.audio.apply(TinyCausalLM._init)

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def encode(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """This rank's encoder output [rows, d_model] for the batch's pixel_values (zero rows without any:
        the encoder still runs, so every parameter is in the graph of every rank)."""
        pixels, grid = batch.get("pixel_values"), batch.get("image_grid_thw")
        if (pixels is None) != (grid is None):
            raise ValueError(
                f"pixel_values and image_grid_thw come together, got {pixels is None=} {grid is None=}"
            )
        weight = self.vision.patch_embed.weight
        if pixels is None:
            pixels = torch.zeros((0, self.vision.patch_dim), dtype=weight.dtype, device=weight.device)
            grid = torch.zeros((0, 3), dtype=torch.int64)
        pixels = _as_tensor(pixels, "pixel_values").to(weight.device)
        return self.vision(pixels, _as_tensor(grid, "image_grid_thw").cpu())

    def encode_audio(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """This rank's audio-encoder output [rows, d_model] for the batch's clips (zero rows without any)."""
        assert self.audio is not None
        feats, frames = batch.get("audio_features"), batch.get("audio_frames")
        if (feats is None) != (frames is None):
            raise ValueError(
                f"audio_features and audio_frames come together, got {feats is None=} {frames is None=}"
            )
        weight = self.audio.proj.weight
        if feats is None:
            return self.audio(weight.new_zeros((0, self.audio.n_mels)), [])
        counts = [int(f) for f in _as_tensor(frames, "audio_frames").reshape(-1).tolist()]
        return self.audio(_as_tensor(feats, "audio_features").to(weight.device), counts)

    def _write_audio(
        self,
        flat: torch.Tensor,
        batch: Mapping[str, Any],
        input_ids: torch.Tensor,
        mask: torch.Tensor | None,
        group: Any = None,
    ) -> torch.Tensor:
        clips = exchange_audio_embeddings(self.encode_audio(batch), batch, group)
        at = input_ids == self.audio_token_id
        if mask is not None:
            at &= mask.bool()
        where = at.reshape(-1).nonzero().squeeze(1)
        if where.shape[0] != clips.shape[0]:
            raise ValueError(
                f"the batch has {where.shape[0]} audio-token positions but {clips.shape[0]} audio "
                f"embedding rows (audio_token_id={self.audio_token_id})"
            )
        return flat.index_copy(0, where, clips.to(flat.dtype))

    def forward(self, batch: Mapping[str, Any], group: Any = None) -> torch.Tensor:
        """Logits [B, T, vocab] of a collated batch (padded or packed, `batchd.client.collate_*`).

        Encodes the batch's ``pixel_values``, sends the embeddings to their owners when the batch carries
        the exchange arrays (`batchd.client.exchange_image_embeddings`, a collective over `group`: every
        rank calls forward, and backward, every step), else uses its own encoder output (one-phase: its
        own images, in LLM order), and writes them at the image-token positions.

        Raises:
            ValueError: when the number of image-token positions differs from the image embedding rows.
        """
        input_ids = _as_tensor(batch["input_ids"], "input_ids")
        device = self.lm.embed.weight.device
        input_ids = input_ids.to(device)
        extra = {
            k: _as_tensor(batch[k], k).to(device)
            for k in ("attention_mask", "position_ids", "cu_seqlens")
            if batch.get(k) is not None
        }
        images = exchange_image_embeddings(self.encode(batch), batch, group)
        mask = input_ids == self.image_token_id
        if "attention_mask" in extra:
            mask &= extra["attention_mask"].bool()
        where = mask.reshape(-1).nonzero().squeeze(1)
        if where.shape[0] != images.shape[0]:
            raise ValueError(
                f"the batch has {where.shape[0]} image-token positions but {images.shape[0]} "
                f"image embedding rows (image_token_id={self.image_token_id})"
            )
        tokens = self.lm.embed(input_ids)
        b, t, d = tokens.shape
        flat = tokens.reshape(b * t, d).index_copy(0, where, images.to(tokens.dtype))
        if self.audio is not None:
            flat = self._write_audio(flat, batch, input_ids, extra.get("attention_mask"), group)
        embeds = flat.view(b, t, d)
        return self.lm(
            attention_mask=extra.get("attention_mask"),
            position_ids=extra.get("position_ids"),
            cu_seqlens=extra.get("cu_seqlens"),
            inputs_embeds=embeds,
        )
