"""A tiny, randomly initialised Llama-style causal LM in plain torch (the demo's and tests' model).

Architecture: token embedding -> N pre-norm blocks (RMSNorm -> causal multi-head self-attention with
rotary position embeddings -> residual; RMSNorm -> SwiGLU MLP -> residual) -> final RMSNorm -> LM head
(tied to the embedding by default). Attention runs through
`torch.nn.functional.scaled_dot_product_attention` with one boolean mask that combines

* causality (key position <= query position),
* the padding mask (``attention_mask == 0`` keys are never attended to), and
* sample boundaries for packed rows: a new sample starts wherever ``position_ids`` restarts at 0
  (the convention `collate_packed` follows), so attention is block-diagonal and a packed sample
  sees exactly what it would see alone.

Every query may always attend to itself, so pad rows never produce an all-masked softmax (NaN),
whose gradient would poison the real rows through the shared weights. Rotary embeddings take
``position_ids``, so a sample's logits are identical alone, padded in a batch, or packed: that is what
makes the padded / packed / unpadded losses agree to rounding.

Size and cost. With the defaults (vocab 512, d_model 128, 2 layers, 4 heads, d_ff 352 = 8/3 d
rounded up to a multiple of 32, tied head) the model has 467,584 parameters: embedding 65,536;
per block 4 d^2 = 65,536 (attention) + 3 d d_ff = 135,168 (SwiGLU) + 2 d (norms) = 200,960; final
norm 128 (untied head: +65,536 = 533,120). A training step costs about 6 x params x tokens FLOPs
(forward 2, backward 4 per parameter per *materialized* token, the head included) plus
12 x n_layers x d x sum(T_row^2) for attention (dense kernels compute the full T x T square): at a
budget of 8,192 materialized tokens that is ~23 GFLOP of matmuls plus ~3.2 GFLOP of attention for 64
rows of 128 (linear in the row length), against a per-step overhead that does not grow with tokens
(fetching ids, collating, a 1.9 MB fp32 gradient all-reduce). Step time is therefore roughly
proportional to materialized tokens, which is the quantity batchd's cost models balance; padding
shows up directly as wasted time. Measured step times: docs/benchmarks.md (`batchd bench`,
`batchd demo`).

The trade-off: no KV cache, no fused varlen kernel (given `cu_seqlens`, a packed row's attention runs
one SDPA call per sample, sum(n_i^2) work but a Python loop over samples; without it the block-diagonal
mask is a dense [T, T] mask, quadratic in the packed row length), no dropout. It exists to make
loss/gradient equivalences and straggler effects measurable, not to be fast.

Initialisation is deterministic given `torch.manual_seed` (normal(0, 0.02) for matrices, ones for
norms), so every DDP rank and a single-process reference build the same weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _check_positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return value


def default_d_ff(d_model: int) -> int:
    """Llama's SwiGLU width: 8/3 x d_model, rounded up to a multiple of 32."""
    return 32 * math.ceil(8 * d_model / 3 / 32)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned gain (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor, position_ids: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Applies rotary position embeddings (half-split layout) to x [B, H, T, Dh] at positions [B, T]."""
    half = x.shape[-1] // 2
    dtype = torch.promote_types(x.dtype, torch.float32)  # angles in >= fp32 even for bf16 activations
    inv_freq = base ** (-torch.arange(half, device=x.device, dtype=dtype) / half)
    angles = position_ids.to(dtype)[:, None, :, None] * inv_freq  # [B, 1, T, half]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention_mask_4d(attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The boolean [B, 1, T, T] mask (True = may attend): causal, padding- and sample-aware.

    Args:
        attention_mask: [B, T], 1 for real tokens, 0 for pads.
        position_ids: [B, T]; a new sample starts wherever a position is 0.
    """
    t = position_ids.shape[-1]
    idx = torch.arange(t, device=position_ids.device)
    causal = idx[None, :] <= idx[:, None]  # [T(q), T(k)]
    segment = torch.cumsum((position_ids == 0).to(torch.int64), dim=-1)  # [B, T]
    same = segment[:, :, None] == segment[:, None, :]
    keep = causal[None] & same & attention_mask.bool()[:, None, :]
    keep |= torch.eye(t, dtype=torch.bool, device=position_ids.device)[None]  # never an empty row
    return keep[:, None]


class Attention(nn.Module):
    """Multi-head causal self-attention with rotary positions and no biases."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        segments: list[tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = rotary(q, position_ids), rotary(k, position_ids)
        if segments is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:  # varlen: one causal attention per packed sample, sum(n_i^2) instead of T^2
            y = torch.cat(
                [
                    F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True)
                    for s, e in segments
                ],
                dim=2,
            )
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    """The Llama MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=False)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(d_model), Attention(d_model, n_heads)
        self.mlp_norm, self.mlp = RMSNorm(d_model), SwiGLU(d_model, d_ff)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        segments: list[tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), mask, position_ids, segments)
        return x + self.mlp(self.mlp_norm(x))


