"""`batchd calibrate`: measure the user's model on the user's device, fit the cost model and the budget.

It trains the model on a designed set of batches (sample lengths from `min_length` doubling up to
`max_tokens`; padded: 1, a middle count and the most rows of each length that fit `max_tokens`; packed:
as many documents of each length in one row), times forward + backward + optimizer step (the fastest
of `repeats` runs after one warm-up, synchronized on CUDA: whatever else the machine runs only ever adds
to a step's time, so the fastest is the step's own) and takes each step's peak memory: on CUDA the
caching allocator's `max_memory_allocated` (the real peak, reset before each step); on CPU the bytes
the step holds at its peak as accounted by torch, the persistent state (parameters, gradients,
optimizer state) plus the activations autograd saved for the backward (`saved_tensors_hooks`, each
storage once). `batchd.core.fit_layout` fits both to overhead + linear x tokens + quadratic x attention
pairs per layout; the result is the cost model the fit supports, its fit error, and the largest token
budget whose worst batch (one sample of that length) stays within (1 - margin) of the memory limit
(CUDA: the device's total memory; CPU: `memory_limit`, default the machine's available memory). The
fitted budget is capped at EXTRAPOLATE x `max_tokens` (a fit is not trusted far beyond what it
measured), then confirmed: that worst batch is trained and its peak measured; while it runs out of
memory or peaks above the limit, the budget is lowered by an eighth.

Writes, under `out`: `calibration.toml` (a `[job]` fragment: token_budget and `[job.cost]`, which
`batchd config` loads), `calibration.json` (every measured batch, both fits) and `calibration.svg`
(measured against predicted step time, per layout), and prints the fit as a table.

The model: a reference model by name (`batchd._train.models.MODELS`: tiny, llama-100m), a stock Hugging
Face model directory (`hf_model`), or `entry` = "module:function" (the function takes the device and
returns the model, or (model, optimizer); default optimizer AdamW lr 1e-4), called as
`batchd.client.train_step` calls it: ``model(input_ids, attention_mask=..., position_ids=...)`` padded,
with ``cu_seqlens`` packed.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchd.client import collate_packed, collate_padded, loss_tokens, train_step
from batchd.core import BUDGET_QUANTUM, CostFit, CostModel, Measured, StepInfo, fit_layout

LAYOUTS = ("padded", "packed")  # the rank service's collations (`[job.policy] collate`)

__all__ = ["CalibrateOptions", "Calibration", "calibrate", "design", "fragment", "table", "write_outputs"]

VOCAB = 512  # the reference models' synthetic vocabulary (an HF model's own is used when larger)
EXTRAPOLATE = 2  # the budget is at most this many times the largest measured batch (max_tokens)


@dataclasses.dataclass(frozen=True)
class CalibrateOptions:
    """What `calibrate` measures and how (module docstring)."""

    model: str = "tiny"
    hf_model: str | None = None
    entry: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    layouts: tuple[str, ...] = LAYOUTS
    min_length: int = 32
    max_tokens: int = 2048
    repeats: int = 3
    memory_limit: int | None = None
    margin: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        for layout in self.layouts:
            if layout not in LAYOUTS:
                raise ValueError(f"layouts must be among {LAYOUTS}, got {self.layouts=}")
        if not self.layouts:
            raise ValueError(f"layouts must name at least one layout, got {self.layouts=}")
        if not 1 <= self.min_length <= self.max_tokens:
            raise ValueError(f"need 1 <= min_length <= max_tokens, got {self.min_length=} {self.max_tokens=}")
        if self.max_tokens < 4 * self.min_length:
            raise ValueError(f"max_tokens must be at least 4 x min_length, got {self.max_tokens=}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats=}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin=}")
        if self.memory_limit is not None and self.memory_limit < 1:
            raise ValueError(f"memory_limit must be > 0 bytes, got {self.memory_limit=}")
        if sum(x is not None for x in (self.hf_model, self.entry)) > 1:
            raise ValueError("give at most one of hf_model and entry")


def design(min_length: int, max_tokens: int, layout: str) -> list[tuple[int, ...]]:
    """The batches measured for `layout`: lengths min_length, 2 min_length, ... <= max_tokens; for each,
    1, a middle count and the most samples that fit max_tokens (padded rows, or packed documents)."""
    out: list[tuple[int, ...]] = []
    length = min_length
    while length <= max_tokens:
        most = max_tokens // length
        for count in sorted({1, max(1, most // 2), most}):
            out.append((length,) * count)
        length *= 2
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout=}")
    return out


def _payload(length: int, k: int, vocab: int) -> dict[str, np.ndarray]:
    ids = (1 + (np.arange(length, dtype=np.int64) * 7 + k) % (vocab - 1)).astype(np.int32)
    return {"input_ids": ids, "labels": ids.copy()}


def _batch(lengths: Sequence[int], layout: str, vocab: int, device: torch.device) -> tuple[dict, StepInfo]:
    payloads = [_payload(n, k, vocab) for k, n in enumerate(lengths)]
    batch = collate_padded(payloads) if layout == "padded" else collate_packed(payloads)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    n_loss = sum(loss_tokens(p["labels"]) for p in payloads)
    info = StepInfo(
        rank=0, step=0, round=0, is_idle=False, local_samples=len(lengths), local_tokens=sum(lengths),
        local_loss_tokens=n_loss, global_samples=len(lengths), global_tokens=sum(lengths),
        global_loss_tokens=n_loss, loss_scale=1.0, cost=float(sum(lengths)),
    )  # fmt: skip
    return batch, info


class _Saved:
    """The bytes autograd saves for the backward (each storage once), while active."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return t


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    for state in opt.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, lengths: Sequence[int], layout: str, vocab: int,
    device: torch.device, repeats: int,
) -> Measured:  # fmt: skip
    """One designed batch: a warm-up step, then the fastest of `repeats` steps' seconds and the peak
    bytes (module docstring)."""
    batch, info = _batch(lengths, layout, vocab, device)
    train_step(model, opt, batch, info)  # warm-up: kernels, the optimizer's state
    times = []
    peak = 0
    for _ in range(repeats):
        saved = _Saved()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            train_step(model, opt, batch, info)
        _sync(device)
        times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            peak = max(peak, int(torch.cuda.max_memory_allocated(device)))
        else:
            peak = max(peak, _state_bytes(model, opt) + saved.bytes)
    return Measured(tuple(lengths), layout, min(times), peak)


