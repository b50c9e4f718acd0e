"""Streaming at scale: a Parquet dataset with images 4x larger than the memory budget, end to end.

What it measures (the streaming issue's targets; results in docs/benchmarks.md, section "streaming"):

1. Data. A generated Parquet dataset of conversations (a user turn with `<image>` and a question, an
   assistant answer of log-normal length), each with one PNG of random noise (incompressible; 480..544
   px a side, about 790 KB; stored deflate so generation is fast, every image distinct), written with
   `pyarrow.parquet.ParquetWriter` in row groups of about 64 MB (at most an eighth of the budget) and
   files of about 1 GB, plus ~1% deliberately bad records of five kinds whose ids are known (empty
   messages list, undecodable (truncated) PNG, no assistant turn, two `<image>` markers for one image, an
   assistant turn whose content is null). A text-only dataset (1-3 rounds, 1,024-row row groups) is the
   second workload of 4 and 6. Both are cached under `--data-dir` (same parameters: reused).
2. One epoch through real processes: `batchd coordinator` + `batchd node --local-ranks N` (N = `--ranks`,
   default 2; 1: `batchd rank`) with `--dataset --memory-budget --stats-file --quarantine --state-dir`,
   Qwen2-VL visual tokens with small pixel bounds from a config file (`[pipeline] max_pixels`), one
   actor per rank, and one trainer process per rank that only iterates its `BatchClient` (no model) and
   logs every step's sample ids. Checked: every good id exactly once, exactly the bad ids quarantined
   (with the expected reason codes). Reported: peak RSS of the service process and of each actor (from
   the stats files) against the budget, wall time, samples/s, blocks and bytes read.
3. Resume: further runs (one per `--resume-policies` policy: balanced, local) whose service process is
   SIGKILLed once the trainers got half the good samples, and restarted with the same command (same port,
   same `--state-dir`); the trainers keep their `BatchClient`s (they reconnect). Checked: every good id
   exactly once across the whole run, and every step's `StepInfo` global totals equal to the sum of the
   ranks' local counts. Memory: the stats files' peaks, plus the private / shared (object store) resident
   sizes of the service and of each actor sampled in /proc every 0.5 s.
4. Reading: records/s and MB/s of one reader thread doing what a rank's reader does
   (`RecordDataset.read_block` + `RecordDataset.items` of every row), on both datasets, with the files
   first evicted from the page cache (`posix_fadvise(DONTNEED)`: "cold") and again right after ("warm").
5. Time to first batch: from spawning the service to the trainer's first batch (2), and in process
   from opening the dataset / constructing a `RaySource` to its first sample, with the blocks read by
   then; against the time one reader takes to read the whole dataset (4).
6. Shuffle quality of `BlockView` against a global permutation (`epoch_permutation`, what `ViewSource`
   deals), rank 0 of N, mean of 3 seeds, on both datasets' block layouts at a few budgets: |Spearman
   rho| between an id and its position (a global permutation: ~0), distinct blocks among 64 consecutive
   samples, and the share of consecutive pairs from the same block. Pure computation.

`--quick`: 0.2 GiB of images with a 48 MiB budget and 20,000 text records (a smoke test, under 2 minutes;
never writes the docs); `--pure` skips Ray and the processes (parts 1, 4, 6 only). tests/test_stream_bench.py
runs the pure parts on a tiny dataset. Generated data and run directories live under `--data-dir` (default
/tmp/batchd-stream-bench; delete it when done); `--json FILE` keeps the raw results and `--render FILE`
rewrites the section from them. Exit status 1 when a run was not exact.

Usage: python benchmarks/stream_scale.py [--budget 1GiB] [--data-gb 4.2] [--quick] [--pure] [--ranks 2]
       [--max-pixels 200704] [--resume-policies balanced,local] [--data-dir DIR] [--docs FILE] [--no-write]
       [--json FILE] [--render FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import resource
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from _mdsection import DOCS, publish, revision, table

from batchd.core import BlockView, epoch_permutation, parse_bytes

SECTION = "streaming"
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
    from batchd.service.preprocess._demo_data import _WORDS  # the demo tokenizer was trained on these

    return list(_WORDS)


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
            yield [image_record(rng, words, bad.get(i)) for i in range(start, min(n, start + rows_per_group))]
            if (start // rows_per_group) % 16 == 15:
                say(
                    f"data: {min(n, start + rows_per_group)}/{n} image records ({time.perf_counter() - t0:.0f} s)"
                )

    files = _write_files(out, _schema(True), batches(), rows_per_group, groups_per_file)
    gen = _write_manifest(out, params, files, n, bad, time.perf_counter() - t0)
    say(
        f"data: wrote {n} image records ({len(bad)} bad) in {len(files)} files, {gen.disk_bytes / 1e9:.2f} GB, "
        f"{gen.seconds:.0f} s"
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
                view = BlockView(
                    rows,
                    nbytes,
                    0,
                    world,
                    seed,
                    0,
                    True,
                    window_bytes=None if budget is None else budget // 4,
                )
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


# -- 5. RaySource time to first sample (in process) -------------------------------------------------
def raysource_first(
    gen: Generated, budget: int, stages: list, num_actors: int, samples: int = 64
) -> dict[str, Any]:
    """From opening the dataset to a RaySource's first sample (and to its `samples`-th)."""
    from batchd.service.preprocess import RaySource, RecordDataset

    evict(gen.files)
    t0 = time.perf_counter()
    ds = RecordDataset(gen.path)
    t_open = time.perf_counter() - t0
    src = RaySource(ds, 0, 1, SEED, 0, True, stages=stages, num_actors=num_actors, memory_budget=budget)
    try:
        t_made = time.perf_counter() - t0
        got, t_first, at_first = 0, None, None
        while got < samples:
            item = src.poll(1.0)
            if item is None:
                continue
            if not isinstance(item, tuple):
                break
            got += 1
            if t_first is None:
                t_first = time.perf_counter() - t0
                at_first = src.stats()
        t_n = time.perf_counter() - t0
        end = src.stats()
    finally:
        src.close()
    return {
        "open_s": t_open,
        "construct_s": t_made,
        "first_s": t_first,
        "n": got,
        "n_s": t_n,
        "blocks_at_first": at_first["blocks_read"],
        "bytes_at_first": at_first["bytes_read"],
        "blocks_at_n": end["blocks_read"],
        "bytes_at_n": end["bytes_read"],
        "blocks": len(ds.blocks),
        "windows": end["windows"],
    }


