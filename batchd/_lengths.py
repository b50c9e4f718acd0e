"""Workload files: one positive integer length (a sample's realized tokens) per line, or a multimodal CSV
(`.csv`: `text_tokens,image_patches,image_tokens`, docs/workloads.md); the id is the sample's row."""

from __future__ import annotations

import os

from batchd.core import Sample, parse_lengths, parse_workload


def read_lengths(path: str | os.PathLike) -> list[int]:
    """The lengths in `path` (see `batchd.core.parse_lengths`); errors name the file and the line."""
    with open(path, encoding="utf-8") as f:
        return parse_lengths(f, str(path))


def read_workload(path: str | os.PathLike) -> list[int] | list[Sample]:
    """A workload file by extension: `.csv` -> `Sample`s with images (`batchd.core.parse_workload`), anything
    else -> lengths (`read_lengths`). Both feed `batchd.core.simulate`; errors name the file and the line."""
    if os.fspath(path).lower().endswith(".csv"):
        with open(path, encoding="utf-8") as f:
            return parse_workload(f, str(path))
    return read_lengths(path)
