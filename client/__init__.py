"""batchd's trainer side: the gRPC client iterator, collation, the loss-scaled DDP step.

    from batchd.client import BatchClient, train_step
    for batch, info in BatchClient(address, rank, world_size):
        train_step(ddp_model, optimizer, batch, info)
"""

from ._client import BatchClient, BatchdError, JobFailed
from ._collate import IGNORE_INDEX, collate_packed, collate_padded, idle_batch, loss_tokens
from ._model import TinyCausalLM
from ._train import scaled_loss, token_loss_sum, train_step

__all__ = sorted([
    "IGNORE_INDEX", "BatchClient", "BatchdError", "JobFailed", "TinyCausalLM", "collate_packed", "collate_padded",
    "idle_batch", "loss_tokens", "scaled_loss", "token_loss_sum", "train_step",
])