class TinyCausalLM(nn.Module):
    """A small Llama-style decoder (see the module docstring for the cost model and sizes).

    Args:
        vocab_size: Token ids are in [0, vocab_size).
        d_model: Hidden width; must be divisible by `n_heads` with an even head dim (rotary).
        n_layers: Transformer blocks.
        n_heads: Attention heads.
        d_ff: SwiGLU width; None means `default_d_ff(d_model)`.
        max_len: Longest position id accepted.
        tie_embeddings: Share the LM head with the token embedding.
    """

    def __init__(
        self,
        vocab_size: int = 512,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        d_ff: int | None = None,
        max_len: int = 4096,
        tie_embeddings: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("d_model", d_model),
            ("n_layers", n_layers),
            ("n_heads", n_heads),
            ("max_len", max_len),
        ):
            _check_positive(name, value)
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ValueError(f"d_model must split into n_heads heads of even size, got {d_model=} {n_heads=}")
        d_ff = default_d_ff(d_model) if d_ff is None else _check_positive("d_ff", d_ff)
        self.vocab_size, self.max_len = vocab_size, max_len
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)
        if tie_embeddings:
            self.head.weight = self.embed.weight

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] for input_ids [B, T] (or for inputs_embeds [B, T, d_model]).

        Args:
            input_ids: int64 [B, T]; exactly one of `input_ids` and `inputs_embeds` is given.
            attention_mask: [B, T], 1 real / 0 pad; None means all real.
            position_ids: [B, T]; None means 0..T-1 per row. Zeros after the first token start a new
                sample (packed rows); pads should carry 0 and be masked by `attention_mask`.
            cu_seqlens: For one packed row (B = 1, no pads): the sample boundaries [0, n_1, ..., T]
                (`collate_packed`'s). Attention then runs per sample (varlen), costing sum(n_i^2)
                instead of the dense block-diagonal mask's T^2; the logits are the same.
            inputs_embeds: [B, T, d_model] token embeddings used instead of ``embed(input_ids)`` (a
                multimodal model writes image embeddings into them, `batchd._mllm.TinyMLLM`); the
                blocks, masks and head are the same as for ids.

        Raises:
            ValueError: on shape mismatches, out-of-range ids or positions, or unless exactly one of
                `input_ids` / `inputs_embeds` is given.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError(
                f"give exactly one of input_ids and inputs_embeds, got "
                f"{input_ids is None=} {inputs_embeds is None=}"
            )
        if inputs_embeds is not None:
            if inputs_embeds.ndim != 3 or inputs_embeds.shape[-1] != self.embed.embedding_dim:
                raise ValueError(
                    f"inputs_embeds must be [B, T, {self.embed.embedding_dim}], got "
                    f"{tuple(inputs_embeds.shape)=}"
                )
            shape, device = inputs_embeds.shape[:2], inputs_embeds.device
        else:
            if input_ids.ndim != 2:
                raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)=}")
            shape, device = input_ids.shape, input_ids.device
        b, t = shape
        if position_ids is None:
            position_ids = torch.arange(t, device=device).expand(b, t)
        if attention_mask is None:
            attention_mask = torch.ones(shape, dtype=torch.int64, device=device)
        for name, x in (("attention_mask", attention_mask), ("position_ids", position_ids)):
            if x.shape != shape:
                raise ValueError(
                    f"{name} must match the tokens' [B, T] = {tuple(shape)}, got {tuple(x.shape)=}"
                )
        max_pos = int(position_ids.max())
        if (
            t > self.max_len and cu_seqlens is None
        ) or max_pos >= self.max_len:  # packed rows: positions count
            raise ValueError(f"positions must be < max_len={self.max_len}, got {t=} {max_pos=}")
        segments = None
        if cu_seqlens is not None:
            cu = [int(c) for c in cu_seqlens.tolist()]
            if b != 1 or cu[0] != 0 or cu[-1] != t or any(e <= s for s, e in zip(cu, cu[1:], strict=False)):
                raise ValueError(
                    f"cu_seqlens must rise strictly from 0 to T={t} for one packed row, got "
                    f"{cu=} with batch size {b}"
                )
            if not bool(attention_mask.all()):
                raise ValueError(
                    "cu_seqlens describes a packed row without pads, but attention_mask has zeros"
                )
            segments = list(zip(cu, cu[1:], strict=False))
        mask = None if segments is not None else attention_mask_4d(attention_mask, position_ids)
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for block in self.blocks:
            x = block(x, mask, position_ids, segments)
        return self.head(self.norm(x))
