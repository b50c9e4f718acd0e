"""Workload files as text: one length per line, or the multimodal workload CSV (docs/workloads.md).

Pure parsing and formatting, no I/O (`batchd.read_lengths` / `batchd.read_workload` open the files);
errors are ValueErrors naming the source and the line. O(size of the text).
"""

from __future__ import annotations

from collections.abc import Iterable

from ._types import Sample


def parse_lengths(lines: Iterable[str], source: str = "<lengths>") -> list[int]:
    """Parses one positive integer length per line; errors name `source` and the line (no I/O here:
    `batchd.read_lengths(path)` opens the file)."""
    out = []
    for lineno, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            raise ValueError(f"{source}:{lineno}: empty line (ids are 0-based line numbers)")
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"{source}:{lineno}: not an integer length: {text!r}") from None
        if n < 1:
            raise ValueError(f"{source}:{lineno}: length must be >= 1, got {n}")
        out.append(n)
    return out


WORKLOAD_HEADER = ("text_tokens", "image_patches", "image_tokens")


def _int_list(text: str, what: str, where: str, lo: int) -> list[int]:
    out = []
    for word in text.split():
        try:
            v = int(word)
        except ValueError:
            raise ValueError(f"{where}: {what} must be space-separated integers, got {word!r}") from None
        if v < lo:
            raise ValueError(f"{where}: every {what} entry must be >= {lo}, got {v}")
        out.append(v)
    return out


def format_workload(samples: Iterable[Sample]) -> str:
    """The multimodal workload CSV of `samples` in order (the inverse of `parse_workload`): the header, then
    per sample its text tokens (length - image tokens) and its images' patches and tokens."""
    lines = [",".join(WORKLOAD_HEADER)]
    for s in samples:
        patches, tokens = " ".join(str(p) for p, _ in s.images), " ".join(str(t) for _, t in s.images)
        lines.append(f"{s.length - sum(t for _, t in s.images)},{patches},{tokens}")
    return "\n".join(lines) + "\n"


def parse_workload(lines: Iterable[str], source: str = "<workload>") -> list[Sample]:
    """Parses a multimodal workload (CSV, docs/workloads.md) into `Sample`s with ids 0, 1, ... in order.

    The first line is the header `text_tokens,image_patches,image_tokens`; every other line is one
    sample: its text tokens (int >= 0), then its images' encoder patches (ints >= 1) and image tokens
    (ints >= 1) as space-separated lists of equal length (both empty: text-only). A sample's length is
    text_tokens + sum(image_tokens) (>= 1); `modality_tokens` is (("text", t), ("vision", v)). Errors
    are ValueErrors naming `source` and the line (no I/O here: `batchd.read_workload(path)` opens it).
    """
    out: list[Sample] = []
    it = iter(lines)
    header = next(it, None)
    if header is None or tuple(c.strip() for c in header.strip().split(",")) != WORKLOAD_HEADER:
        raise ValueError(f"{source}:1: the header must be {','.join(WORKLOAD_HEADER)!r}, got {header!r}")
    for lineno, line in enumerate(it, 2):
        where = f"{source}:{lineno}"
        text = line.strip()
        if not text:
            raise ValueError(f"{where}: empty line (ids are 0-based sample rows after the header)")
        cells = text.split(",")
        if len(cells) != 3:
            raise ValueError(
                f"{where}: expected 3 comma-separated columns {WORKLOAD_HEADER}, got {len(cells)}"
            )
        try:
            text_tokens = int(cells[0])
        except ValueError:
            raise ValueError(f"{where}: text_tokens must be an integer, got {cells[0]!r}") from None
        if text_tokens < 0:
            raise ValueError(f"{where}: text_tokens must be >= 0, got {text_tokens}")
        patches = _int_list(cells[1], "image_patches", where, 1)
        tokens = _int_list(cells[2], "image_tokens", where, 1)
        if len(patches) != len(tokens):
            raise ValueError(
                f"{where}: image_patches and image_tokens must list one entry per image, got "
                f"{len(patches)} and {len(tokens)}"
            )
        vision = sum(tokens)
        if text_tokens + vision < 1:
            raise ValueError(f"{where}: a sample needs at least one token, got text_tokens=0 and no image")
        out.append(
            Sample(
                len(out),
                text_tokens + vision,
                -1,
                0,
                (("text", text_tokens), ("vision", vision)),
                0,
                tuple(zip(patches, tokens, strict=False)),
            )
        )
    return out
