"""Throughput of the Ray preprocessing pipeline: samples/s per actor, text and image samples, 1 vs 2 actors.

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

Result: benchmarks/results/preprocess.json (template benchmarks/templates/preprocess.md.j2).

Usage: python benchmarks/preprocess_throughput.py [--samples N] [--epochs E] [--actors 1,2] [--out PATH]
       [--print]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli_runs import command, load_average, machine  # noqa: E402
from _report import add_common_args, finish  # noqa: E402

SECTION = "preprocess"
MEASURES = ["service/preprocess"]
CHUNK_SIZES = (1, 4, 8, 16)
WORKLOADS = {  # name -> (image_fraction, max_image_side, share of --samples)
    "text": (0.0, 224, 1.0),
    "image": (1.0, 224, 0.5),
    "image-large": (1.0, 672, 0.2),
}


def make_data(root: Path, name: str, n: int) -> Any:
    from batchd.service.preprocess import make_demo_dataset

    frac, side, _ = WORKLOADS[name]
    return make_demo_dataset(
        root / name, num_samples=n, seed=11, image_fraction=frac, bad_fraction=0.0, max_image_side=side
    )


def bench_inprocess(dataset, stages, limit: int) -> dict[str, float]:
    from batchd.service.preprocess import Preprocessor

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
    from batchd.service.preprocess import EXHAUSTED, RaySource, StreamOptions

    options = StreamOptions(chunk_size=chunk_size) if chunk_size else None
    src = RaySource(None, 0, 1, seed=0, epoch=epoch, pool=pool, options=options)
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
    from batchd.testing import PreprocessPool

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


def measure(
    name: str, dataset: Any, stages: Any, base: dict[str, float], actors: list[int], epochs: int
) -> dict[str, Any]:
    """One workload: the in-process rate and, per pool size, the pool's rates with the scaling against
    the first pool size (and for `text` with 2 or more actors, the chunk-size sweep)."""
    pools: dict[str, dict[str, Any]] = {}
    first = None
    for k in actors:
        res = bench_pool(dataset, stages, k, epochs)[None]
        first = first or res["rate"]
        pools[str(k)] = {**res, "per_actor": res["rate"] / k, "scaling": res["rate"] / first}
        print(name, k, json.dumps(pools[str(k)]), flush=True)
    sweep = None
    if name == "text" and max(actors) >= 2:
        by_chunk = bench_pool(dataset, stages, 2, epochs, chunk_sizes=CHUNK_SIZES)
        sweep = [{"chunk_size": c, **res} for c, res in by_chunk.items()]
    return {"in_process": base, "pools": pools, "sweep": sweep}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=1200, help="records of the text workload (images: fewer)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per configuration (median reported)")
    ap.add_argument("--actors", default="1,2", help="pool sizes (default 1,2)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    add_common_args(ap)
    args = ap.parse_args(argv)

    import ray

    from batchd.service.preprocess import (
        RecordDataset,
        TokenizerRef,
        default_stages,
        demo_tokenizer,
        start_local_ray,
    )

    t_all = time.perf_counter()
    load_start = load_average()
    actors = [int(a) for a in args.actors.split(",")]
    names = args.workloads.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tok = TokenizerRef(demo_tokenizer(Path(tmp) / "tokenizer.json"))
        stages = default_stages(tok, cutoff=4096)
        datasets = {
            name: RecordDataset(
                make_data(Path(tmp), name, max(int(args.samples * WORKLOADS[name][2]), 20)).path
            )
            for name in names
        }
        # The in-process baselines run before Ray starts (its worker start-up would steal CPU).
        bases = {name: bench_inprocess(datasets[name], stages, len(datasets[name])) for name in names}
        start_local_ray(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        time.sleep(5.0)  # let Ray's prestarted workers settle
        workloads = {n: measure(n, datasets[n], stages, bases[n], actors, args.epochs) for n in names}
    ray.shutdown()
    data = {
        "workloads": workloads,
        "load_start": load_start,
        "load_end": load_average(),
        "wall_s": time.perf_counter() - t_all,
        "machine": machine(),
    }
    config = {
        "command": command("preprocess_throughput.py", list(argv if argv is not None else sys.argv[1:])),
        "samples": args.samples,
        "epochs": args.epochs,
        "actors": actors,
        "workloads": names,
    }
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
