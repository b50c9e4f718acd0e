"""The tiny models, tokenizers, processors and trainer helpers that batchd's tests and benchmarks build on.

Public so that tests and benchmarks import names, not private modules; not part of a trainer's API and
without its stability promise. Everything is local: the tiny Hugging Face tokenizers and processors are
built in memory (nothing is downloaded), the models have random weights.

Names resolve on first use (most need torch or transformers): `import batchd.testing` imports neither.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names for readers and type checkers; at run time `__getattr__` imports them
    from batchd._bench_trainer import VisionTimer, hf_pixels, step_lr, vision_module
    from batchd._bench_trainer import build_model as bench_model
    from batchd._bench_trainer import payload as bench_payload
    from batchd._mllm import PATCH_DIM, AudioEncoder, TinyMLLM, clip_tokens, image_patches
    from batchd._model import TinyCausalLM
    from batchd._trainer import _FailureWatch as FailureWatch
    from batchd._trainer import build_model, raise_job_failure
    from batchd._vlm_tiny import (
        LLAVA_TEMPLATE,
        QWEN2VL_TEMPLATE,
        TINY_VLM_FAMILIES,
        load_vlm,
        tiny_processor,
        tiny_tokenizer,
        tiny_vlm,
    )

# public name -> (module, name there)
_EXPORTS = {
    "AudioEncoder": ("batchd._mllm", "AudioEncoder"),
    "FailureWatch": ("batchd._trainer", "_FailureWatch"),
    "LLAVA_TEMPLATE": ("batchd._vlm_tiny", "LLAVA_TEMPLATE"),
    "PATCH_DIM": ("batchd._mllm", "PATCH_DIM"),
    "QWEN2VL_TEMPLATE": ("batchd._vlm_tiny", "QWEN2VL_TEMPLATE"),
    "TINY_VLM_FAMILIES": ("batchd._vlm_tiny", "TINY_VLM_FAMILIES"),
    "TinyCausalLM": ("batchd._model", "TinyCausalLM"),
    "TinyMLLM": ("batchd._mllm", "TinyMLLM"),
    "VisionTimer": ("batchd._bench_trainer", "VisionTimer"),
    "bench_model": ("batchd._bench_trainer", "build_model"),
    "bench_payload": ("batchd._bench_trainer", "payload"),
    "build_model": ("batchd._trainer", "build_model"),
    "clip_tokens": ("batchd._mllm", "clip_tokens"),
    "hf_pixels": ("batchd._bench_trainer", "hf_pixels"),
    "image_patches": ("batchd._mllm", "image_patches"),
    "load_vlm": ("batchd._vlm_tiny", "load_vlm"),
    "raise_job_failure": ("batchd._trainer", "raise_job_failure"),
    "step_lr": ("batchd._bench_trainer", "step_lr"),
    "tiny_processor": ("batchd._vlm_tiny", "tiny_processor"),
    "tiny_tokenizer": ("batchd._vlm_tiny", "tiny_tokenizer"),
    "tiny_vlm": ("batchd._vlm_tiny", "tiny_vlm"),
    "vision_module": ("batchd._bench_trainer", "vision_module"),
}

__all__ = [
    "AudioEncoder",
    "FailureWatch",
    "LLAVA_TEMPLATE",
    "PATCH_DIM",
    "QWEN2VL_TEMPLATE",
    "TINY_VLM_FAMILIES",
    "TinyCausalLM",
    "TinyMLLM",
    "VisionTimer",
    "bench_model",
    "bench_payload",
    "build_model",
    "clip_tokens",
    "demo_vocab_size",
    "hf_pixels",
    "image_patches",
    "load_vlm",
    "raise_job_failure",
    "step_lr",
    "tiny_processor",
    "tiny_tokenizer",
    "tiny_vlm",
    "vision_module",
]


def demo_vocab_size(tokenizer: str | os.PathLike[str]) -> int:
    """1 + the largest token id of a tokenizer.json or HF tokenizer directory: the vocabulary size
    `batchd demo` gives its model (`TokenizerRef.id_space`). Raises FileNotFoundError or ValueError
    naming `tokenizer` when it is missing or not a tokenizer."""
    from batchd.service.preprocess import TokenizerRef

    return TokenizerRef(tokenizer).id_space


def __getattr__(name: str) -> Any:
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'batchd.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(where[0]), where[1])
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
