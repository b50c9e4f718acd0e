"""The data side of stream_scale.py: the generated datasets, their block layout, one reader's
throughput and the shuffle quality of `BlockView` (parts 1, 4 and 6 of that script; pure: no Ray, no
processes).

`make_image_dataset` / `make_text_dataset` write (or reuse, same parameters) Parquet datasets with ~1%
known bad records; `layout` describes their blocks; `read_pass` times one reader thread (cold or warm
page cache); `shuffle_quality` compares `BlockView`'s order with a global permutation. Every function
is deterministic given its seed, except the timings.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from batchd.core import BlockLayout, BlockView, epoch_permutation

DATA_DIR = Path("/tmp/batchd-stream-bench")
SEED = 0
BAD_FRACTION = 0.01
BAD_KINDS = ("empty_conversation", "bad_image", "no_assistant", "image_mismatch", "missing_field")
IMAGE_SIDES = (480, 544)  # noise images: each side uniform in this range (mean 512)
AVG_IMAGE_BYTES = 512 * (3 * 512 + 1) + 100
ROW_GROUP_BYTES = 64 << 20
FILE_BYTES = 1 << 30
TEXT_RECORDS = 200_000
TEXT_ROW_GROUP_ROWS = 1024
K_CONSECUTIVE = 64
SHUFFLE_SEEDS = (0, 1, 2)
JOB = {"token_budget": 4096, "window": 128, "depth": 4, "seed": SEED}
MAX_PIXELS = 448 * 448  # 200704: 256 visual tokens for a 512 px image
MIN_PIXELS = 56 * 56
KILL_AT = 0.5  # the resume run kills the service once this share of good samples arrived
RUN_LIMIT_S = 1500.0


def _words() -> list[str]:
    from batchd.testing import DEMO_WORDS  # the demo tokenizer was trained on these

    return list(DEMO_WORDS)


# -- 1. data ----------------------------------------------------------------------------------------
def png_noise(rng: np.random.Generator, height: int, width: int) -> bytes:
    """A valid RGB PNG of random noise: filter 0 rows, stored (level 0) deflate. Incompressible, and ~20x
    faster to make than PIL's encoder, which spends its time failing to compress noise."""
    raw = np.frombuffer(rng.bytes(height * (3 * width + 1)), np.uint8).reshape(height, 3 * width + 1).copy()
    raw[:, 0] = 0
    data = zlib.compress(raw.tobytes(), 0)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", data)
        + chunk(b"IEND", b"")
    )


def _text(rng: np.random.Generator, words: list[str], median: float, sigma: float, cap: int) -> str:
    n = int(min(max(round(rng.lognormal(math.log(median), sigma)), 1), cap))
    ranks = np.minimum(rng.zipf(1.3, n) - 1, len(words) - 1)
    return " ".join(words[int(r)] for r in ranks)


