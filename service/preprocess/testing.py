"""What batchd's tests and benchmarks need from `batchd.service.preprocess` beyond its API (no
stability promise).

`batchd.service.preprocess` exports what the rest of the service, the app or a user imports
(`tools/surface.py --check` holds it to that); the records' and stages' inner steps, the demo data's
parts, the synthetic payloads and the Ray helpers here are public only so that no test imports a
private module. `batchd.testing` gathers them (tests import them from there). Imports no torch.
"""

from ._audio import log_mel, read_audio, resample
from ._chain import finalize
from ._dataset import EmptyDatasetError, iter_records
from ._demo_data import DEMO_WORDS, demo_bad_ids, demo_record
from ._jsonl_index import line_index, line_numbers, scan_lines
from ._ledger import Ledger
from ._parse import Record, parse_record
from ._pool import PreprocessPool
from ._ray import START_ATTEMPTS, ray_lost
from ._sources import check_pushed, payload_nbytes, synthetic_audio_payload, synthetic_image_payload
from ._text import TEMPLATES
from ._vision import decode_images, smart_resize

__all__ = [
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
]
