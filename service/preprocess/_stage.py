"""The stage contract: the `Example` a chain edits, its `StageContext`, the `Stage` base, `resolve_stage`.

A stage is a small object called as ``stage(example, ctx)``; it reads and writes fields of the
`Example` and returns it (or None after editing it in place). It raises `Reject(code, detail)` to
quarantine the record. Randomness comes only from ``ctx.rng``, a generator seeded by
(seed, epoch, sample id, stage index): rerunning a sample in the same epoch is bit-identical, on any
actor, after any restart, in any order, and the next epoch draws fresh augmentations.

Plug in a stage of your own without forking: pass an instance, a class (built with no arguments), a
function `f(example)` or `f(example, ctx)`, or a "package.module:attr" string (imported where the
chain runs, i.e. in each Ray actor) anywhere in the `stages` list; `resolve_stage` makes each one a
callable stage.

This module knows no concrete stage: the built-in ones (`_augment`, `_text`, `_vision`) build on it,
and `_chain` puts them together.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ._tokenizer import TokenizerRef

IGNORE_INDEX = -100


@dataclasses.dataclass
class Example:
    """One sample on its way through the stages (fields are filled in chain order)."""

    id: int
    epoch: int
    source: str
    messages: list[dict[str, str]]
    system: str | None = None
    images: list[Any] = dataclasses.field(default_factory=list)  # PIL images (RGB)
    text: str | None = None
    assistant_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    input_ids: np.ndarray | None = None
    labels: np.ndarray | None = None
    image_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # token spans per image
    image_tokens: list[int] = dataclasses.field(default_factory=list)  # expanded tokens per image
    image_tensors: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    audios: list[np.ndarray] = dataclasses.field(default_factory=list)  # mono float32 clips at 16 kHz
    audio_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # token spans per clip
    audio_tokens: list[int] = dataclasses.field(default_factory=list)  # expanded tokens per clip
    audio_tensors: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    extra: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def expand_placeholders(
    ex: Example, positions: np.ndarray, tokens: list[int], start: int | None = None, end: int | None = None
) -> list[tuple[int, int]]:
    """Expands the placeholder token at each of `positions` (in `ex.input_ids`) into `tokens[k]` copies,
    labels -100 there, and writes `ex.input_ids` / `ex.labels` (int32). Returns each item's token span in
    the new sequence, widened by one where the token before it is `start` or the one after it is `end` (a
    template's vision start / end or audio bos / eos marker), so that `Truncate` drops items whole."""
    assert ex.input_ids is not None and ex.labels is not None
    counts = np.ones(len(ex.input_ids), dtype=np.int64)
    counts[positions] = tokens
    labels = np.repeat(ex.labels, counts)
    starts = np.cumsum(counts) - counts  # new position of each old token
    spans = []
    for pos, n in zip(positions, tokens, strict=True):
        lo = 1 if start is not None and pos > 0 and ex.input_ids[pos - 1] == start else 0
        hi = 1 if end is not None and pos + 1 < len(ex.input_ids) and ex.input_ids[pos + 1] == end else 0
        s = int(starts[pos])
        labels[s : s + n] = IGNORE_INDEX
        spans.append((s - lo, s + n + hi))
    ex.input_ids = np.repeat(ex.input_ids, counts).astype(np.int32)
    ex.labels = labels.astype(np.int32)
    return spans


class StageContext:
    """What a stage knows besides the example: ids and a generator seeded per (seed, epoch, id, stage)."""

    __slots__ = ("_rng", "epoch", "sample_id", "seed", "stage_index")

    def __init__(self, sample_id: int, epoch: int, seed: int, stage_index: int) -> None:
        self.sample_id, self.epoch, self.seed, self.stage_index = sample_id, epoch, seed, stage_index
        self._rng: np.random.Generator | None = None

    @property
    def rng(self) -> np.random.Generator:
        if self._rng is None:
            self._rng = np.random.default_rng([self.seed, self.epoch, self.sample_id, self.stage_index])
        return self._rng


class Stage:
    """Base class of the built-in stages (subclassing it is optional for plug-ins)."""

    def __call__(self, ex: Example, ctx: StageContext) -> Example | None:
        raise NotImplementedError

    def setup(self) -> None:
        """Loads what the stage needs (imports, tokenizers) ahead of the first sample; optional."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


def _as_ref(tokenizer: str | os.PathLike[str] | TokenizerRef | None) -> TokenizerRef:
    return tokenizer if isinstance(tokenizer, TokenizerRef) else TokenizerRef(tokenizer)


class _FunctionStage(Stage):
    def __init__(self, fn: Callable[..., Example | None], wants_ctx: bool) -> None:
        self.fn, self.wants_ctx = fn, wants_ctx

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))

    def __call__(self, ex: Example, ctx: StageContext) -> Example | None:
        out: Example | None = self.fn(ex, ctx) if self.wants_ctx else self.fn(ex)
        return out


def _import_attr(spec: str) -> Any:
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"a stage given as a string must be 'package.module:attr', got {spec!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_stage(spec: Any) -> Stage | Callable[..., Example | None]:
    """A callable stage from an instance, a class (built without arguments), a function or 'module:attr'."""
    if isinstance(spec, str):
        spec = _import_attr(spec)
    if isinstance(spec, type):
        spec = spec()
    if isinstance(spec, Stage):
        return spec
    if not callable(spec):
        raise TypeError(f"a stage must be callable as stage(example, ctx), got {spec!r}")
    target = spec if inspect.isfunction(spec) or inspect.ismethod(spec) else spec.__call__
    try:
        params = [
            p
            for p in inspect.signature(target).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        wants_ctx = len(params) >= 2 or any(
            p.kind == p.VAR_POSITIONAL for p in inspect.signature(target).parameters.values()
        )
    except (TypeError, ValueError):
        wants_ctx = True
    return _FunctionStage(spec, wants_ctx)
