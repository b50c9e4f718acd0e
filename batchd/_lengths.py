"""Length files: one positive integer length (a sample's realized tokens) per line; the id is the line."""

from __future__ import annotations

import os

from batchd.core import parse_lengths


def read_lengths(path: str | os.PathLike) -> list[int]:
    """The lengths in `path` (see `batchd.core.parse_lengths`); errors name the file and the line."""
    with open(path, encoding="utf-8") as f:
        return parse_lengths(f, str(path))