def build(
    opts: CalibrateOptions, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer, int, str]:
    """The model, its optimizer, its vocabulary and a one-line description."""
    dtype = getattr(torch, opts.dtype)
    if opts.entry is not None:
        module, _, name = opts.entry.partition(":")
        if not name:
            raise ValueError(f"entry must be 'module:function', got {opts.entry=}")
        if str(Path.cwd()) not in sys.path:  # the user's module, beside where they run the command
            sys.path.insert(0, str(Path.cwd()))
        made = getattr(importlib.import_module(module), name)(device)
        model, opt = made if isinstance(made, tuple) else (made, None)
        what = f"{opts.entry}()"
    elif opts.hf_model is not None:
        from batchd._vlm_tiny import load_vlm
        from batchd.client import two_phase

        model = two_phase(load_vlm(opts.hf_model).to(device, dtype))  # as batchd.train trains it
        opt, what = None, f"Hugging Face model {opts.hf_model}"
    else:
        from batchd._train.models import build_model

        model = build_model(opts.model, opts.seed, opts.max_tokens + 1, dtype=dtype).to(device)
        opt, what = None, f"reference model {opts.model!r}"
    model.train()
    if opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    vocab = int(embed.num_embeddings) if embed is not None else VOCAB
    special = _special_ids(getattr(model, "config", None))  # image and other markers: kept out of the text
    vocab = min([vocab, 1 << 15, *(i for i in special if i > 1)])
    return model, opt, vocab, f"{what}, {opts.dtype}, on {device}"


