"""What batchd's tests and benchmarks need from `batchd.client` beyond its API (no stability promise).

`batchd.client` exports what the app or a trainer imports (`tools/surface.py --check` holds it to
that); these helpers of its collation, stock-model adapters and update weighting are public here only
so that no test imports a private module. `batchd.testing` gathers them (tests import them from there).
Imports torch, as `batchd.client` does.
"""

from ._accelerate import hf_model_inputs
from ._collate import IGNORE_INDEX, to_torch
from ._train import check_weighted
from ._vlm import is_two_phase

__all__ = [
    "IGNORE_INDEX",
    "check_weighted",
    "hf_model_inputs",
    "is_two_phase",
    "to_torch",
]
