"""Streaming at scale: a Parquet dataset with images 4x larger than the memory budget, end to end.

What it measures (the streaming issue's targets; result benchmarks/results/streaming.json, template
benchmarks/templates/streaming.md.j2; the parts live in _stream_data.py and _stream_service.py):

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

`--quick`: 0.2 GiB of images with a 48 MiB budget and 20,000 text records (a smoke test, under 2
minutes; use it with `--out`); `--pure` skips Ray and the processes (parts 1, 4, 6 only).
tests/test_stream_bench.py runs the pure parts on a tiny dataset. Generated data and run directories
live under `--data-dir` (default /tmp/batchd-stream-bench; delete it when done). Exit status 1 when a
run was not exact.

Usage: python benchmarks/stream_scale.py [--budget 1GiB] [--data-gb 4.2] [--quick] [--pure] [--ranks 2]
       [--max-pixels 200704] [--resume-policies balanced,local] [--data-dir DIR] [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import add_common_args, finish, render_section  # noqa: E402
from _stream_data import (  # noqa: E402, F401  (re-exported: tests/test_stream_bench.py)
    AVG_IMAGE_BYTES,
    BAD_KINDS,
    DATA_DIR,
    FILE_BYTES,
    JOB,
    K_CONSECUTIVE,
    KILL_AT,
    MAX_PIXELS,
    MIN_PIXELS,
    ROW_GROUP_BYTES,
    SHUFFLE_SEEDS,
    TEXT_RECORDS,
    TEXT_ROW_GROUP_ROWS,
    Generated,
    _size,
    _words,
    layout,
    make_image_dataset,
    make_text_dataset,
    order_metrics,
    png_noise,
    read_pass,
    shuffle_quality,
    text_record,
)
from _stream_service import RunSettings, exact, raysource_first, service_run, trainer_main  # noqa: E402

from batchd.core import parse_bytes  # noqa: E402

SECTION = "streaming"
MEASURES = ["service/preprocess", "service", "core/_source.py"]
Say = Callable[[str], None]


# -- what the template quotes ----------------------------------------------------------------------
def _service_rss(run: dict[str, Any]) -> int | None:
    vals = [s.get("peak_rss_bytes") for s in run["stats"] if s]
    return max(vals) if vals else None


def _actor_rss(run: dict[str, Any]) -> list[int]:
    return [v for s in run["stats"] if s for v in s.get("actor_peak_rss_bytes", [])]


def _restored(run: dict[str, Any]) -> str:
    line = run.get("restored") or "no restore line in the log"
    line = line.split("]: ", 1)[-1]
    head, sep, tail = line.partition(" restored from ")
    return f"{head} restored from its journal {tail.split(' ', 1)[-1]}" if sep else line


def _run_figures(run: dict[str, Any], img: dict[str, Any]) -> dict[str, Any]:
    """Per service run: read amplification per rank, peak RSS, the restore line, exactness."""
    per_rank = img["arrow_bytes"] / img["records"]
    return {
        "read_x": [st["bytes_read"] / (per_rank * st["view"]) if st else None for st in run["stats"]],
        "service_rss": _service_rss(run),
        "actor_rss": _actor_rss(run),
        "held": max((st["peak_held_bytes"] for st in run["stats"] if st), default=0),
        "blocks_read": sum(st["blocks_read"] for st in run["stats"] if st),
        "restored": _restored(run),
        "exact": exact(run),
        "ok": exact(run) and run["totals_ok"] == run["totals_checked"],
        "mb_per_s": (run["samples_per_s"] or 0) * per_rank / 1e6,
        "service": "rank" if run["ranks"] == 1 else f"node --local-ranks {run['ranks']}",
    }


def derived(r: dict[str, Any]) -> dict[str, Any]:
    """The figures the section derives from the measurements (sizes, ratios, verdicts), so the template
    only formats: `runs` per service run, `shuffle_blocks` (blocks per window of each images budget)."""
    budget, img = r["budget"], r["layout"]["images"]
    runs = r.get("runs", {})
    return {
        "size": {"budget": _size(budget), "window": _size(budget // 4), "reader": _size(budget // 2)},
        "reader_mib": budget // 2 // 2**20,
        "data_x": img["arrow_bytes"] / budget,
        "cold_images_s": next(
            p["seconds"] for p in r["reads"] if p["dataset"] == "images" and p["cache"] == "cold"
        ),
        "runs": {name: _run_figures(run, img) for name, run in runs.items()},
        "run_order": list(runs),  # the run's order (the JSON's keys are sorted)
        "shuffle_blocks": [
            {"budget": q["budget"], "blocks": img["blocks"] / q["windows"], "same": q["same"]}
            for q in r["shuffle"]
            if q["dataset"] == "images" and q["N"] == 1 and q["windows"]
        ],
        "constants": {
            "bad_kinds": list(BAD_KINDS),
            "text_row_group_rows": TEXT_ROW_GROUP_ROWS,
            "job": JOB,
            "kill_at": KILL_AT,
            "shuffle_seeds": list(SHUFFLE_SEEDS),
            "k_consecutive": K_CONSECUTIVE,
        },
    }


def record(result: dict[str, Any]) -> dict[str, Any]:
    """The result's JSON-safe part (the layouts without their per-block arrays) plus `derived`."""
    lay = {
        k: {f: v for f, v in L.items() if f not in ("block_rows", "block_bytes")}
        for k, L in result["layout"].items()
    }
    return {**result, "layout": lay, "derived": derived(result)}


def render(result: dict[str, Any]) -> list[str]:
    """The section's lines, rendered from `result` as a run would record it (tests, a quick look)."""
    meta = result.get("meta", {})
    r = {
        "section": SECTION,
        "commit": meta.get("revision", "unknown"),
        "measured_at": "",
        "dirty": False,
        "config": {"command": "python benchmarks/stream_scale.py" + meta.get("flags", "")},
        "data": record(result),
    }
    return render_section(r).splitlines()[1:-1]


