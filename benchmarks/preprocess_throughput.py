"""Throughput of the Ray preprocessing pipeline: samples/s per actor, text-only and image samples, 1 vs 2 actors.

Workloads (the demo generator, no bad records): `text` (conversations only), `image` (every record has
1-2 generated images of 32-224 px a side) and `image-large` (32-672 px). The chain is
`default_stages(cutoff=4096)`: Qwen2 chat template, the demo byte-level BPE tokenizer, Qwen2-VL visual
tokens (smart_resize + CLIP-normalized patches in the payload), truncation.

For each workload:
- `in-process`: the same `Preprocessor` called in a loop in this process (no Ray): the cost of the
  stages alone.
- `N actors`: a `PreprocessPool` of N actors (1 logical CPU each) and one `RaySource` (world size 1,
  ordered, default chunk size and in-flight bound) drained for one epoch; the driver discards the
  payload references as it goes. Median of `--epochs` epochs (each epoch draws a new order).
  `samples/s` = emitted samples / wall time of the epoch; `per actor` = that / N;
  `actor-busy rate` = samples / seconds the actors spent inside `process` (their compute rate);
  `scaling` = samples/s at N / samples/s at 1 actor.
A chunk-size sweep (text, 2 actors) shows the cost of Ray's per-task overhead.

Results go to docs/benchmarks.md between `<!-- preprocess:begin -->` and `<!-- preprocess:end -->`.

Usage: python benchmarks/preprocess_throughput.py [--samples N] [--epochs E] [--actors 1,2] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _mdsection import DOCS, publish, revision, table  # noqa: E402

SECTION = "preprocess"
WORKLOADS = {  # name -> (image_fraction, max_image_side, share of --samples)
    "text": (0.0, 224, 1.0),
    "image": (1.0, 224, 0.5),
    "image-large": (1.0, 672, 0.2),
}


def make_data(root: Path, name: str, n: int) -> Any:
    from batchd.preprocess import make_demo_dataset

    frac, side, _ = WORKLOADS[name]
    return make_demo_dataset(
        root / name, num_samples=n, seed=11, image_fraction=frac, bad_fraction=0.0, max_image_side=side
    )


def bench_inprocess(dataset, stages, limit: int) -> dict[str, float]:
    from batchd.preprocess import Preprocessor

    pre = Preprocessor(stages)
    pre.setup()
    n = min(limit, len(dataset))
    lengths, vision, nbytes = [], [], []
    t0 = time.perf_counter()
    for i in range(n):
        meta, payload = pre(dataset.record(i), i, 0, dataset.source(i), dataset.files[0].base_dir)
        lengths.append(meta.length)
        vision.append(meta.vision_tokens)
        nbytes.append(sum(v.nbytes for v in payload.values()))
    wall = time.perf_counter() - t0
    return {
        "rate": n / wall,
        "mean_len": statistics.mean(lengths),
        "mean_vision": statistics.mean(vision),
        "payload_kb": statistics.mean(nbytes) / 1024,
    }


def drain_epoch(pool, epoch: int, chunk_size: int | None = None) -> tuple[int, float]:
    from batchd.preprocess import EXHAUSTED, RaySource

    kwargs = {"chunk_size": chunk_size} if chunk_size else {}
    src = RaySource(None, 0, 1, seed=0, epoch=epoch, pool=pool, **kwargs)
    t0 = time.perf_counter()
    n = 0
    while True:
        item = src.poll(1.0)
        if item is EXHAUSTED:
            break
        if item is not None:
            n += 1
    wall = time.perf_counter() - t0
    src.close()
    return n, wall


def bench_pool(
    dataset, stages, actors: int, epochs: int, chunk_sizes: Sequence[int | None] = (None,)
) -> dict[Any, dict[str, float]]:
    from batchd.preprocess import PreprocessPool

    out = {}
    with PreprocessPool(dataset, stages, num_actors=actors, actor_num_cpus=1) as pool:
        drain_epoch(pool, 1000)  # warm: first tasks, object store, caches
        for chunk in chunk_sizes:
            rates, busy_rates, cpu_shares = [], [], []
            for e in range(epochs):
                before = pool.stats()
                n, wall = drain_epoch(pool, e, chunk)
                after = pool.stats()

                busy, done, cpu = (
                    sum(a[key] for a in after) - sum(b[key] for b in before)
                    for key in ("busy_s", "processed", "cpu_s")
                )
                rates.append(n / wall)
                busy_rates.append(done / busy if busy > 0 else float("nan"))
                cpu_shares.append(cpu / busy if busy > 0 else float("nan"))
            out[chunk] = {
                "rate": statistics.median(rates),
                "busy_rate": statistics.median(busy_rates),
                "cpu_share": statistics.median(cpu_shares),
                "runs": rates,
            }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=1200, help="records of the text workload (images: fewer)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per configuration (median reported)")
    ap.add_argument("--actors", default="1,2", help="pool sizes (default 1,2)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--docs", type=Path, default=DOCS)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)

    import ray

    from batchd.preprocess import RecordDataset, TokenizerRef, default_stages, demo_tokenizer

    t_all = time.perf_counter()
    load_start = os.getloadavg()[0]
    cmd = " ".join(
        ["python benchmarks/preprocess_throughput.py", *(argv if argv is not None else sys.argv[1:])]
    )
    actors = [int(a) for a in args.actors.split(",")]
    rows, sweep_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tok = TokenizerRef(demo_tokenizer(Path(tmp) / "tokenizer.json"))
        stages = default_stages(tok, cutoff=4096)
        names = args.workloads.split(",")
        datasets = {
            name: RecordDataset(
                make_data(Path(tmp), name, max(int(args.samples * WORKLOADS[name][2]), 20)).path
            )
            for name in names
        }
        # The in-process baselines run before Ray starts (its worker start-up would steal CPU).
        bases = {name: bench_inprocess(datasets[name], stages, len(datasets[name])) for name in names}
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        time.sleep(5.0)  # let Ray's prestarted workers settle
        for name in names:
            dataset, base = datasets[name], bases[name]
            shape = [f"{base['mean_len']:.0f}", f"{base['mean_vision']:.0f}", f"{base['payload_kb']:.0f}"]
            rows.append(
                [
                    name,
                    "in-process (no Ray)",
                    f"{base['rate']:.0f}",
                    "-",
                    "-",
                    f"{base['rate']:.0f}",
                    "-",
                    "-",
                    *shape,
                ]
            )
            print(" | ".join(rows[-1]), flush=True)
            first = None
            for k in actors:
                res = bench_pool(dataset, stages, k, args.epochs)[None]
                first = first or res["rate"]
                rows.append(
                    [
                        name,
                        f"{k} actor" + ("s" if k > 1 else ""),
                        f"{res['rate']:.0f}",
                        " / ".join(f"{r:.0f}" for r in res["runs"]),
                        f"{res['rate'] / k:.0f}",
                        f"{res['busy_rate']:.0f}",
                        f"{res['cpu_share']:.2f}",
                        f"{res['rate'] / first:.2f}x",
                        *shape,
                    ]
                )
                print(" | ".join(rows[-1]), flush=True)
            if name == "text" and max(actors) >= 2:
                sweep = bench_pool(dataset, stages, 2, args.epochs, chunk_sizes=(1, 4, 8, 16))
                for chunk, res in sweep.items():
                    sweep_rows.append([chunk, f"{res['rate']:.0f}", f"{res['busy_rate']:.0f}"])
                    print("chunk", " | ".join(str(c) for c in sweep_rows[-1]), flush=True)
    ray.shutdown()
    wall = time.perf_counter() - t_all
    load_end = os.getloadavg()[0]
    machine = (
        f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPU(s), "
        f"{platform.machine()}"
    )
    headers = [
        "workload",
        "config",
        "samples/s",
        "each epoch",
        "per actor",
        "actor-busy rate",
        "actor CPU share",
        "scaling",
        "mean length",
        "mean vision tokens",
        "payload KB",
    ]
    body = [
        "## Preprocessing throughput (Ray actor pool)",
        "",
        f"Generated by `{cmd}` ({wall:.0f} s in all; {revision()}; {machine}; Ray with {os.cpu_count()} "
        "logical CPUs, one per actor). Chain: `default_stages(cutoff=4096)` (Qwen2 template, demo BPE "
        "tokenizer, Qwen2-VL visual tokens with pixel values in the payload). `samples/s` is the median of "
        f"{args.epochs} epochs drained by one `RaySource`; `per actor` = samples/s / actors; `actor-busy "
        "rate` = samples per second of an actor's time inside `process` (its compute rate), and `actor CPU "
        "share` = CPU seconds / wall seconds inside `process` (below 1: the actor waits for a core); "
        "`in-process` runs the same chain in a "
        "loop without Ray. Mean length, vision tokens and payload size (KB per sample, pixel values "
        "included) are per workload. Scaling is relative to 1 actor.",
        "",
        f"1-minute load average: {load_start:.1f} at the start, {load_end:.1f} at the end (on a 2-core "
        "machine shared with other work, a load above 2 means the actors waited for a core: see `actor CPU "
        "share`). With 2 actors on 2 cores the actors also share the cores with the driver (polling, "
        "creating `Sample`s) and Ray's raylet (object store puts and frees), so 2x is out of reach here; "
        "the pool scales with the cores that are free for it.",
        "",
        table(headers, rows),
        "",
        "Chunk size (samples per actor task), text workload, 2 actors: Ray's per-task overhead (submit, "
        "one object per sample, `ray.wait`) matters for cheap text samples.",
        "",
        table(["chunk_size", "samples/s", "actor-busy rate (per actor)"], sweep_rows),
        "",
    ]
    publish(SECTION, body, args.no_write, args.docs, echo=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
