"""What the adapters of stock HF models (`_vlm`, `_audio_lm`) share: tensors from a batch, and which calls
they take from the stock forward.

An adapted model's ``__call__`` takes a batchd batch (``model(batch)``) or the model's own keyword
arguments; a call it cannot serve as a batchd step (positional tensors, a cache, generation, precomputed
embeddings or encoder inputs) goes to the stock forward unchanged, minus batchd's own keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ._collate import NON_MODEL_KEYS


def as_tensor(value: Any, name: str, device: torch.device) -> torch.Tensor:
    """`value` (a tensor or an array) as a tensor on `device`; ValueError naming `name` otherwise."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    try:
        return torch.as_tensor(value, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be a tensor or an array, got {type(value).__name__}") from None


def batchd_kwargs(
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    generation: Iterable[str],
    batchd_keys: Iterable[str],
) -> tuple[dict[str, Any] | None, Any]:
    """(the keyword arguments of a batchd step, None), or (None, the stock `forward`'s output) for a call
    the adapter does not take (module docstring). A batch mapping passed alone loses `NON_MODEL_KEYS` and
    runs without a cache."""
    if args:
        if len(args) != 1 or not isinstance(args[0], Mapping) or kwargs:
            return None, forward(*args, **kwargs)
        kwargs = {k: v for k, v in args[0].items() if k not in NON_MODEL_KEYS}
        kwargs["use_cache"] = False
    if (
        kwargs.get("use_cache")
        or kwargs.get("input_ids") is None
        or any(kwargs.get(k) is not None for k in generation)
    ):
        drop = set(batchd_keys)
        return None, forward(**{k: v for k, v in kwargs.items() if k not in drop})
    return kwargs, None
