"""The one home of what batchd's tests and benchmarks need beyond its API: tiny models, tokenizers and
processors, trainer helpers, and each layer's internals that tests exercise on their own.

No stability promise: nothing here is part of a trainer's API, and names come and go with the tests
that use them. Public only so that tests and benchmarks import names, never private modules
(`tools/import_graph.py --check`). A layer's `__all__` keeps what another layer or a user imports
(`tools/surface.py --check`); what only tests use sits in that layer's own `testing` module
(`batchd.core.testing`, `batchd.service.preprocess.testing`, `batchd.client.testing`), and this module
gathers those whole, so a test imports every helper from here. Everything is local: the tiny Hugging
Face tokenizers and processors are built in memory (nothing is downloaded), the models have random
weights.

Names resolve on first use (most need torch or transformers): `import batchd.testing` imports neither.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names for readers and type checkers; at run time `__getattr__` imports them
    from batchd._mllm import PATCH_DIM, AudioEncoder, TinyMLLM, clip_tokens, image_patches
    from batchd._model import TinyCausalLM
    from batchd._train.bench import step_lr
    from batchd._train.bench_data import payload as bench_payload
    from batchd._train.failure import FailureWatch, raise_job_failure
    from batchd._train.models import VisionTimer, build_model, hf_pixels, vision_module
    from batchd._train.models import build_model as bench_model
    from batchd._train.strategy import all_reduce_released
    from batchd._vlm_tiny import (
        LLAVA_TEMPLATE,
        QWEN2VL_TEMPLATE,
        TINY_VLM_FAMILIES,
        load_vlm,
        tiny_processor,
        tiny_tokenizer,
        tiny_vlm,
    )
    from batchd.client.testing import (
        IGNORE_INDEX,
        check_weighted,
        hf_model_inputs,
        is_two_phase,
        to_torch,
    )
    from batchd.core.testing import (
        ACCEPT,
        LDM_GAIN,
        LEVEL_TOLERANCE,
        LOCAL_TOLERANCE,
        PARTNERS,
        POLICIES,
        REFUSED,
        SLACKS,
        WORKLOAD_HEADER,
        ClockedStateful,
        EncoderCost,
        Entry,
        Fit,
        UpdateWindows,
        batch_terms,
        best_fit_decreasing,
        chunk_split,
        deal_levels,
        final_rows,
        fixed_capacity,
        fixed_chunks,
        form_groups,
        ldm_place,
        level_choice,
        node_shares,
        odb_greedy,
        odb_split,
        outliers,
        phase_loads,
        plan_phase,
        plan_vision_round,
        share_out,
        single_phase,
        split_largest,
        step_fetches,
        synthetic_token_loss,
        target_min,
        target_odb,
        update_scale,
        vision_bound,
        vision_greedy,
        vision_images,
        vision_improve,
        vision_lpt,
        vision_place,
    )
    from batchd.service.preprocess.testing import (
        DEMO_WORDS,
        START_ATTEMPTS,
        TEMPLATES,
        EmptyDatasetError,
        Ledger,
        PreprocessPool,
        Record,
        check_pushed,
        decode_images,
        demo_bad_ids,
        demo_record,
        finalize,
        iter_records,
        line_index,
        line_numbers,
        log_mel,
        parse_record,
        payload_nbytes,
        ray_lost,
        read_audio,
        resample,
        scan_lines,
        smart_resize,
        synthetic_audio_payload,
        synthetic_image_payload,
    )

# Each layer's own `testing` module, gathered whole (tests/test_surface.py holds these lists, and
# `__all__` below, to those modules' `__all__`).
_GATHERED = {
    "batchd.core.testing": (
        "ACCEPT",
        "ClockedStateful",
        "EncoderCost",
        "Entry",
        "Fit",
        "LDM_GAIN",
        "LEVEL_TOLERANCE",
        "LOCAL_TOLERANCE",
        "PARTNERS",
        "POLICIES",
        "REFUSED",
        "SLACKS",
        "UpdateWindows",
        "WORKLOAD_HEADER",
        "batch_terms",
        "best_fit_decreasing",
        "chunk_split",
        "deal_levels",
        "final_rows",
        "fixed_capacity",
        "fixed_chunks",
        "form_groups",
        "ldm_place",
        "level_choice",
        "node_shares",
        "odb_greedy",
        "odb_split",
        "outliers",
        "phase_loads",
        "plan_phase",
        "plan_vision_round",
        "share_out",
        "single_phase",
        "split_largest",
        "step_fetches",
        "synthetic_token_loss",
        "target_min",
        "target_odb",
        "update_scale",
        "vision_bound",
        "vision_greedy",
        "vision_images",
        "vision_improve",
        "vision_lpt",
        "vision_place",
    ),
    "batchd.service.preprocess.testing": (
        "DEMO_WORDS",
        "EmptyDatasetError",
        "Ledger",
        "PreprocessPool",
        "Record",
        "START_ATTEMPTS",
        "TEMPLATES",
        "check_pushed",
        "decode_images",
        "demo_bad_ids",
        "demo_record",
        "finalize",
        "iter_records",
        "line_index",
        "line_numbers",
        "log_mel",
        "parse_record",
        "payload_nbytes",
        "ray_lost",
        "read_audio",
        "resample",
        "scan_lines",
        "smart_resize",
        "synthetic_audio_payload",
        "synthetic_image_payload",
    ),
    "batchd.client.testing": (
        "IGNORE_INDEX",
        "check_weighted",
        "hf_model_inputs",
        "is_two_phase",
        "to_torch",
    ),
}

# public name -> (module, name there)
_EXPORTS = {
    "AudioEncoder": ("batchd._mllm", "AudioEncoder"),
    "FailureWatch": ("batchd._train.failure", "FailureWatch"),
    "LLAVA_TEMPLATE": ("batchd._vlm_tiny", "LLAVA_TEMPLATE"),
    "PATCH_DIM": ("batchd._mllm", "PATCH_DIM"),
    "QWEN2VL_TEMPLATE": ("batchd._vlm_tiny", "QWEN2VL_TEMPLATE"),
    "TINY_VLM_FAMILIES": ("batchd._vlm_tiny", "TINY_VLM_FAMILIES"),
    "TinyCausalLM": ("batchd._model", "TinyCausalLM"),
    "TinyMLLM": ("batchd._mllm", "TinyMLLM"),
    "VisionTimer": ("batchd._train.models", "VisionTimer"),
    "all_reduce_released": ("batchd._train.strategy", "all_reduce_released"),
    "bench_model": ("batchd._train.models", "build_model"),
    "bench_payload": ("batchd._train.bench_data", "payload"),
    "build_model": ("batchd._train.models", "build_model"),
    "clip_tokens": ("batchd._mllm", "clip_tokens"),
    "hf_pixels": ("batchd._train.models", "hf_pixels"),
    "image_patches": ("batchd._mllm", "image_patches"),
    "load_vlm": ("batchd._vlm_tiny", "load_vlm"),
    "raise_job_failure": ("batchd._train.failure", "raise_job_failure"),
    "step_lr": ("batchd._train.bench", "step_lr"),
    "tiny_processor": ("batchd._vlm_tiny", "tiny_processor"),
    "tiny_tokenizer": ("batchd._vlm_tiny", "tiny_tokenizer"),
    "tiny_vlm": ("batchd._vlm_tiny", "tiny_vlm"),
    "vision_module": ("batchd._train.models", "vision_module"),
}

_EXPORTS.update({name: (module, name) for module, names in _GATHERED.items() for name in names})

__all__ = [
    "ACCEPT",
    "AudioEncoder",
    "ClockedStateful",
    "DEMO_WORDS",
    "EmptyDatasetError",
    "EncoderCost",
    "Entry",
    "FailureWatch",
    "Fit",
    "IGNORE_INDEX",
    "LDM_GAIN",
    "LEVEL_TOLERANCE",
    "LLAVA_TEMPLATE",
    "LOCAL_TOLERANCE",
    "Ledger",
    "PARTNERS",
    "PATCH_DIM",
    "POLICIES",
    "PreprocessPool",
    "QWEN2VL_TEMPLATE",
    "REFUSED",
    "Record",
    "SLACKS",
    "START_ATTEMPTS",
    "TEMPLATES",
    "TINY_VLM_FAMILIES",
    "TinyCausalLM",
    "TinyMLLM",
    "UpdateWindows",
    "VisionTimer",
    "WORKLOAD_HEADER",
    "all_reduce_released",
    "batch_terms",
    "bench_model",
    "bench_payload",
    "best_fit_decreasing",
    "build_model",
    "check_pushed",
    "check_weighted",
    "chunk_split",
    "clip_tokens",
    "deal_levels",
    "decode_images",
    "demo_bad_ids",
    "demo_record",
    "demo_vocab_size",
    "final_rows",
    "finalize",
    "fixed_capacity",
    "fixed_chunks",
    "form_groups",
    "hf_model_inputs",
    "hf_pixels",
    "image_patches",
    "is_two_phase",
    "iter_records",
    "ldm_place",
    "level_choice",
    "line_index",
    "line_numbers",
    "load_vlm",
    "log_mel",
    "node_shares",
    "odb_greedy",
    "odb_split",
    "outliers",
    "parse_record",
    "payload_nbytes",
    "phase_loads",
    "plan_phase",
    "plan_vision_round",
    "raise_job_failure",
    "ray_lost",
    "read_audio",
    "resample",
    "scan_lines",
    "share_out",
    "single_phase",
    "smart_resize",
    "split_largest",
    "step_fetches",
    "step_lr",
    "synthetic_audio_payload",
    "synthetic_image_payload",
    "synthetic_token_loss",
    "target_min",
    "target_odb",
    "tiny_processor",
    "tiny_tokenizer",
    "tiny_vlm",
    "to_torch",
    "update_scale",
    "vision_bound",
    "vision_greedy",
    "vision_images",
    "vision_improve",
    "vision_lpt",
    "vision_module",
    "vision_place",
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
