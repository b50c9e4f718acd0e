"""batchd's trainer side: the gRPC client iterator, collation, the loss-scaled DDP step.

    from batchd.client import BatchClient, train_step
    for batch, info in BatchClient(address, rank, world_size):
        train_step(ddp_model, optimizer, batch, info)

Trainer integrations: `BatchdTrainer` (transformers.Trainer; imported lazily) and, for Accelerate,
`batchd_batches` / `batchd_loss` / `batchd_backward`.
"""

from ._accelerate import batchd_backward, batchd_batches, batchd_loss, hf_model_inputs
from ._client import BatchClient, BatchdError, JobFailed
from ._collate import IGNORE_INDEX, collate_packed, collate_padded, idle_batch, loss_tokens
from ._model import TinyCausalLM
from ._train import scaled_loss, token_loss_sum, train_step

# Hugging Face Trainer integration: imported on first use, so batchd.client works without transformers.
_LAZY = {"BatchdStream": "._hf", "BatchdTrainer": "._hf"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted([
    "IGNORE_INDEX", "BatchClient", "BatchdError", "JobFailed", "TinyCausalLM", "collate_packed", "collate_padded",
    "idle_batch", "loss_tokens", "scaled_loss", "token_loss_sum", "train_step",
    "BatchdStream", "BatchdTrainer", "batchd_backward", "batchd_batches", "batchd_loss", "hf_model_inputs",
])