def image_record(rng: np.random.Generator, words: list[str], bad: str | None = None) -> dict[str, Any]:
    """One conversation with one noise PNG; `bad`: one of BAD_KINDS (the record must be quarantined)."""
    h, w = (int(v) for v in rng.integers(IMAGE_SIDES[0], IMAGE_SIDES[1] + 1, size=2))
    image = png_noise(rng, h, w)
    question = "<image>" + "What do you see in this picture? " + _text(rng, words, 12, 0.6, 60) + "?"
    answer = _text(rng, words, 40, 0.9, 600) + "."
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
    ]
    if bad == "empty_conversation":
        messages = []
    elif bad == "bad_image":
        image = image[: len(image) // 2]  # a truncated PNG: the header parses, the pixel data does not
    elif bad == "no_assistant":
        messages = messages[:1]
    elif bad == "image_mismatch":
        messages[0]["content"] = "<image>" + question
    elif bad == "missing_field":
        messages[1]["content"] = None
    return {"messages": messages, "images": [image]}


def text_record(rng: np.random.Generator, words: list[str]) -> dict[str, Any]:
    messages = []
    for _ in range(int(rng.integers(1, 4))):
        messages.append({"role": "user", "content": _text(rng, words, 14, 0.8, 200) + "?"})
        messages.append({"role": "assistant", "content": _text(rng, words, 60, 1.0, 1500) + "."})
    return {"messages": messages}


@dataclasses.dataclass
class Generated:
    """A generated dataset on disk: its directory, files, records, bad ids with their kind, bytes on disk."""

    path: Path
    files: list[str]
    records: int
    bad: dict[int, str]
    disk_bytes: int
    seconds: float
    cached: bool

    @property
    def good(self) -> list[int]:
        return [i for i in range(self.records) if i not in self.bad]


def _manifest(out: Path) -> Path:
    """Beside the dataset's directory, not in it: a directory's *.json files are read as JSONL records."""
    return out.with_name(out.name + ".manifest.json")


def _cached(out: Path, params: dict[str, Any]) -> Generated | None:
    manifest = _manifest(out)
    if not manifest.exists():
        return None
    m = json.loads(manifest.read_text())
    files = [out / name for name, _ in m["files"]]
    if m["params"] != params or any(
        not f.exists() or f.stat().st_size != size for f, (_, size) in zip(files, m["files"], strict=False)
    ):
        return None
    return Generated(
        out,
        [str(f) for f in files],
        m["records"],
        {int(k): v for k, v in m["bad"].items()},
        sum(size for _, size in m["files"]),
        m["seconds"],
        True,
    )


def _write_manifest(
    out: Path, params: dict[str, Any], files: list[Path], records: int, bad: dict[int, str], seconds: float
) -> Generated:
    sizes = [[f.name, f.stat().st_size] for f in files]
    tmp = _manifest(out).with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "params": params,
                "files": sizes,
                "records": records,
                "bad": {str(k): v for k, v in bad.items()},
                "seconds": seconds,
            }
        )
    )
    os.replace(tmp, _manifest(out))
    return Generated(out, [str(f) for f in files], records, bad, sum(s for _, s in sizes), seconds, False)


def _clear(out: Path) -> None:
    _manifest(out).unlink(missing_ok=True)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)


def _schema(images: bool):
    import pyarrow as pa

    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    fields = [("messages", messages)] + ([("images", pa.list_(pa.binary()))] if images else [])
    return pa.schema(fields)


