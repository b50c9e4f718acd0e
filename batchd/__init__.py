"""batchd: token-budget batching of LLM/MLLM fine-tuning samples as a distributed data service.

What a trainer needs is here, from one import::

    import batchd

    client = batchd.BatchClient("127.0.0.1:7100", rank=rank, world_size=world_size)
    for epoch in range(client.epoch, client.job_epochs()):
        client.set_epoch(epoch)
        for batch, info in client:                      # info: batchd.StepInfo
            batchd.train_step(ddp_model, optimizer, batch, info)

and so is what a job is made of: `JobSpec` (the job every party agrees on), `Config` / `load_config`
(the config file), `simulate` (the daemon's core over a list of lengths, no processes), and one error
hierarchy: `BatchdError` > `JobFailed`, `CoordinatorError`, `RankServiceError`; bad configs raise
`ConfigError` (a ValueError). The layers underneath (`batchd.core`, `batchd.proto`, `batchd.service`,
`batchd.client`) keep their own public modules; see docs/internals.md#layers.

Names resolve on first use, so `import batchd.service` (the daemon) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access: the trainer-side names need torch)
_EXPORTS = {
    "BatchClient": "batchd.client",
    "BatchdError": "batchd.core",
    "BatchdStream": "batchd.client",
    "BatchdTrainer": "batchd.client",
    "ClientOptions": "batchd.client",
    "Config": "batchd._config",
    "ConfigError": "batchd._config",
    "CoordinatorError": "batchd.core",
    "JobFailed": "batchd.core",
    "JobSpec": "batchd.core",
    "RankServiceError": "batchd.core",
    "StepInfo": "batchd.core",
    "TinyCausalLM": "batchd._model",
    "TinyMLLM": "batchd._mllm",
    "exchange_image_embeddings": "batchd.client",
    "step_batch": "batchd.client",
    "batchd_backward": "batchd.client",
    "batchd_batches": "batchd.client",
    "batchd_loss": "batchd.client",
    "collate_packed": "batchd.client",
    "collate_padded": "batchd.client",
    "forward_logits": "batchd.client",
    "idle_batch": "batchd.client",
    "load_config": "batchd._config",
    "loss_scale": "batchd.core",
    "loss_tokens": "batchd.client",
    "microbatches": "batchd.client",
    "pipeline_steps": "batchd.client",
    "read_lengths": "batchd._lengths",
    "read_workload": "batchd._lengths",
    "scaled_loss": "batchd.client",
    "simulate": "batchd.core",
    "token_loss_sum": "batchd.client",
    "train_step": "batchd.client",
    "two_phase": "batchd.client",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'batchd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