def _special_ids(config: Any) -> set[int]:
    """The `*_token_id` values of a Hugging Face config and its sub-configs (text, vision)."""
    out: set[int] = set()
    if config is None:
        return out
    for key, value in vars(config).items():
        if key.endswith("token_id") and isinstance(value, int):
            out.add(value)
        elif key.endswith("_config") and hasattr(value, "__dict__"):
            out |= _special_ids(value)
    return out


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What `calibrate` found: every measured batch, a fit per layout, the memory limit it fitted the
    budget to, the budget and the cost model it recommends."""

    model: str
    device: str
    measured: tuple[Measured, ...]
    fits: dict[str, CostFit]
    memory_limit: int
    margin: float
    layout: str
    token_budget: int | None
    cost: CostModel
    fitted_budget: int | None = None  # what the memory fit allows, before the cap and the confirmation
    worst: Measured | None = None  # the budget's worst batch, measured

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "memory_limit": self.memory_limit,
            "margin": self.margin,
            "layout": self.layout,
            "token_budget": self.token_budget,
            "fitted_budget": self.fitted_budget,
            "worst": dataclasses.asdict(self.worst) if self.worst else None,
            "cost": {"name": self.cost.name, "quadratic": self.cost.quadratic},
            "fits": {
                k: {"time": f.time.to_json(), "memory": f.memory.to_json() if f.memory else None}
                for k, f in self.fits.items()
            },
            "measured": [dataclasses.asdict(m) for m in self.measured],
        }


def _memory_limit(opts: CalibrateOptions, device: torch.device) -> int:
    if opts.memory_limit is not None:
        return opts.memory_limit
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read the available memory (/proc/meminfo): give --memory-limit")


def calibrate(opts: CalibrateOptions, log: Callable[[str], None] = lambda s: None) -> Calibration:
    """Measures `opts`' model over the designed batches of each layout and fits them (module
    docstring). The recommended layout is packed when measured (no padding), else padded."""
    device = torch.device(opts.device)
    torch.manual_seed(opts.seed)
    model, opt, vocab, what = build(opts, device)
    measured: list[Measured] = []
    for layout in opts.layouts:
        batches = design(opts.min_length, opts.max_tokens, layout)
        for i, lengths in enumerate(batches):
            m = measure_step(model, opt, lengths, layout, vocab, device, opts.repeats)
            measured.append(m)
            shape = f"{len(lengths)} x {lengths[0]} tokens"
            log(f"{layout} {i + 1}/{len(batches)}: {shape}: {m.seconds * 1e3:.1f} ms")
    fits = {layout: fit_layout(measured, layout) for layout in opts.layouts}
    limit = _memory_limit(opts, device)
    layout = "packed" if "packed" in fits else "padded"
    fitted = fits[layout].largest_budget(limit, opts.margin)
    budget, worst = _confirm(
        model, opt, min(fitted, EXTRAPOLATE * opts.max_tokens) if fitted else None, layout, vocab, device,
        (1 - opts.margin) * limit, log,
    )  # fmt: skip
    cost = fits[layout].cost_model(budget or opts.max_tokens)
    return Calibration(
        what, str(device), tuple(measured), fits, limit, opts.margin, layout, budget, cost, fitted, worst
    )


def _confirm(
    model: torch.nn.Module, opt: torch.optim.Optimizer, budget: int | None, layout: str, vocab: int,
    device: torch.device, room: float, log: Callable[[str], None],
) -> tuple[int | None, Measured | None]:  # fmt: skip
    """The budget, confirmed: its worst batch (one sample of the budget's length) trained and its peak
    measured; while it runs out of memory or peaks above `room`, the budget is lowered by an eighth."""
    while budget is not None:
        try:
            m: Measured | None = measure_step(model, opt, (budget,), layout, vocab, device, 1)
        except torch.OutOfMemoryError:
            m = None
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        if m is not None and m.peak_bytes <= room:
            log(f"budget {budget}: one sample of {budget} tokens peaked at {m.peak_bytes / 2**30:.2f} GiB")
            return budget, m
        log(
            f"budget {budget}: "
            + ("out of memory" if m is None else f"peaked at {m.peak_bytes / 2**30:.2f} GiB")
        )
        lower = budget * 7 // 8 // BUDGET_QUANTUM * BUDGET_QUANTUM
        budget = lower if lower >= BUDGET_QUANTUM else None
    return None, None


def fragment(cal: Calibration) -> str:
    """The `[job]` fragment of `cal` (TOML)."""
    fit = cal.fits[cal.layout].time
    lines = [
        f"# batchd calibrate: {cal.model}",
        f"# {cal.layout} layout: step seconds = {fit.overhead:.4g} + {fit.linear:.4g} x tokens + "
        f"{fit.quadratic:.4g} x attention pairs (R^2 {fit.r2:.4f}, max error {fit.max_rel_err:.1%})",
        "[job]",
        "world_size = 1  # measured per rank: set your job's trainer ranks",
    ]
    if cal.token_budget is not None and cal.worst is not None:
        lines.append(
            f"token_budget = {cal.token_budget}  # one sample of it peaked at "
            f"{cal.worst.peak_bytes / 2**30:.2f} GiB: within {1 - cal.margin:.0%} of "
            f"{cal.memory_limit / 2**30:.1f} GiB"
        )
        if cal.fitted_budget is not None and cal.fitted_budget > cal.token_budget:
            lines.append(
                f"# the memory fit allows {cal.fitted_budget}: measure larger batches (--max-tokens) "
                "to use more"
            )
    else:
        lines.append(
            f"# token_budget: not even {BUDGET_QUANTUM} tokens fit the memory limit, or no peak was measured"
        )
    lines += ["", "[job.cost]", f'name = "{cal.cost.name}"']
    if cal.cost.name == "attention":
        lines.append(f"quadratic = {cal.cost.quadratic}")
    if cal.layout == "packed":
        lines += ["", "[job.policy]", 'collate = "packed"']
    return "\n".join(lines) + "\n"


def table(cal: Calibration) -> str:
    """The fit per layout, one line each."""
    rows = [("layout", "overhead ms", "us/token", "ns/pair", "q", "R^2", "max err", "GiB at budget")]
    for layout, f in cal.fits.items():
        t = f.time
        peak = (
            f.memory.predict((cal.token_budget, cal.token_budget**2)) / 2**30
            if f.memory and cal.token_budget
            else None
        )
        rows.append(
            (layout, f"{t.overhead * 1e3:.2f}", f"{t.linear * 1e6:.3f}", f"{t.quadratic * 1e9:.4f}",
             str(t.q() or "-"), f"{t.r2:.4f}", f"{t.max_rel_err:.1%}",
             f"{peak:.2f}" if peak is not None else "-")
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def svg(cal: Calibration) -> str:
    """Measured against predicted step time, one marker per batch, per layout (an SVG, no plotting
    library needed)."""
    size, pad = 360, 40
    points = [(cal.fits[m.layout].time.predict(m.terms), m.seconds, m.layout) for m in cal.measured]
    top = max(max(p, s) for p, s, _ in points) * 1.05
    xy = lambda v: pad + v / top * (size - 2 * pad)  # noqa: E731
    colors = {"padded": "#1f77b4", "packed": "#d62728"}
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{size}" height="{size}" '
        'font-family="sans-serif" font-size="11">',
        f'<line x1="{pad}" y1="{size - pad}" x2="{size - pad}" y2="{pad}" stroke="#999"/>',
        f'<text x="{size / 2}" y="{size - 8}" text-anchor="middle">predicted step (ms)</text>',
        f'<text x="12" y="{size / 2}" transform="rotate(-90 12 {size / 2})" '
        'text-anchor="middle">measured step (ms)</text>',
        f'<text x="{pad}" y="{pad - 20}">{cal.model[:60]}</text>',
    ]
    for i, (layout, color) in enumerate(colors.items()):
        if layout in cal.fits:
            out.append(f'<text x="{pad + 110 * i}" y="{pad - 6}" fill="{color}">{layout}</text>')
    for p, s, layout in points:
        out.append(f'<circle cx="{xy(p):.1f}" cy="{size - xy(s):.1f}" r="3" fill="{colors[layout]}"/>')
    out.append(f'<text x="{size - pad}" y="{size - pad + 14}" text-anchor="end">{top * 1e3:.0f}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_outputs(cal: Calibration, out: Path) -> list[Path]:
    """Writes calibration.toml, calibration.json and calibration.svg under `out` (created)."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "calibration.toml", out / "calibration.json", out / "calibration.svg"]
    files[0].write_text(fragment(cal))
    files[1].write_text(json.dumps(cal.to_json(), indent=1) + "\n")
    files[2].write_text(svg(cal))
    return files