# -- 2, 3, 5. the service run ------------------------------------------------------------------------
def trainer_main(argv: Sequence[str]) -> int:
    """A trainer without a model: iterates its rank's batches and logs each step's sample ids (JSON lines)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from batchd.client import BatchClient

    with (
        BatchClient(a.address, a.rank, a.world, reconnect_timeout_s=600, startup_timeout_s=600) as client,
        open(a.out, "a", encoding="utf-8") as f,
    ):
        for batch, info in client:
            ids = batch["sample_ids"].tolist()
            f.write(
                json.dumps(
                    {
                        "step": info.step,
                        "ids": ids,
                        "idle": bool(info.is_idle),
                        "t": time.time(),
                        "loss": [info.local_loss_tokens, info.global_loss_tokens],
                        "samples": [info.local_samples, info.global_samples],
                    }
                )
                + "\n"
            )
            f.flush()
        f.write(
            json.dumps(
                {
                    "done": True,
                    "t": time.time(),
                    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                }
            )
            + "\n"
        )
    return 0


def _read_steps(path: Path) -> tuple[list[dict], dict | None]:
    steps, done = [], None
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.endswith("}"):
                continue  # a line cut by a kill
            obj = json.loads(line)
            if obj.get("done"):
                done = obj
            else:
                steps.append(obj)
    return steps, done


def _wait_port(path: Path, proc: subprocess.Popen, name: str, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return time.time()
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode} before listening")
        time.sleep(0.05)
    raise TimeoutError(f"{name} did not listen within {timeout:g}s")


def service_run(
    work: Path,
    gen: Generated,
    budget: int,
    ranks: int,
    ray_address: str,
    max_pixels: int,
    policy: str = "balanced",
    kill_at: float | None = None,
    say=print,
) -> dict[str, Any]:
    """One epoch through a coordinator, the rank service(s) and model-free trainers; with `kill_at`, the
    service is SIGKILLed once the trainers got that share of the good samples and restarted."""
    from batchd.core import JobSpec
    from batchd.launch import Processes, free_port, spec_argv

    work.mkdir(parents=True, exist_ok=True)
    spec = spec_argv(JobSpec(world_size=ranks, **{**JOB, "policy": policy}))
    cfg = work / "pipeline.toml"
    cfg.write_text(f"[pipeline]\nmin_pixels = {MIN_PIXELS}\nmax_pixels = {max_pixels}\n")
    procs = Processes(work)
    py = sys.executable
    try:
        coord = procs.start(
            "coordinator",
            [
                py,
                "-m",
                "batchd",
                "coordinator",
                *spec,
                "--port",
                "0",
                "--port-file",
                str(work / "coord.port"),
                "--lease",
                "180",
            ],
        )
        _wait_port(work / "coord.port", coord, "coordinator", 60)
        cport = json.loads((work / "coord.port").read_text())["port"]
        port = free_port()
        common = [
            "--config",
            str(cfg),
            "--coordinator",
            f"127.0.0.1:{cport}",
            "--dataset",
            str(gen.path),
            "--memory-budget",
            str(budget),
            "--num-actors",
            "1",
            "--ray-address",
            ray_address,
            "--quarantine",
            str(work / "quarantine.jsonl"),
            "--state-dir",
            str(work / "state"),
            "--stats-file",
            str(work / "stats-{rank}.json"),
            "--port",
            str(port),
        ]
        if ranks == 1:
            argv = [py, "-m", "batchd", "rank", *spec, "--rank", "0", *common]
        else:
            argv = [
                py,
                "-m",
                "batchd",
                "node",
                *spec,
                "--local-ranks",
                str(ranks),
                "--node-rank",
                "0",
                "--name",
                "bench",
                *common,
            ]
        t_start = time.time()
        service = procs.start("service", argv + ["--port-file", str(work / "service.port")])
        outs = [work / f"trainer-{r}.jsonl" for r in range(ranks)]
        trainers = [
            procs.start(
                f"trainer-{r}",
                [
                    py,
                    str(Path(__file__).resolve()),
                    "_trainer",
                    "--address",
                    f"127.0.0.1:{port}",
                    "--rank",
                    str(r),
                    "--world",
                    str(ranks),
                    "--out",
                    str(outs[r]),
                ],
            )
            for r in range(ranks)
        ]
        t_listen = _wait_port(work / "service.port", service, "the service", 300)
        at_listen = _proc_memory(service.pid)
        say(
            f"service: listening after {t_listen - t_start:.1f} s ({at_listen.get('VmRSS', 0) / 2**30:.2f} GiB RSS)"
        )
        good = len(gen.good)
        kill = restart = killed = None
        rss_peaks: dict[str, int] = {}
        actor_peaks: dict[int, dict[str, int]] = {}
        deadline = time.monotonic() + RUN_LIMIT_S
        last_say = time.monotonic()
        while any(t.poll() is None for t in trainers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not end within {RUN_LIMIT_S:g} s\n{_logs(procs)}")
            bad = [
                (n, p.returncode)
                for n, p in procs.procs
                if p.poll() not in (None, 0) and p is not killed and p is not service
            ]
            if bad:
                raise RuntimeError(f"{bad} failed\n{_logs(procs)}")
            for key, v in _proc_memory(service.pid).items():
                rss_peaks[key] = max(rss_peaks.get(key, 0), v)
            for pid in _actor_pids():
                peaks = actor_peaks.setdefault(pid, {})
                for key, v in _proc_memory(pid).items():
                    peaks[key] = max(peaks.get(key, 0), v)
            got = sum(len(s["ids"]) for o in outs for s in _read_steps(o)[0])
            if kill_at is not None and kill is None and got >= kill_at * good:
                os.kill(service.pid, signal.SIGKILL)
                service.wait(30)
                killed = service
                kill = {
                    "t": time.time(),
                    "samples": got,
                    "steps": {r: len(_read_steps(o)[0]) for r, o in enumerate(outs)},
                }
                say(f"service: SIGKILLed at {got}/{good} samples; restarting it")
                (work / "service-restarted.port").unlink(missing_ok=True)
                service = procs.start(
                    "service-restarted", argv + ["--port-file", str(work / "service-restarted.port")]
                )
                restart = {"t": time.time()}
                restart["listen"] = _wait_port(
                    work / "service-restarted.port", service, "the restarted service", 300
                )
            elif service.poll() not in (None, 0):
                raise RuntimeError(f"the service exited with {service.returncode}\n{_logs(procs)}")
            if time.monotonic() - last_say > 30:
                say(f"service: {got}/{good} samples after {time.time() - t_start:.0f} s")
                last_say = time.monotonic()
            time.sleep(0.5)
        t_trainers = time.time()
        for name, p in procs.procs:
            if name.startswith("service") and p is service or name == "coordinator":
                try:
                    p.wait(120)
                except subprocess.TimeoutExpired:
                    raise TimeoutError(f"{name} did not exit after the epoch\n{_logs(procs)}") from None
        codes = {n: p.returncode for n, p in procs.procs}
        logs = {n: (work / f"{n}.log").read_text() for n, _ in procs.procs}
    finally:
        procs.stop()
    steps, dones = zip(*[_read_steps(o) for o in outs], strict=False)
    ids = [i for per_rank in steps for s in per_rank for i in s["ids"]]
    times = sorted(s["t"] for per_rank in steps for s in per_rank)
    stats = [
        json.loads((work / f"stats-{r}.json").read_text()) if (work / f"stats-{r}.json").exists() else {}
        for r in range(ranks)
    ]
    q = work / "quarantine.jsonl"
    quarantined: dict[int, str] = {}
    if q.exists():
        for line in q.read_text().splitlines():
            if line.strip():
                obj = json.loads(line)
                quarantined[int(obj["id"])] = obj["reason"].split(":", 1)[0]
    counts = (
        np.bincount(np.asarray(ids, dtype=np.int64), minlength=gen.records) if ids else np.zeros(gen.records)
    )
    good_mask = np.ones(gen.records, dtype=bool)
    good_mask[list(gen.bad)] = False
    expected_codes = all(quarantined.get(i) == kind for i, kind in gen.bad.items())
    first_after = None
    if restart is not None:  # batches the clients held at the kill are consumed at once, before it listens
        after = [t for t in times if t > restart["listen"]]
        first_after = (after[0] - kill["t"]) if after else None
    totals_ok, totals_checked = totals_consistent(steps)
    return {
        "ranks": ranks,
        "budget": budget,
        "max_pixels": max_pixels,
        "killed": kill is not None,
        "policy": policy,
        "totals_ok": totals_ok,
        "totals_checked": totals_checked,
        "service_memory_peaks": rss_peaks,
        "service_memory_at_listen": at_listen,
        "actor_memory_peaks": list(actor_peaks.values()),
        "t_listen_s": t_listen - t_start,
        "first_batch_s": times[0] - t_start if times else None,
        "wall_s": times[-1] - t_start if times else None,
        "trainers_done_s": t_trainers - t_start,
        "samples": len(ids),
        "good": good,
        "missing": int(np.sum((counts == 0) & good_mask)),
        "duplicates": int(np.sum(np.maximum(counts - 1, 0))),
        "bad_delivered": int(np.sum(counts[~good_mask])),
        "steps": [len(s) for s in steps],
        "idle_steps": sum(1 for per in steps for s in per if s["idle"]),
        "quarantined": len(quarantined),
        "quarantine_exact": set(quarantined) == set(gen.bad),
        "quarantine_codes_ok": expected_codes,
        "codes": codes,
        "samples_per_s": len(ids) / (times[-1] - times[0]) if len(times) > 1 else None,
        "samples_per_s_from_start": len(ids) / (times[-1] - t_start) if times else None,
        "stats": stats,
        "trainer_peak_rss": [d["peak_rss_bytes"] if d else None for d in dones],
        "kill": kill,
        "restart_listen_s": (restart["listen"] - kill["t"]) if restart else None,
        "first_batch_after_kill_s": first_after,
        "restored": next(
            (ln for ln in logs.get("service-restarted", "").splitlines() if "restored from" in ln), None
        ),
    }


def _actor_pids() -> list[int]:
    """This process's descendants that are preprocessing actors (Ray names them `ray::PreprocessWorker`)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    out, stack, seen = [], list(children.get(os.getpid(), [])), set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        stack.extend(children.get(pid, []))
        try:
            if (Path("/proc") / str(pid) / "cmdline").read_bytes().startswith(b"ray::PreprocessWorker"):
                out.append(pid)
        except OSError:
            continue
    return out


