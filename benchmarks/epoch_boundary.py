"""The trainer's stall at an epoch boundary: how long the first batch of epoch e+1 takes to arrive.

A rank service starts epoch e+1 only once its trainer has taken the end of epoch e (every step
acknowledged): until then the batches it holds must stay available to a restarted trainer. So the
first batch of a new epoch waits for one window fill from the source and one alignment round, while
inside an epoch the service works `depth` batches ahead and the trainer rarely waits.

Setup: one child process (multiprocessing, spawn) runs the coordinator and 2 rank services
(`RankServiceCore` + gRPC servers on loopback), job spec L=8192, policy balanced, window 512, depth 8,
padded collation, 3 epochs, over one of two sources:

- `synthetic`: `SyntheticSource` over the first 2,048 odb-synthetic lengths (payloads generated in the
  service process);
- `ray`: `RaySource` per rank on one shared `PreprocessPool` of 2 Ray actors (local Ray, 2 CPUs) over
  the demo dataset (`make_demo_dataset`, 600 chat / image records: chat template, tokenization,
  visual-token expansion), so each new epoch re-preprocesses its window.

This process runs 2 trainer threads (`BatchClient`, credits 4) that spend `--step-ms` per batch (a stand-in
for the GPU step; sleep, so both threads run at once) and record how long each `next()` blocked.
Reported per source: the median and p95 wait inside epochs (after each epoch's first batch), and the
wait for the first batch of epochs 1 and 2 (the slower rank's), next to epoch 0's start for reference.

The result goes to benchmarks/results/epoch-boundary.json (template: templates/epoch-boundary.md.j2).

Usage: python benchmarks/epoch_boundary.py [--step-ms 20] [--sources synthetic,ray] [--samples N]
       [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import DEFAULT_WORKLOADS, add_common_args, command_line, finish, idle_share  # noqa: E402

SECTION = "epoch-boundary"
MEASURES = ("benchmarks/epoch_boundary.py", "core", "proto", "service", "client")
WORLD, BUDGET, WINDOW, DEPTH, EPOCHS = 2, 8192, 512, 8, 3
SYNTHETIC_SAMPLES, RAY_RECORDS = 2048, 600


def job_spec():
    from batchd.core import JobSpec, PolicySpec

    return JobSpec(
        world_size=WORLD,
        token_budget=BUDGET,
        seed=0,
        epochs=EPOCHS,
        policy=PolicySpec(name="balanced", window=WINDOW, depth=DEPTH, collate="padded"),
    )


def service_main(conn, source_kind: str, lengths: list[int]) -> None:
    """Coordinator + WORLD rank services in this process until told to stop."""
    from batchd.service import CoordinatorClient, RankServiceCore, create_rank_server, create_server
    from batchd.service.preprocess import SyntheticSource

    spec = job_spec()
    pool = None
    if source_kind == "ray":
        from batchd.service.preprocess import (
            RaySource,
            default_stages,
            demo_tokenizer,
            make_demo_dataset,
            start_local_ray,
        )
        from batchd.testing import PreprocessPool

        start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
        work = Path(tempfile.mkdtemp(prefix="batchd-epoch-bench-"))
        demo = make_demo_dataset(work / "demo", num_samples=RAY_RECORDS, seed=1, format="jsonl")
        tok = demo_tokenizer(work / "tokenizer.json")
        pool = PreprocessPool(demo.path, default_stages(tok, cutoff=4096), num_actors=2, actor_num_cpus=1.0)
        sources = [RaySource(None, r, WORLD, seed=spec.seed, epoch=0, pool=pool) for r in range(WORLD)]
    else:
        sources = [SyntheticSource(lengths, r, WORLD, spec.seed, 0, spec.shuffle) for r in range(WORLD)]
    cserver, cport, cstate = create_server("127.0.0.1:0", spec)
    cserver.start()
    parts = []
    for r in range(WORLD):
        coord = CoordinatorClient(f"127.0.0.1:{cport}", r, spec)
        core = RankServiceCore(r, spec, coord, sources[r])
        server, port = create_rank_server("127.0.0.1:0", core)
        server.start()
        core.start(f"127.0.0.1:{port}")
        parts.append((core, coord, server, port))
    conn.send([p[3] for p in parts])
    conn.recv()  # "stop"
    conn.send([core.failure for core, *_ in parts])
    for core, coord, server, _ in parts:
        core.stop()
        coord.close()
        server.stop(0)
    cserver.stop(0)
    cstate.close()
    if pool is not None:
        pool.close()


def trainer(port: int, rank: int, step_s: float, out: list) -> None:
    from batchd.client import BatchClient

    waits: list[list[float]] = []
    with BatchClient(f"127.0.0.1:{port}", rank, WORLD) as client:
        for epoch in range(client.job_epochs()):
            client.set_epoch(epoch)
            it = iter(client)
            epoch_waits = []
            while True:
                t0 = time.perf_counter()
                try:
                    next(it)
                except StopIteration:
                    break
                epoch_waits.append(time.perf_counter() - t0)
                time.sleep(step_s)
            waits.append(epoch_waits)
    out[rank] = waits


def run(source_kind: str, lengths: list[int], step_ms: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=service_main, args=(child, source_kind, lengths), daemon=True)
    proc.start()
    try:
        if not parent.poll(300):
            raise RuntimeError(f"{source_kind}: the services did not start")
        ports = parent.recv()
        out: list = [None] * WORLD
        t0 = time.perf_counter()
        threads = [
            threading.Thread(target=trainer, args=(ports[r], r, step_ms / 1000, out)) for r in range(WORLD)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        parent.send("stop")
        failures = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.terminate()
    if any(failures) or any(o is None for o in out):
        raise RuntimeError(f"{source_kind}: failed: {failures}")
    inner = [w * 1000 for rank in out for ep in rank for w in ep[1:]]
    first = [max(out[r][e][0] for r in range(WORLD)) * 1000 for e in range(EPOCHS)]
    steps = [len(out[0][e]) for e in range(EPOCHS)]
    return {
        "source": source_kind,
        "steps": steps,
        "wall_s": wall,
        "inner_median_ms": statistics.median(inner),
        "inner_p95_ms": statistics.quantiles(inner, n=20)[-1],
        "first_ms": first,
    }


HEADERS = ["source", "steps per epoch", "in-epoch wait median ms", "p95 ms", "epoch 0 start ms"]
HEADERS += ["epoch 1 start ms", "epoch 2 start ms", "boundary / step time"]


def _row(r: dict[str, Any], step_ms: float) -> list[object]:
    first = r["first_ms"]
    return [r["source"], "/".join(map(str, r["steps"])), f"{r['inner_median_ms']:.1f}"] + [
        f"{r['inner_p95_ms']:.1f}",
        *(f"{x:.0f}" for x in first),
        f"{max(first[1:]) / step_ms:.1f}",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--step-ms", type=float, default=20.0, help="trainer time per batch (sleep)")
    ap.add_argument("--sources", default="synthetic,ray", help="comma-separated: synthetic, ray")
    ap.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    ap.add_argument("--samples", type=int, default=SYNTHETIC_SAMPLES, help="synthetic source's lengths")
    add_common_args(ap)
    args = ap.parse_args(argv)
    from batchd import read_lengths

    lengths = read_lengths(args.workloads / "odb-synthetic.txt")[: args.samples]
    idle_before = idle_share()
    t_start = time.perf_counter()
    results = [run(s, lengths, args.step_ms) for s in args.sources.split(",")]
    elapsed = time.perf_counter() - t_start
    data = {"headers": HEADERS, "rows": [_row(r, args.step_ms) for r in results], "runs": results}
    data.update(wall_s=elapsed, idle_before=idle_before, idle_after=idle_share())
    data["python"] = platform.python_version()
    config = {"command": command_line(__file__, argv), "step_ms": args.step_ms, "sources": args.sources}
    config.update(samples=len(lengths), ray_records=RAY_RECORDS, world=WORLD, budget=BUDGET)
    config.update(window=WINDOW, depth=DEPTH, epochs=EPOCHS, credits=4)
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