# -- the run ---------------------------------------------------------------------------------------
def _datasets(args: argparse.Namespace, budget: int, root: Path, say: Say) -> tuple[Generated, Generated]:
    rg = min(ROW_GROUP_BYTES, budget // 8)
    images = make_image_dataset(
        root / "data",
        int(args.data_gb * 2**30),
        rg,
        file_bytes=max(rg, FILE_BYTES if not args.quick else 16 * rg),
        say=say,
    )
    return images, make_text_dataset(root / "data", args.text_records, say=say)


def pure_parts(images: Generated, text: Generated, budget: int, say: Say) -> dict[str, Any]:
    """Parts 1, 4 and 6: the layouts, one reader's cold and warm passes, the shuffle quality."""
    result: dict[str, Any] = {"budget": budget, "layout": {"images": layout(images), "text": layout(text)}}
    say("reading: one thread, cold and warm")
    reads = []
    for name, gen in (("images", images), ("text", text)):
        for cold in (True, False):
            p = {**read_pass(gen, cold), "dataset": name}
            say(
                f"reading {name} {p['cache']}: {p['records_per_s']:,.0f} records/s, "
                f"{p['arrow_mb_per_s']:.0f} MB/s"
            )
            reads.append(p)
    result["reads"] = reads
    say("shuffle quality")
    text_bytes = int(result["layout"]["text"]["arrow_bytes"])
    text_budgets = [_round_mib(text_bytes // 16), _round_mib(text_bytes // 4), _round_mib(text_bytes)]
    result["shuffle"] = shuffle_quality(
        "images", result["layout"]["images"], [budget // 4, budget, budget * 4], (1, 8)
    ) + shuffle_quality("text", result["layout"]["text"], text_budgets, (1, 8))
    return result


def service_parts(
    args: argparse.Namespace, images: Generated, budget: int, root: Path, say: Say
) -> dict[str, Any]:
    """Parts 2, 3 and 5 on a Ray this process starts: a RaySource's first sample, the epoch run and
    one kill / restart run per resume policy."""
    import shutil

    import ray

    from batchd.service.preprocess import Qwen2VLImageConfig, default_stages, start_local_ray

    start_local_ray(
        num_cpus=max(4, 2 * args.ranks),
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=args.object_store_gb * 2**30,
        _temp_dir=str(root / "ray"),
    )
    try:
        address = ray.get_runtime_context().gcs_address
        stages = default_stages(vision=Qwen2VLImageConfig(MIN_PIXELS, args.max_pixels))
        say("RaySource: time to first sample")
        first = raysource_first(images, budget, stages, num_actors=2)
        say(
            f"RaySource: first sample after {first['first_s']:.2f} s ({first['blocks_at_first']} blocks read)"
        )
        runs: dict[str, Any] = {}
        plan = [("epoch", args.policy, None)] + [(f"resume {p}", p, KILL_AT) for p in args.resume_policies]
        for name, policy, kill in plan:
            say(f"service run {name!r}")
            work = root / "runs" / name.replace(" ", "-")
            if work.exists():
                shutil.rmtree(work)
            settings = RunSettings(budget, args.ranks, args.max_pixels, policy, kill)
            runs[name] = run_ = service_run(work, images, settings, address, say=say)
            say(
                f"service run {name!r}: {run_['samples']} samples in {run_['wall_s']:.0f} s, "
                f"exact={exact(run_)}, dup={run_['duplicates']}, "
                f"totals {run_['totals_ok']}/{run_['totals_checked']}"
            )
    finally:
        ray.shutdown()
    return {"raysource": first, "runs": runs}


def run(args: argparse.Namespace, say: Say = print) -> dict[str, Any]:
    budget = parse_bytes(args.budget)
    root = Path(args.data_dir)
    root.mkdir(parents=True, exist_ok=True)
    images, text = _datasets(args, budget, root, say)
    result = pure_parts(images, text, budget, say)
    if not args.pure:
        result.update(service_parts(args, images, budget, root, say))
    return result


def _round_mib(n: int) -> int:
    return max(1 << 20, (n >> 20) << 20)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
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
    add_common_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.budget, args.data_gb = "48MiB", 0.2
        if args.text_records == TEXT_RECORDS:
            args.text_records = 20_000
    return args


def _flags(args: argparse.Namespace) -> str:
    """The command's flags that change what is measured (for the section's header)."""
    flags = " --quick" if args.quick else ""
    flags += " --pure" if args.pure else ""
    for name, default in (
        ("budget", "1GiB"),
        ("data_gb", 4.2),
        ("ranks", 2),
        ("max_pixels", MAX_PIXELS),
        ("policy", "balanced"),
    ):
        if not args.quick and getattr(args, name) != default:
            flags += f" --{name.replace('_', '-')} {getattr(args, name)}"
    return flags


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_trainer"]:
        return trainer_main(argv[1:])
    args = parse_args(argv)

    def say(msg: str) -> None:
        print(f"[stream_scale] {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    result = run(args, say)
    result["meta"] = {
        "flags": _flags(args),
        "seconds": time.perf_counter() - t0,
        "object_store_gb": args.object_store_gb,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "cores": os.cpu_count(),
        "quick": args.quick,
    }
    config = {
        "command": "python benchmarks/stream_scale.py" + result["meta"]["flags"],
        **{k: v for k, v in vars(args).items() if k not in ("out", "print")},
    }
    finish(args, SECTION, record(result), measures=MEASURES, config=config)
    return 0 if all(exact(run) for run in result.get("runs", {}).values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
