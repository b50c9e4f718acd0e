"""batchd's trainer library: the gRPC client iterator, collation to torch, the loss-scaled DDP step.

    from batchd.client import BatchClient, train_step
    for batch, info in BatchClient(address, rank, world_size):
        train_step(ddp_model, optimizer, batch, info)

Two-phase (vision-balanced) MLLM steps: `exchange_image_embeddings` sends each rank's encoder output
to the images' owners and returns its own images in LLM order. Stock HF multimodal models (Qwen2-VL,
Qwen2.5-VL, LLaVA): `two_phase(model)` adapts one in place to every batchd step (one- and two-phase,
padded and packed), without forking it; a stock Qwen2-Audio (`AUDIO_FAMILIES`) likewise for the audio phase.

Pipeline parallelism: `pipeline_steps(client, m)` makes m consecutive steps one pipeline step, and
`microbatches(batch, info, m)` splits one step into m parts of balanced cost, the loss exact either way.
Model-parallel groups: `BatchClient(..., group_rank=, group_size=)`.

Trainer integrations: `BatchdTrainer` (transformers.Trainer; imported lazily), for PyTorch Lightning
`BatchdDataModule` / `batchd_lightning_loss` / `batchd_lightning_step` (imported lazily) and, for
Accelerate, `batchd_batches` / `batchd_loss` / `batchd_backward` / `batchd_accumulate`; FSDP2
(`fully_shard`) trains through `train_step` unchanged; DeepSpeed through `batchd_deepspeed_backward`
(then ``engine.step()``). Optimizer updates of several steps (``tokens_per_update``): `train_step`
accumulates and rescales at the update's end; `optimizer_updates` / `weighted_steps` read each update
ahead and weigh every step over it, for the integrations that cannot rescale a gradient afterwards.
Imports `batchd.core` and `batchd.proto` only; nothing from the daemon.
"""

import importlib
from typing import Any

from batchd.core import BatchdError, JobFailed

from ._accelerate import batchd_accumulate, batchd_backward, batchd_batches, batchd_loss
from ._client import BatchClient, ClientOptions
from ._collate import collate_packed, collate_padded, idle_batch, loss_tokens
from ._deepspeed import batchd_deepspeed_backward
from ._exchange import exchange_audio_embeddings, exchange_embeddings, exchange_image_embeddings
from ._microbatch import microbatches, pipeline_steps
from ._train import (
    accumulating,
    apply_update_scale,
    check_one_step_update,
    forward_logits,
    optimizer_updates,
    scale_gradients,
    scaled_loss,
    scaled_loss_and_mean,
    step_batch,
    token_loss_sum,
    train_step,
    weighted_steps,
)
from ._vlm import (
    AUDIO_FAMILIES,
    PACKED_ATTENTION,
    check_model_batch,
    check_packed_attention,
    two_phase,
)

# Hugging Face Trainer and Lightning integrations: imported on first use, so batchd.client works without
# transformers or Lightning.
_LAZY = {
    "BatchdStream": "._hf",
    "BatchdTrainer": "._hf",
    "BatchdDataModule": "._lightning",
    "batchd_lightning_step": "._lightning",
    "batchd_lightning_loss": "._lightning",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AUDIO_FAMILIES",
    "BatchClient",
    "BatchdDataModule",
    "BatchdError",
    "BatchdStream",
    "BatchdTrainer",
    "ClientOptions",
    "JobFailed",
    "PACKED_ATTENTION",
    "accumulating",
    "apply_update_scale",
    "batchd_accumulate",
    "batchd_backward",
    "batchd_batches",
    "batchd_deepspeed_backward",
    "batchd_lightning_loss",
    "batchd_lightning_step",
    "batchd_loss",
    "check_model_batch",
    "check_one_step_update",
    "check_packed_attention",
    "collate_packed",
    "collate_padded",
    "exchange_audio_embeddings",
    "exchange_embeddings",
    "exchange_image_embeddings",
    "forward_logits",
    "idle_batch",
    "loss_tokens",
    "microbatches",
    "optimizer_updates",
    "pipeline_steps",
    "scale_gradients",
    "scaled_loss",
    "scaled_loss_and_mean",
    "step_batch",
    "token_loss_sum",
    "train_step",
    "two_phase",
    "weighted_steps",
]
