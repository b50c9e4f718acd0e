"""batchd's preprocessing data plane: records -> stages -> Ray actor pool -> per-rank sources.

    from batchd.service.preprocess import (
        PoolOptions, RaySource, StreamOptions, default_stages, make_demo_dataset, resolve,
    )

    demo = make_demo_dataset("/tmp/demo", num_samples=512)
    pool = PoolOptions(stages=default_stages(cutoff=1024), num_actors=2)
    options = StreamOptions(quarantine="/tmp/demo/quarantine.jsonl")
    with RaySource(demo.path, rank=0, world_size=2, seed=0, epoch=0, pool=pool, options=options) as src:
        item = src.poll(1.0)              # (Sample, ObjectRef) | None | EXHAUSTED
        payload = resolve(item[1])        # {"input_ids", "labels", ["pixel_values", "image_grid_thw"]}

Private modules, one concern each (`_chain` is the one that imports every stage):
    records    `_files` (paths, URIs, formats), `_schema` (`SchemaError`), `_quarantine` (`Reject`,
               `Quarantine`, `TooManyBadRecords`, `BadRecordTally`), `_parse` (one record), `_jsonl_index`
               (JSONL byte offsets, cached), `_dataset` (`RecordDataset`: metadata and blocks), `_reader`
               (`BlockReader`: a rank's blocks, read ahead within a budget)
    stages     `_tokenizer`, `_stage` (the stage contract), `_augment`, `_text` (template, tokenize,
               truncate), `_vision` (images, visual tokens), `_audio` (clips: decoding, log-mel
               features, audio tokens), `_hf` (`HFProcessor`: a model's own HF
               processor), `_chain` (`default_stages`, `Preprocessor`)
    Ray        `_ray` (connect, `resolve`), `_ray_procs` (a Ray's processes on this host, its leftovers),
               `_pool` (the actor pool), `_ray_source` (`RaySource`), `_ray_options` (its `PoolOptions`,
               `StreamOptions`), `_ledger` (its record of pulled
               samples)
    sources    `_sources` (the `Source` protocol, synthetic and pushed sources); `_demo_data`
Imports only `batchd.core`: the rank service builds on it, never the other way.
"""

from ._audio import Qwen2Audio, qwen2_audio_tokens
from ._augment import Augmentation, RandomResizedCrop, SystemPrompt, TurnSubsample
from ._chain import Preprocessor, default_stages
from ._dataset import RecordDataset
from ._demo_data import demo_records, make_demo_dataset
from ._hf import HFProcessor
from ._quarantine import BadRecordTally, Quarantine, Reject, TooManyBadRecords
from ._ray import (
    RayLost,
    SharedRay,
    ensure_ray,
    job_key,
    quiet_token_auth,
    resolve,
    resolve_many,
    share_ray,
    start_local_ray,
)
from ._ray_options import PoolOptions, StreamOptions
from ._ray_source import RaySource
from ._reader import BlockReader
from ._schema import SchemaError
from ._sources import (
    EXHAUSTED,
    SYNTHETIC_MELS,
    SYNTHETIC_PATCH_DIM,
    IngestRefused,
    IngestSource,
    Payload,
    Source,
    SyntheticData,
    SyntheticSource,
    loss_tokens_of,
    missing_source_members,
    synthetic_payload,
    synthetic_sample,
)
from ._stage import Example, Stage, StageContext
from ._text import ChatTemplate, Tokenize, Truncate
from ._tokenizer import SPECIAL_TOKENS, TokenizerRef, demo_tokenizer, train_tokenizer
from ._vision import LlavaVision, Qwen2VLImageConfig, Qwen2VLVision

__all__ = [
    "Augmentation",
    "BadRecordTally",
    "BlockReader",
    "ChatTemplate",
    "EXHAUSTED",
    "Example",
    "HFProcessor",
    "IngestRefused",
    "IngestSource",
    "LlavaVision",
    "Payload",
    "PoolOptions",
    "Preprocessor",
    "Quarantine",
    "Qwen2Audio",
    "Qwen2VLImageConfig",
    "Qwen2VLVision",
    "RandomResizedCrop",
    "RayLost",
    "RaySource",
    "RecordDataset",
    "Reject",
    "SPECIAL_TOKENS",
    "SYNTHETIC_MELS",
    "SYNTHETIC_PATCH_DIM",
    "SchemaError",
    "SharedRay",
    "Source",
    "Stage",
    "StageContext",
    "StreamOptions",
    "SyntheticData",
    "SyntheticSource",
    "SystemPrompt",
    "Tokenize",
    "TokenizerRef",
    "TooManyBadRecords",
    "Truncate",
    "TurnSubsample",
    "default_stages",
    "demo_records",
    "demo_tokenizer",
    "ensure_ray",
    "job_key",
    "loss_tokens_of",
    "make_demo_dataset",
    "missing_source_members",
    "quiet_token_auth",
    "qwen2_audio_tokens",
    "resolve",
    "resolve_many",
    "share_ray",
    "start_local_ray",
    "synthetic_payload",
    "synthetic_sample",
    "train_tokenizer",
]