def _write_files(out: Path, schema, batches, rows_per_group: int, groups_per_file: int) -> list[Path]:
    """Writes row groups of `rows_per_group` records (from the `batches` iterator of record lists), at most
    `groups_per_file` per file, as part-NNN.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files: list[Path] = []
    writer = None
    groups = 0
    try:
        for rows in batches:
            if writer is None or groups == groups_per_file:
                if writer is not None:
                    writer.close()
                files.append(out / f"part-{len(files):03d}.parquet")
                writer = pq.ParquetWriter(
                    files[-1], schema, compression="snappy", use_dictionary=False, write_statistics=False
                )
                groups = 0
            table = pa.Table.from_pylist(rows, schema=schema)
            writer.write_table(table, row_group_size=max(len(rows), 1))
            groups += 1
    finally:
        if writer is not None:
            writer.close()
    return files


def make_image_dataset(
    root: Path,
    data_bytes: int,
    row_group_bytes: int,
    seed: int = SEED,
    file_bytes: int = FILE_BYTES,
    say=print,
) -> Generated:
    """At least `data_bytes` of image records (about AVG_IMAGE_BYTES each, ~1% bad) under
    root/images-..., reused when a previous call with the same parameters completed."""
    params = {
        "kind": "images",
        "data_bytes": data_bytes,
        "row_group_bytes": row_group_bytes,
        "seed": seed,
        "file_bytes": file_bytes,
        "bad_fraction": BAD_FRACTION,
        "sides": list(IMAGE_SIDES),
        "version": 1,
    }
    out = root / f"images-{data_bytes >> 20}MiB-rg{row_group_bytes >> 20}MiB-s{seed}"
    if (hit := _cached(out, params)) is not None:
        say(f"data: reusing {hit.records} image records in {out} ({hit.disk_bytes / 1e9:.2f} GB)")
        return hit
    _clear(out)
    n = math.ceil(data_bytes / AVG_IMAGE_BYTES) + 1  # the text (and the 1% bad records' halves) nets out
    rng = np.random.default_rng([seed, 1])
    nbad = max(len(BAD_KINDS), round(n * BAD_FRACTION))
    bad_ids = sorted(np.random.default_rng([seed, 2]).choice(n, size=nbad, replace=False).tolist())
    bad = {int(i): BAD_KINDS[j % len(BAD_KINDS)] for j, i in enumerate(bad_ids)}
    rows_per_group = max(1, row_group_bytes // AVG_IMAGE_BYTES)
    groups_per_file = max(1, file_bytes // row_group_bytes)
    words = _words()
    t0 = time.perf_counter()

    def batches():
        for start in range(0, n, rows_per_group):
            stop = min(n, start + rows_per_group)
            yield [image_record(rng, words, bad.get(i)) for i in range(start, stop)]
            if (start // rows_per_group) % 16 == 15:
                say(f"data: {stop}/{n} image records ({time.perf_counter() - t0:.0f} s)")

    files = _write_files(out, _schema(True), batches(), rows_per_group, groups_per_file)
    gen = _write_manifest(out, params, files, n, bad, time.perf_counter() - t0)
    say(
        f"data: wrote {n} image records ({len(bad)} bad) in {len(files)} files, "
        f"{gen.disk_bytes / 1e9:.2f} GB, {gen.seconds:.0f} s"
    )
    return gen


def make_text_dataset(root: Path, records: int, seed: int = SEED, say=print) -> Generated:
    params = {"kind": "text", "records": records, "rows": TEXT_ROW_GROUP_ROWS, "seed": seed, "version": 1}
    out = root / f"text-{records}-s{seed}"
    if (hit := _cached(out, params)) is not None:
        say(f"data: reusing {hit.records} text records in {out} ({hit.disk_bytes / 1e6:.0f} MB)")
        return hit
    _clear(out)
    rng = np.random.default_rng([seed, 3])
    words = _words()
    t0 = time.perf_counter()

    def batches():
        for start in range(0, records, TEXT_ROW_GROUP_ROWS):
            yield [text_record(rng, words) for _ in range(start, min(records, start + TEXT_ROW_GROUP_ROWS))]

    files = _write_files(out, _schema(False), batches(), TEXT_ROW_GROUP_ROWS, 1 << 30)
    gen = _write_manifest(out, params, files, records, {}, time.perf_counter() - t0)
    say(f"data: wrote {records} text records, {gen.disk_bytes / 1e6:.0f} MB, {gen.seconds:.0f} s")
    return gen


def layout(gen: Generated) -> dict[str, Any]:
    from batchd.service.preprocess import RecordDataset

    ds = RecordDataset(gen.path)
    rows, nbytes = np.asarray(ds.block_rows), np.asarray(ds.block_bytes)
    return {
        "records": len(ds),
        "files": len(ds.files),
        "blocks": len(ds.blocks),
        "rows_per_block": float(rows.mean()),
        "block_mb": float(nbytes.mean() / 2**20),
        "max_block_mb": float(nbytes.max() / 2**20),
        "arrow_bytes": int(nbytes.sum()),
        "disk_bytes": gen.disk_bytes,
        "bad": len(gen.bad),
        "gen_s": gen.seconds,
        "cached": gen.cached,
        "block_rows": rows,
        "block_bytes": nbytes,
    }


# -- 4. reading throughput --------------------------------------------------------------------------
def evict(files: Sequence[str]) -> None:
    """Drops these files' pages from the page cache (this process's files only; nothing system-wide)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_pass(gen: Generated, cold: bool) -> dict[str, Any]:
    """One reader thread through the whole dataset: read_block + items of every row, block by block."""
    from batchd.service.preprocess import RecordDataset

    if cold:
        evict(gen.files)
    t0 = time.perf_counter()
    ds = RecordDataset(gen.path)
    t_open = time.perf_counter() - t0
    records = nbytes = 0
    first = None
    for k, b in enumerate(ds.blocks):
        data = ds.read_block(k)
        items = ds.items(k, data, range(b.offset, b.offset + b.rows))
        records += len(items)
        nbytes += b.nbytes
        del data, items
        if first is None:
            first = time.perf_counter() - t0
    s = time.perf_counter() - t0
    return {
        "cache": "cold" if cold else "warm",
        "records": records,
        "seconds": s,
        "open_s": t_open,
        "first_block_s": first,
        "records_per_s": records / s,
        "arrow_mb_per_s": nbytes / s / 1e6,
        "disk_mb_per_s": gen.disk_bytes / s / 1e6,
        "arrow_bytes": nbytes,
    }


