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
AUDIO_COLUMNS = ("audio_frames", "audio_tokens")  # optional: a workload with audio clips has 5 columns


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


def _pairs(cells: list[str], names: tuple[str, str], item: str, where: str) -> list[tuple[int, int]]:
    """Two space-separated list cells of equal length as (size, tokens) pairs."""
    sizes = _int_list(cells[0], names[0], where, 1)
    tokens = _int_list(cells[1], names[1], where, 1)
    if len(sizes) != len(tokens):
        raise ValueError(
            f"{where}: {names[0]} and {names[1]} must list one entry per {item}, got "
            f"{len(sizes)} and {len(tokens)}"
        )
    return list(zip(sizes, tokens, strict=True))


def format_workload(samples: Iterable[Sample]) -> str:
    """The multimodal workload CSV of `samples` in order (the inverse of `parse_workload`): the header, then
    per sample its text tokens (length - image and audio tokens), its images' patches and tokens, and (when
    any sample has audio) its clips' frames and tokens."""
    samples = list(samples)
    audio = any(s.audio for s in samples)
    lines = [",".join(WORKLOAD_HEADER + (AUDIO_COLUMNS if audio else ()))]
    for s in samples:
        cells = [str(s.length - sum(t for _, t in s.images) - sum(t for _, t in s.audio))]
        for items in (s.images, s.audio) if audio else (s.images,):
            cells += [" ".join(str(p) for p, _ in items), " ".join(str(t) for _, t in items)]
        lines.append(",".join(cells))
    return "\n".join(lines) + "\n"


def parse_workload(lines: Iterable[str], source: str = "<workload>") -> list[Sample]:
    """Parses a multimodal workload (CSV, docs/workloads.md) into `Sample`s with ids 0, 1, ... in order.

    The first line is the header `text_tokens,image_patches,image_tokens`, optionally followed by
    `,audio_frames,audio_tokens`; every other line is one sample: its text tokens (int >= 0), then its
    images' encoder patches (ints >= 1) and image tokens (ints >= 1) as space-separated lists of equal
    length (both empty: no image), then, with the audio columns, its audio clips' encoder frames and
    tokens alike. A sample's length is text_tokens + sum(image_tokens) + sum(audio_tokens) (>= 1);
    `modality_tokens` is (("text", t), ("vision", v)), plus ("audio", a) with the audio columns. Errors
    are ValueErrors naming `source` and the line (no I/O here: `batchd.read_workload(path)` opens it).
    """
    out: list[Sample] = []
    it = iter(lines)
    header = next(it, None)
    names = tuple(c.strip() for c in header.strip().split(",")) if header is not None else ()
    if names not in (WORKLOAD_HEADER, WORKLOAD_HEADER + AUDIO_COLUMNS):
        raise ValueError(
            f"{source}:1: the header must be {','.join(WORKLOAD_HEADER)!r} (then optionally "
            f"{','.join(AUDIO_COLUMNS)!r}), got {header!r}"
        )
    for lineno, line in enumerate(it, 2):
        where = f"{source}:{lineno}"
        text = line.strip()
        if not text:
            raise ValueError(f"{where}: empty line (ids are 0-based sample rows after the header)")
        cells = text.split(",")
        if len(cells) != len(names):
            raise ValueError(
                f"{where}: expected {len(names)} comma-separated columns {names}, got {len(cells)}"
            )
        try:
            text_tokens = int(cells[0])
        except ValueError:
            raise ValueError(f"{where}: text_tokens must be an integer, got {cells[0]!r}") from None
        if text_tokens < 0:
            raise ValueError(f"{where}: text_tokens must be >= 0, got {text_tokens}")
        images = _pairs(cells[1:3], WORKLOAD_HEADER[1:], "image", where)
        audio = _pairs(cells[3:5], AUDIO_COLUMNS, "audio clip", where) if len(names) == 5 else []
        vision, heard = sum(t for _, t in images), sum(t for _, t in audio)
        if text_tokens + vision + heard < 1:
            raise ValueError(f"{where}: a sample needs at least one token, got text_tokens=0 and no image")
        mods = (("text", text_tokens), ("vision", vision)) + ((("audio", heard),) if len(names) == 5 else ())
        out.append(
            Sample(len(out), text_tokens + vision + heard, -1, 0, mods, 0, tuple(images), tuple(audio))
        )
    return out
