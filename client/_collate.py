"""Collation for trainers: `batchd.core`'s numpy collation, returned as CPU torch tensors.

The layouts, label rules and vision keys are those of `batchd.core.collate_padded` /
`batchd.core.collate_packed` (see `core/_collate.py`); these wrappers only turn each array into a
torch tensor (sharing memory with it) so a batch goes straight into a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from batchd import core
from batchd.core import IGNORE_INDEX

Payload = Mapping[str, np.ndarray]

INFO_KEY = "batchd_info"
"""Key under which `batchd.client.BatchdTrainer`'s stream carries the StepInfo inside each batch dict."""

NON_MODEL_KEYS = frozenset({"labels", "sample_ids", "cu_seqlens", "max_seqlen", INFO_KEY})
"""Batch entries that are not model keyword arguments (the packed layout's boundaries are given to an
HF model by the restarting ``position_ids``)."""

__all__ = ["IGNORE_INDEX", "collate_packed", "collate_padded", "idle_batch", "loss_tokens", "to_torch"]


def to_torch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """Arrays of a collated batch as torch tensors (sharing memory); other values (ints) as they are."""
    return {
        k: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
        for k, v in batch.items()
    }


def collate_padded(samples: Sequence[Payload], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """`batchd.core.collate_padded` as torch tensors: int64 [B, T] ids, mask, labels, positions."""
    return to_torch(core.collate_padded(samples, pad_id))


def collate_packed(samples: Sequence[Payload]) -> dict[str, torch.Tensor | int]:
    """`batchd.core.collate_packed` as torch tensors: one [1, S] row, `cu_seqlens`, `max_seqlen`."""
    return to_torch(core.collate_packed(samples))


def idle_batch(pad_id: int = 0) -> dict[str, torch.Tensor]:
    """`batchd.core.idle_batch` as torch tensors: the 1-token, loss-free batch of an IDLE step."""
    return to_torch(core.idle_batch(pad_id))


def loss_tokens(labels_row: np.ndarray | torch.Tensor) -> int:
    """Tokens of one sample that enter the shifted causal-LM loss: count(labels[1:] != -100).

    Set ``Sample.loss_tokens`` to exactly this value: the loss scale is exact only then.
    """
    if isinstance(labels_row, torch.Tensor):
        if labels_row.ndim != 1:
            raise ValueError(f"labels_row must be 1-D (one sample), got shape={tuple(labels_row.shape)}")
        return int((labels_row[1:] != IGNORE_INDEX).sum().item())
    return core.loss_tokens(labels_row)
