"""batchd's preprocessing data plane: records -> stages -> Ray actor pool -> per-rank sources.

    from batchd.service.preprocess import RaySource, make_demo_dataset, default_stages, resolve

    demo = make_demo_dataset("/tmp/demo", num_samples=512)
    with RaySource(demo.path, rank=0, world_size=2, seed=0, epoch=0, num_actors=2,
                   stages=default_stages(cutoff=1024), quarantine="/tmp/demo/quarantine.jsonl") as src:
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
    Ray        `_ray` (connect, `resolve`), `_pool` (the actor pool), `_ray_source` (`RaySource`),
               `_ledger` (its record of pulled samples)
    sources    `_sources` (the `Source` protocol, synthetic and pushed sources); `_demo_data`
Imports only `batchd.core`: the rank service builds on it, never the other way.
"""

from ._audio import Qwen2Audio, decode_audios, log_mel, qwen2_audio_tokens, read_audio, resample
from ._augment import RandomResizedCrop, SystemPrompt, TurnSubsample
from ._chain import Preprocessor, SampleMeta, default_stages, finalize
from ._dataset import Block, EmptyDatasetError, RecordDataset, iter_records, parse_item
from ._demo_data import DEMO_WORDS, DemoDataset, demo_bad_ids, demo_record, demo_records, make_demo_dataset
from ._hf import HFProcessor
from ._jsonl_index import line_index, line_numbers, scan_lines
from ._ledger import Ledger
from ._parse import Record, parse_record
from ._pool import PreprocessPool, PreprocessWorker
from ._quarantine import BadRecordTally, Quarantine, Reject, TooManyBadRecords
from ._ray import (
    START_ATTEMPTS,
    RayLost,
    SharedRay,
    ensure_ray,
    job_key,
    job_ray_address,
    quiet_token_auth,
    ray_lost,
    resolve,
    resolve_many,
    running_ray_address,
    share_ray,
    start_local_ray,
)
from ._ray_source import DEFAULT_MAX_BAD_FRACTION, DEFAULT_MEMORY_BUDGET, RaySource
from ._reader import BlockReader
from ._schema import SchemaError
from ._sources import (
    EXHAUSTED,
    NO_REASONS,
    SOURCE_MEMBERS,
    SYNTHETIC_MELS,
    SYNTHETIC_PATCH_DIM,
    IngestRefused,
    IngestSource,
    Payload,
    Source,
    SyntheticSource,
    check_pushed,
    loss_tokens_of,
    missing_source_members,
    payload_nbytes,
    synthetic_audio_payload,
    synthetic_image_payload,
    synthetic_payload,
    synthetic_sample,
)
from ._stage import Example, Stage, StageContext, resolve_stage
from ._text import QWEN2VL_IMAGE, TEMPLATES, ChatTemplate, Tokenize, Truncate
from ._tokenizer import SPECIAL_TOKENS, TokenizerRef, demo_tokenizer, train_tokenizer
from ._vision import LlavaVision, Qwen2VLVision, decode_images, smart_resize

__all__ = [
    "BadRecordTally",
    "Block",
    "BlockReader",
    "ChatTemplate",
    "DEFAULT_MAX_BAD_FRACTION",
    "DEFAULT_MEMORY_BUDGET",
    "DEMO_WORDS",
    "DemoDataset",
    "EXHAUSTED",
    "EmptyDatasetError",
    "Example",
    "HFProcessor",
    "IngestRefused",
    "IngestSource",
    "Ledger",
    "LlavaVision",
    "NO_REASONS",
    "Payload",
    "PreprocessPool",
    "PreprocessWorker",
    "Preprocessor",
    "QWEN2VL_IMAGE",
    "Quarantine",
    "Qwen2Audio",
    "Qwen2VLVision",
    "RandomResizedCrop",
    "RayLost",
    "RaySource",
    "Record",
    "RecordDataset",
    "Reject",
    "SOURCE_MEMBERS",
    "SPECIAL_TOKENS",
    "START_ATTEMPTS",
    "SYNTHETIC_MELS",
    "SYNTHETIC_PATCH_DIM",
    "SampleMeta",
    "SchemaError",
    "SharedRay",
    "Source",
    "Stage",
    "StageContext",
    "SyntheticSource",
    "SystemPrompt",
    "TEMPLATES",
    "Tokenize",
    "TokenizerRef",
    "TooManyBadRecords",
    "Truncate",
    "TurnSubsample",
    "check_pushed",
    "decode_audios",
    "decode_images",
    "default_stages",
    "demo_bad_ids",
    "demo_record",
    "demo_records",
    "demo_tokenizer",
    "ensure_ray",
    "finalize",
    "iter_records",
    "job_key",
    "job_ray_address",
    "line_index",
    "line_numbers",
    "log_mel",
    "loss_tokens_of",
    "make_demo_dataset",
    "missing_source_members",
    "parse_item",
    "parse_record",
    "payload_nbytes",
    "quiet_token_auth",
    "qwen2_audio_tokens",
    "ray_lost",
    "read_audio",
    "resample",
    "resolve",
    "resolve_many",
    "resolve_stage",
    "running_ray_address",
    "scan_lines",
    "share_ray",
    "smart_resize",
    "start_local_ray",
    "synthetic_audio_payload",
    "synthetic_image_payload",
    "synthetic_payload",
    "synthetic_sample",
    "train_tokenizer",
]