def _proc_memory(pid: int) -> dict[str, int]:
    """VmRSS and its parts (RssAnon: private, RssFile, RssShmem: e.g. Ray object store pages) of `pid`, bytes."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def totals_consistent(steps: Sequence[Sequence[dict]]) -> tuple[int, int]:
    """(steps whose StepInfo totals match the sum over ranks of their local counts, steps checked)."""
    by_step: dict[int, list[dict]] = {}
    for per_rank in steps:
        for s in per_rank:
            by_step.setdefault(s["step"], []).append(s)
    ok = checked = 0
    for row in by_step.values():
        if len(row) != len(steps):
            continue
        checked += 1
        ok += all(
            sum(s["loss"][0] for s in row) == s["loss"][1]
            and sum(s["samples"][0] for s in row) == s["samples"][1]
            for s in row
        )
    return ok, checked


def _logs(procs) -> str:
    return "\n".join(f"--- {n} (exit {p.poll()}) ---\n{procs.log(n)[-2500:]}" for n, p in procs.procs)


# -- report -----------------------------------------------------------------------------------------
def _gib(v: float | None) -> str:
    return "-" if v is None else f"{v / 2**30:.2f}"


def exact(run: dict) -> bool:
    return (
        run["missing"] == 0
        and run["duplicates"] == 0
        and run["bad_delivered"] == 0
        and run["quarantine_exact"]
        and run["quarantine_codes_ok"]
    )


def _service_rss(run: dict) -> int | None:
    vals = [s.get("peak_rss_bytes") for s in run["stats"] if s]
    return max(vals) if vals else None


def _actor_rss(run: dict) -> list[int]:
    return [v for s in run["stats"] if s for v in s.get("actor_peak_rss_bytes", [])]


def _cold(r: dict, name: str) -> dict:
    return next(p for p in r["reads"] if p["dataset"] == name and p["cache"] == "cold")


def render(r: dict[str, Any]) -> list[str]:
    budget, meta = r["budget"], r["meta"]
    img, txt = r["layout"]["images"], r["layout"]["text"]
    runs = r.get("runs", {})
    lines = [
        "## Streaming: a dataset 4x the memory budget",
        "",
        (
            f"`python benchmarks/stream_scale.py{meta['flags']}` ({meta['revision']}, {meta['python']}, "
            f"{meta['cores']} cores, {meta['seconds'] / 60:.0f} min in all). Memory budget {_size(budget)} per rank: "
            f"windows of {_size(budget // 4)}, the reader holds at most {_size(budget // 2)}. Data generated by the "
            "script (Parquet, snappy, no dictionary) and cached between runs."
        ),
        "",
        "### Data",
        "",
        table(
            [
                "dataset",
                "records",
                "bad",
                "files",
                "blocks",
                "rows/block",
                "MiB/block",
                "GB on disk",
                "GiB Arrow",
                "x budget",
                "generated in s",
            ],
            [
                [
                    name,
                    L["records"],
                    L["bad"],
                    L["files"],
                    L["blocks"],
                    f"{L['rows_per_block']:.0f}",
                    f"{L['block_mb']:.1f}",
                    f"{L['disk_bytes'] / 1e9:.2f}",
                    f"{L['arrow_bytes'] / 2**30:.2f}",
                    f"{L['arrow_bytes'] / budget:.1f}",
                    f"{L['gen_s']:.0f}",
                ]
                for name, L in (("images", img), ("text", txt))
            ],
        ),
        "",
        (
            "images: one noise PNG per record (480..544 px a side, RGB, stored deflate: ~790 KB, incompressible), "
            "a user turn `<image>` + a question, an assistant answer of log-normal length; 1% bad records of "
            f"five kinds ({', '.join(BAD_KINDS)}). text: 1-3 rounds, no images, {TEXT_ROW_GROUP_ROWS}-row row "
            "groups. GiB Arrow: the blocks' decoded bytes (Parquet `total_uncompressed_size` of the columns read), "
            "what the reader holds."
        ),
        "",
    ]
    if runs:
        one = runs["epoch"]
        service = "rank" if one["ranks"] == 1 else f"node --local-ranks {one['ranks']}"
        lines += [
            "### One epoch through the service, and resume after kill -9",
            "",
            (
                f"`batchd coordinator` + `batchd {service} --dataset DIR --memory-budget {_size(budget)} "
                f"--num-actors 1 --state-dir ...` (one Ray actor per rank, on a Ray the script starts) with "
                f"`[pipeline] max_pixels = {one['max_pixels']}` in a config file (Qwen2-VL: 256 visual tokens and "
                f"a 1024 x 1176 float32 `pixel_values` per image), job {', '.join(f'{k}={v}' for k, v in JOB.items())}; "
                "one trainer process per rank iterating its `BatchClient` without a model and logging every step's "
                "sample ids. first batch: from spawning the service process. samples/s: samples / (last batch - first "
                f"batch). The resume runs SIGKILL the service process once the trainers have {KILL_AT:.0%} of the good "
                "samples and restart it with the same command (same port, same `--state-dir`); the trainers keep "
                "their clients, which reconnect. totals ok: steps whose `StepInfo` global sample and loss-token "
                "counts equal the sum of the ranks' local ones."
            ),
            "",
            table(
                [
                    "run",
                    "policy",
                    "wall s",
                    "samples/s",
                    "first batch s",
                    "samples",
                    "missing",
                    "dup",
                    "bad delivered",
                    "quarantine = bad ids",
                    "totals ok",
                ],
                [
                    [
                        name,
                        run["policy"],
                        f"{run['wall_s']:.0f}",
                        f"{run['samples_per_s']:.1f}",
                        f"{run['first_batch_s']:.1f}",
                        run["samples"],
                        run["missing"],
                        run["duplicates"],
                        run["bad_delivered"],
                        "yes" if run["quarantine_exact"] and run["quarantine_codes_ok"] else "NO",
                        f"{run['totals_ok']}/{run['totals_checked']}",
                    ]
                    for name, run in runs.items()
                ],
            ),
            "",
        ]
        for name, run in runs.items():
            if run["kill"]:
                lines.append(
                    f"- {name}: killed after {run['kill']['samples']} of {run['good']} samples (trainer steps "
                    f"{list(run['kill']['steps'].values())}); the restarted service listened "
                    f"{run['restart_listen_s']:.1f} s after the kill and the trainers' next batch came "
                    f"{run['first_batch_after_kill_s']:.1f} s after the kill; "
                    f"`{_restored(run)}`"
                )
        lines += [
            "",
            (
                "Memory and reads, per rank (stats file of the service's last incarnation: for the resume runs only "
                "the restarted process's counters). service RSS: the process's peak (ru_maxrss; a node agent is "
                "one process for all its ranks); anon / shmem: the largest private and shared (Ray object store) "
                "resident sizes seen in /proc every 0.5 s. read x: bytes read / the Arrow bytes of the rank's view."
            ),
            "",
            table(
                [
                    "run",
                    "rank",
                    "view",
                    "windows",
                    "blocks read",
                    "GiB read",
                    "read x",
                    "peak held MiB",
                    "held / budget",
                    "service RSS GiB",
                    "anon / shmem GiB",
                    "actor RSS GiB",
                    "actor busy s",
                ],
                [
                    [
                        name,
                        st["rank"],
                        st["view"],
                        st["windows"],
                        st["blocks_read"],
                        f"{st['bytes_read'] / 2**30:.2f}",
                        f"{st['bytes_read'] / (img['arrow_bytes'] * st['view'] / img['records']):.2f}",
                        f"{st['peak_held_bytes'] / 2**20:.0f}",
                        f"{st['peak_held_bytes'] / budget:.2f}",
                        _gib(st["peak_rss_bytes"]),
                        (
                            f"{_gib(run['service_memory_peaks'].get('RssAnon'))} / "
                            f"{_gib(run['service_memory_peaks'].get('RssShmem'))}"
                        ),
                        ", ".join(_gib(v) for v in st.get("actor_peak_rss_bytes", [])),
                        f"{st.get('actor_busy_s', 0):.0f}",
                    ]
                    for name, run in runs.items()
                    for st in run["stats"]
                    if st
                ],
            ),
            "",
        ]
    lines += [
        "### Reading throughput (one reader thread)",
        "",
        (
            "`RecordDataset.read_block` + `RecordDataset.items` of every row, block by block: what a rank's "
            "`BlockReader` and `RaySource._submit` do, without the actors. cold: the files first evicted from the "
            "page cache (`posix_fadvise(DONTNEED)` on these files only; on a VM the host may still cache the disk); "
            "warm: the pass right after. MB/s: Arrow "
            "bytes (block `nbytes`) per second. open: `RecordDataset(dir)`, footers only."
        ),
        "",
        table(
            ["dataset", "cache", "records", "s", "records/s", "MB/s", "open s", "first block s"],
            [
                [
                    p["dataset"],
                    p["cache"],
                    p["records"],
                    f"{p['seconds']:.1f}",
                    f"{p['records_per_s']:,.0f}",
                    f"{p['arrow_mb_per_s']:.0f}",
                    f"{p['open_s']:.3f}",
                    f"{p['first_block_s']:.3f}",
                ]
                for p in r["reads"]
            ],
        ),
        "",
        "### Time to first batch",
        "",
    ]
    full = _cold(r, "images")
    rows = [
        [
            "one reader thread through the whole images dataset (cold, above)",
            f"{full['seconds']:.1f}",
            str(img["blocks"]),
        ]
    ]
    if r.get("raysource"):
        rs = r["raysource"]
        rows += [
            ["`RecordDataset(dir)`: metadata only (cold cache)", f"{rs['open_s']:.2f}", "0"],
            [
                "+ `RaySource(..., num_actors=2)` constructed (actors start in the background)",
                f"{rs['construct_s']:.2f}",
                "0",
            ],
            ["+ first sample out of `poll`", f"{rs['first_s']:.2f}", str(rs["blocks_at_first"])],
            [f"+ {rs['n']} samples", f"{rs['n_s']:.2f}", str(rs["blocks_at_n"])],
        ]
    if "epoch" in runs:
        run = runs["epoch"]
        rows += [
            [
                "service process spawned -> listening (Ray joined, actors created, dataset opened)",
                f"{run['t_listen_s']:.1f}",
                "-",
            ],
            ["service process spawned -> the trainers' first batch", f"{run['first_batch_s']:.1f}", "-"],
        ]
    lines += [table(["from start to", "s", "blocks read"], rows), ""]
    lines += [
        "### Shuffle quality: BlockView vs a global permutation",
        "",
        (
            f"Rank 0 of N, epoch 0, mean of seeds {list(SHUFFLE_SEEDS)}, on each dataset's block layout (pure "
            "computation). window = budget / 4; one window: the rank's whole share as one window (a uniform "
            "permutation of its units' rows); global permutation: `epoch_permutation` dealt round-robin (what "
            "`ViewSource` did: every sample from anywhere, each read costing its whole block). abs(rho): |Spearman "
            "rho| of id vs position in the rank's order (0: no trace of file order). distinct/64: distinct blocks "
            f"among {K_CONSECUTIVE} consecutive samples (non-overlapping runs). same-block: share of consecutive "
            "pairs from one block."
        ),
        "",
        table(
            ["dataset", "N", "budget", "window MiB", "windows", "abs(rho)", "distinct/64", "same-block"],
            [
                [
                    q["dataset"],
                    q["N"],
                    q["budget"],
                    "-" if q["window_mb"] is None else f"{q['window_mb']:.0f}",
                    "-" if q["windows"] is None else f"{q['windows']:.0f}",
                    f"{q['rho']:.3f}",
                    _f1(q["distinct"]),
                    f"{q['same']:.3f}",
                ]
                for q in r["shuffle"]
            ],
        ),
        "",
        "### Targets",
        "",
    ]
    lines += targets(r)
    notes = findings(r)
    if notes:
        lines += ["", "Findings:", ""] + [f"- {n}" for n in notes]
    return lines


def findings(r: dict[str, Any]) -> list[str]:
    """What the numbers say beyond met / missed (only the statements the results support)."""
    out = []
    runs = r.get("runs", {})
    img, budget = r["layout"]["images"], r["budget"]
    if "epoch" in runs:
        run = runs["epoch"]
        amp = [
            st["bytes_read"] / (img["arrow_bytes"] * st["view"] / img["records"]) for st in run["stats"] if st
        ]
        span = (
            f"{min(amp):.2f}" if f"{min(amp):.2f}" == f"{max(amp):.2f}" else f"{min(amp):.2f}-{max(amp):.2f}"
        )
        out.append(
            f"Each rank read its share of the blocks {span} times in the epoch run. "
            "Before 49cc581 (`RaySource._top_up`: one `_read_ahead` per chunk, before its "
            "first pull) a chunk of samples that straddled two windows dropped the first window's blocks "
            "before its records were read, and `_submit` read them again on the rank's loop thread: "
            "1.6-1.7x on the --quick run (tests/test_pipeline.py::test_one_epoch_reads_each_block_once)."
        )
        rss, peaks = _service_rss(run), run["service_memory_peaks"]
        if rss:
            out.append(
                f"The service's RSS ({rss / 2**30:.2f} GiB for {run['ranks']} ranks) is mostly not the "
                f"reader's: at most {run['ranks']} x {budget // 2 // 2**20} MiB of records are held. It was "
                f"{_gib(run['service_memory_at_listen'].get('VmRSS'))} GiB when the service began listening; "
                f"at its largest, {_gib(peaks.get('RssShmem'))} GiB were Ray object store pages (shared "
                f"memory: the preprocessed payloads, ~4.8 MB of `pixel_values` a sample at max_pixels "
                f"{run['max_pixels']}, mapped while batches are collated) and {_gib(peaks.get('RssAnon'))} GiB "
                "private (the held blocks, the collated batches waiting for the trainers, Python, Arrow, gRPC)."
            )
        actors = _actor_rss(run)
        sampled = run.get("actor_memory_peaks") or []
        if actors and sampled:
            out.append(
                f"An actor's peak RSS ({', '.join(_gib(v) for v in actors)} GiB) counts the object store pages "
                f"it wrote its payloads into: sampled in /proc, the actors' private memory peaked at "
                f"{_gib(max(p.get('RssAnon', 0) for p in sampled))} GiB and their shared pages at "
                f"{_gib(max(p.get('RssShmem', 0) for p in sampled))} GiB (the object store is "
                f"{r['meta'].get('object_store_gb', 2):g} GiB)."
            )
        elif actors:
            out.append(
                f"An actor's peak RSS ({', '.join(_gib(v) for v in actors)} GiB, ru_maxrss) also counts the "
                "Ray object store pages it wrote its payloads into (shared memory, 2 GiB store); this run "
                "did not sample the private / shared split of the actors."
            )
    q = {(x["dataset"], x["N"], x["budget"]): x for x in r["shuffle"]}
    mine, glob = q.get(("images", 1, _size(budget))), q.get(("images", 1, "global permutation"))
    if mine and glob:
        per = [
            (x["budget"], img["blocks"] / x["windows"], x["same"])
            for x in r["shuffle"]
            if x["dataset"] == "images" and x["N"] == 1 and x["windows"]
        ]
        out.append(
            f"Shuffle: at {_size(budget)} a window holds {img['blocks'] / mine['windows']:.1f} blocks of "
            f"{img['rows_per_block']:.0f} image records, so 64 consecutive samples come from "
            f"{mine['distinct']:.1f} blocks (a global permutation: {glob['distinct']:.1f}) and "
            f"{mine['same']:.0%} of consecutive pairs from one block ({glob['same']:.1%}); abs(rho) stays "
            f"~{mine['rho']:.2f} (the order of {img['blocks']} shuffled blocks) until the whole share is one "
            "window. The same-block share is about 1 / (blocks per window) ("
            + "; ".join(f"{b}: {k:.1f} blocks, {v:.3f}" for b, k, v in per)
            + "): what counts is blocks per window, so at a given budget smaller row groups shuffle better."
        )
    killed = {name: run for name, run in runs.items() if run["kill"]}
    if killed and "epoch" in runs:
        share = sum(st["blocks_read"] for st in runs["epoch"]["stats"] if st)
        again = ", ".join(
            f"{sum(st['blocks_read'] for st in run['stats'] if st)} ({name})" for name, run in killed.items()
        )
        out.append(
            f"After a restart the new process read {again} blocks, though the ranks' whole shares are {share} "
            "blocks and about half were left. The restored rank re-makes, by id, the samples its journal names "
            "(its batching window and the batches not yet taken): they come from many blocks, since a batching "
            "window spans several read windows, and each of those blocks is read once (`materialize_many` works "
            "in block order; the reader keeps the last two blocks read at random). The resumed view then reads "
            "the rest of its share, its current read window again."
        )
    facts = []
    for name, run in killed.items():
        if run["duplicates"]:
            facts.append(f"{name}: {run['duplicates']} samples delivered twice")
        if run["totals_ok"] < run["totals_checked"]:
            facts.append(
                f"{name}: {run['totals_checked'] - run['totals_ok']} steps whose `StepInfo` global totals "
                "(samples, loss tokens, hence `loss_scale`) are not the sum of the ranks' local counts"
            )
    if facts:
        out.append(
            "Resume after kill -9 is not exact here ("
            + "; ".join(facts)
            + "). A bug in the rank service's replay, "
            "not in the reader: the coordinator replays the rounds decided before the kill (their decision and "
            "totals), assuming the restarted rank reports what it reported then (`service/_coordinator.py`: "
            '"the rank\'s state is deterministic"). It is with a `SyntheticSource` (tests/test_multiprocess.py), '
            "not with a RaySource: the restarted rank rebuilds its window from the journal and fills it again, "
            "and `_fill` stops at the first `poll` that finds nothing ready, so its buffer depends on the actors' "
            "timing. Under `balanced` the replayed plan names the samples of the old report: `RankState.apply` "
            "emits them (payloads re-made by id) and removes only those in its buffer, and the others come out of "
            "the source again later. Under `local` the rank forms new groups from its buffer while the replayed "
            "commit returns the old groups' totals, so ids stay exact but the totals (loss scale) can be wrong, or "
            "the job fails (`ValueError: global_tokens must be >= ...` in `RankState.finalize`, seen on a --quick "
            "run)."
        )
    return out


def _f1(v: float) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.1f}"


def _restored(run: dict) -> str:
    line = run.get("restored") or "no restore line in the log"
    line = line.split("]: ", 1)[-1]
    head, sep, tail = line.partition(" restored from ")
    return f"{head} restored from its journal {tail.split(' ', 1)[-1]}" if sep else line


def targets(r: dict[str, Any]) -> list[str]:
    img, budget = r["layout"]["images"], r["budget"]
    out = [
        (
            f"- data >= 4x the budget: {'met' if img['arrow_bytes'] >= 4 * budget else 'missed'} "
            f"({img['arrow_bytes'] / budget:.1f}x in Arrow bytes, {img['disk_bytes'] / 1e9:.2f} GB on disk)"
        )
    ]
    runs = r.get("runs", {})
    if "epoch" in runs:
        run = runs["epoch"]
        rss = _service_rss(run)
        held = max(st["peak_held_bytes"] for st in run["stats"] if st)
        ok = exact(run) and run["totals_ok"] == run["totals_checked"]
        out.append(
            f"- one epoch: every good id exactly once, exactly the bad ids quarantined with the expected codes, "
            f"consistent step totals: {'met' if ok else 'MISSED'}"
        )
        out.append(
            f"- each rank's reader held <= budget / 2: {'met' if held <= budget // 2 else 'MISSED'} "
            f"(largest peak {held / 2**20:.0f} MiB of {budget // 2 // 2**20} MiB)"
        )
        if rss:
            out.append(
                f"- service process peak RSS {rss / 2**30:.2f} GiB for {run['ranks']} rank(s) of {_size(budget)} "
                f"each ({rss / (budget * run['ranks']):.2f}x their budgets together); each actor "
                f"{', '.join(_gib(v) for v in _actor_rss(run))} GiB"
            )
        out.append(
            f"- {run['samples_per_s']:.1f} samples/s ({run['samples_per_s'] * img['arrow_bytes'] / img['records'] / 1e6:.0f} "
            f"MB/s of records) over {run['wall_s']:.0f} s"
        )
    for name, run in runs.items():
        if run["kill"]:
            ok = exact(run) and run["totals_ok"] == run["totals_checked"]
            out.append(
                f"- {name}: every good id exactly once across the kill, consistent step totals: "
                f"{'met' if ok else 'MISSED'} ({run['missing']} missing, {run['duplicates']} duplicated, "
                f"totals ok on {run['totals_ok']} of {run['totals_checked']} steps)"
            )
    if r.get("raysource"):
        rs = r["raysource"]
        out.append(
            f"- no full scan before the first sample: {'met' if rs['blocks_at_first'] < img['blocks'] else 'MISSED'} "
            f"({rs['blocks_at_first']} of {img['blocks']} blocks read; first sample after {rs['first_s']:.1f} s, "
            f"one full read takes {_cold(r, 'images')['seconds']:.1f} s)"
        )
    return out


# -- main -------------------------------------------------------------------------------------------
def run(args: argparse.Namespace, say=print) -> dict[str, Any]:
    budget = parse_bytes(args.budget)
    root = Path(args.data_dir)
    root.mkdir(parents=True, exist_ok=True)
    rg = min(ROW_GROUP_BYTES, budget // 8)
    images = make_image_dataset(
        root / "data",
        int(args.data_gb * 2**30),
        rg,
        file_bytes=max(rg, FILE_BYTES if not args.quick else 16 * rg),
        say=say,
    )
    text = make_text_dataset(root / "data", args.text_records, say=say)
    result: dict[str, Any] = {"budget": budget, "layout": {"images": layout(images), "text": layout(text)}}
    say("reading: one thread, cold and warm")
    reads = []
    for name, gen in (("images", images), ("text", text)):
        for cold in (True, False):
            p = read_pass(gen, cold)
            p["dataset"] = name
            say(
                f"reading {name} {p['cache']}: {p['records_per_s']:,.0f} records/s, {p['arrow_mb_per_s']:.0f} MB/s"
            )
            reads.append(p)
    result["reads"] = reads
    say("shuffle quality")
    text_bytes = int(result["layout"]["text"]["arrow_bytes"])
    result["shuffle"] = shuffle_quality(
        "images", result["layout"]["images"], [budget // 4, budget, budget * 4], (1, 8)
    ) + shuffle_quality(
        "text",
        result["layout"]["text"],
        [_round_mib(text_bytes // 16), _round_mib(text_bytes // 4), _round_mib(text_bytes)],
        (1, 8),
    )
    if args.pure:
        return result
    import ray

    from batchd.service.preprocess import default_stages

    ray_dir = root / "ray"
    ray.init(
        num_cpus=max(4, 2 * args.ranks),
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=args.object_store_gb * 2**30,
        _temp_dir=str(ray_dir),
    )
    try:
        address = ray.get_runtime_context().gcs_address
        stages = default_stages(min_pixels=MIN_PIXELS, max_pixels=args.max_pixels)
        say("RaySource: time to first sample")
        result["raysource"] = raysource_first(images, budget, stages, num_actors=2)
        say(
            f"RaySource: first sample after {result['raysource']['first_s']:.2f} s "
            f"({result['raysource']['blocks_at_first']} blocks read)"
        )
        runs: dict[str, Any] = {}
        plan = [("epoch", args.policy, None)] + [
            (f"resume {p}", p, KILL_AT) for p in args.resume_policies if p
        ]
        for name, policy, kill in plan:
            say(f"service run {name!r}")
            work = root / "runs" / name.replace(" ", "-")
            if work.exists():
                import shutil

                shutil.rmtree(work)
            runs[name] = run_ = service_run(
                work, images, budget, args.ranks, address, args.max_pixels, policy, kill, say=say
            )
            say(
                f"service run {name!r}: {run_['samples']} samples in {run_['wall_s']:.0f} s, exact={exact(run_)}, "
                f"dup={run_['duplicates']}, totals {run_['totals_ok']}/{run_['totals_checked']}, "
                f"service peak RSS {_gib(_service_rss(run_))} GiB"
            )
        result["runs"] = runs
    finally:
        ray.shutdown()
    return result


def _round_mib(n: int) -> int:
    return max(1 << 20, (n >> 20) << 20)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_trainer"]:
        return trainer_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", default="1GiB", help="memory budget per rank (default 1GiB)")
    ap.add_argument(
        "--data-gb",
        type=float,
        default=4.2,
        help="image data to generate, in GiB like the budget (default 4.2: 4.5 GB, 4.2x 1GiB)",
    )
    ap.add_argument(
        "--text-records", type=int, default=TEXT_RECORDS, help=f"text records (default {TEXT_RECORDS})"
    )
    ap.add_argument(
        "--quick", action="store_true", help="a small run: 0.2 GiB, a 48MiB budget, 20,000 text records"
    )
    ap.add_argument("--pure", action="store_true", help="no Ray, no processes: data, reading, shuffle only")
    ap.add_argument("--ranks", type=int, default=2, help="1: batchd rank; >1: one batchd node (default 2)")
    ap.add_argument(
        "--max-pixels", type=int, default=MAX_PIXELS, help=f"[pipeline] max_pixels (default {MAX_PIXELS})"
    )
    ap.add_argument("--object-store-gb", type=float, default=2.0, help="Ray object store (default 2 GiB)")
    ap.add_argument("--policy", default="balanced", help="the job policy of the epoch run (default balanced)")
    ap.add_argument(
        "--resume-policies",
        default="balanced,local",
        type=lambda v: [p for p in v.split(",") if p],
        help="one kill -9 / restart run per policy (default balanced,local; '' for none)",
    )
    ap.add_argument(
        "--data-dir", default=str(DATA_DIR), help=f"data and run directories (default {DATA_DIR})"
    )
    ap.add_argument("--docs", type=Path, default=DOCS)
    ap.add_argument("--no-write", action="store_true", help="print only (--quick and --pure never write)")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    ap.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="JSON",
        help="only render (and write) the section from the --json file of an earlier full run",
    )
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(args.render.read_text())
        publish(SECTION, render(result), args.no_write, args.docs, echo=True)
        return 0
    if args.quick:
        args.budget, args.data_gb = "48MiB", 0.2
        if args.text_records == TEXT_RECORDS:
            args.text_records = 20_000
    say = lambda msg: print(f"[stream_scale] {msg}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    flags = " --quick" if args.quick else ""
    for name, default in (
        ("budget", "1GiB"),
        ("data_gb", 4.2),
        ("ranks", 2),
        ("max_pixels", MAX_PIXELS),
        ("policy", "balanced"),
    ):
        if not args.quick and getattr(args, name) != default:
            flags += f" --{name.replace('_', '-')} {getattr(args, name)}"
    result = run(args, say)
    result["meta"] = {
        "flags": flags,
        "revision": revision(),
        "seconds": time.perf_counter() - t0,
        "object_store_gb": args.object_store_gb,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "cores": os.cpu_count(),
        "quick": args.quick,
    }
    if args.json:
        args.json.write_text(json.dumps(result, default=_jsonable, indent=1))
    publish(SECTION, render(result), args.no_write or args.quick or args.pure, args.docs, echo=True)
    runs = result.get("runs", {})
    return 0 if all(exact(run) for run in runs.values()) else 1


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return str(v)


if __name__ == "__main__":
    raise SystemExit(main())
