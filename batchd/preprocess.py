"""batchd's preprocessing data plane (public API): records -> stages -> Ray actor pool -> per-rank sources.

    from batchd.preprocess import RaySource, make_demo_dataset, default_stages, resolve

    demo = make_demo_dataset("/tmp/demo", num_samples=512)
    with RaySource(demo.path, rank=0, world_size=2, seed=0, epoch=0, num_actors=2,
                   stages=default_stages(cutoff=1024), quarantine="/tmp/demo/quarantine.jsonl") as src:
        item = src.poll(1.0)              # (Sample, ObjectRef) | None | EXHAUSTED
        payload = resolve(item[1])        # {"input_ids", "labels", ["pixel_values", "image_grid_thw"]}

The implementation lives in private modules of `batchd.service` (`_records`, `_stages`, `_tokenizer`,
`_demo_data`, `_pipeline`); see their docstrings.
"""

from batchd.service._demo_data import DemoDataset, demo_records, make_demo_dataset
from batchd.service._pipeline import PreprocessPool, PreprocessWorker, RaySource, ensure_ray, resolve, resolve_many
from batchd.service._records import (
    EmptyDatasetError,
    Quarantine,
    Record,
    RecordDataset,
    Reject,
    SchemaError,
    iter_records,
    parse_record,
)
from batchd.service._sources import EXHAUSTED
from batchd.service._stages import (
    QWEN2VL_IMAGE,
    TEMPLATES,
    ChatTemplate,
    Example,
    LlavaVision,
    Preprocessor,
    Qwen2VLVision,
    RandomResizedCrop,
    SampleMeta,
    Stage,
    StageContext,
    SystemPrompt,
    Tokenize,
    Truncate,
    TurnSubsample,
    default_stages,
    resolve_stage,
    smart_resize,
)
from batchd.service._tokenizer import SPECIAL_TOKENS, TokenizerRef, demo_tokenizer, train_tokenizer

__all__ = sorted([
    "EXHAUSTED", "QWEN2VL_IMAGE", "SPECIAL_TOKENS", "TEMPLATES",
    "ChatTemplate", "DemoDataset", "EmptyDatasetError", "Example", "LlavaVision", "PreprocessPool", "PreprocessWorker", "Preprocessor",
    "Quarantine", "Qwen2VLVision", "RandomResizedCrop", "RaySource", "Record", "RecordDataset", "Reject",
    "SampleMeta", "SchemaError", "Stage", "StageContext", "SystemPrompt", "Tokenize", "TokenizerRef", "Truncate",
    "TurnSubsample", "default_stages", "demo_records", "demo_tokenizer", "ensure_ray", "iter_records",
    "make_demo_dataset", "parse_record", "resolve", "resolve_many", "resolve_stage", "smart_resize",
    "train_tokenizer",
])