# -- 6. shuffle quality -----------------------------------------------------------------------------
def order_metrics(
    order: np.ndarray, block_of: np.ndarray, k: int = K_CONSECUTIVE
) -> tuple[float, float, float]:
    """(|Spearman rho| of id vs position, mean distinct blocks per k consecutive ids, share of consecutive
    pairs in the same block) of one rank's order."""
    order = np.asarray(order, dtype=np.int64)
    n = len(order)
    if n < 2:
        return 0.0, 1.0, 1.0
    ranks = np.empty(n, dtype=np.float64)
    ranks[np.argsort(order, kind="stable")] = np.arange(n)
    rho = float(np.corrcoef(ranks, np.arange(n, dtype=np.float64))[0, 1])
    blocks = block_of[order]
    m = n // k
    distinct = (
        float(np.mean([len(np.unique(blocks[i * k : (i + 1) * k])) for i in range(m)])) if m else float("nan")
    )
    same = float(np.mean(blocks[1:] == blocks[:-1]))
    return abs(rho), distinct, same


def shuffle_quality(
    name: str, lay: dict[str, Any], budgets: Sequence[int], worlds: Sequence[int]
) -> list[dict]:
    rows, nbytes = lay["block_rows"], lay["block_bytes"]
    n = int(rows.sum())
    block_of = np.repeat(np.arange(len(rows)), rows)
    out = []
    for world in worlds:
        cases: list[tuple[str, int | None]] = [(f"{_size(b)}", b) for b in budgets] + [("one window", None)]
        for label, budget in cases:
            acc, windows = [], []
            for seed in SHUFFLE_SEEDS:
                window = None if budget is None else budget // 4
                view = BlockView(BlockLayout(rows, nbytes, window), 0, world, seed, 0, True)
                acc.append(order_metrics(np.asarray(view.ids()), block_of))
                windows.append(len(view.windows))
            out.append(
                {
                    "dataset": name,
                    "N": world,
                    "budget": label,
                    "window_mb": (budget // 4) / 2**20 if budget else float(nbytes.sum()) / 2**20,
                    "windows": float(np.mean(windows)),
                    "rho": float(np.mean([a[0] for a in acc])),
                    "distinct": float(np.mean([a[1] for a in acc])),
                    "same": float(np.mean([a[2] for a in acc])),
                }
            )
        acc = []
        for seed in SHUFFLE_SEEDS:
            perm = epoch_permutation(n, seed, 0)
            acc.append(order_metrics(np.asarray(perm)[0::world], block_of))
        out.append(
            {
                "dataset": name,
                "N": world,
                "budget": "global permutation",
                "window_mb": None,
                "windows": None,
                "rho": float(np.mean([a[0] for a in acc])),
                "distinct": float(np.mean([a[1] for a in acc])),
                "same": float(np.mean([a[2] for a in acc])),
            }
        )
    return out


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << (shift - 4)) == 0:
            v = nbytes / (1 << shift)
            return f"{v:g} {unit}"
    return f"{nbytes / 2**20:.1f} MiB"
