"""`batchd bench` with the tiny MLLM: two-phase vs one-phase batchd vs ODB 0.1.2 vs fixed, and the
encoder's share of a step (result benchmarks/results/mllm-bench.json, template mllm-bench.md.j2).

1. Runs `batchd bench` on a multimodal workload (`benchmarks/workloads/*.csv`, docs/workloads.md): every
   system trains `batchd.TinyMLLM` (a patch-embedding vision encoder with per-image attention, a 2x2
   merger/projector, the tiny causal LM) on the same synthetic samples and images, N gloo DDP ranks on CPU.
   Systems: `fixed`, `odb-0.1.2`, `batchd-balanced` (one phase: every rank encodes its own samples'
   images) and `batchd-2phase` (the vision encoder balanced per step, one all-to-all of embeddings).
   Per system: wall time, steps, padding efficiency, the encoder's per-step imbalance (max / mean of the
   patches the ranks encoded, mean over steps with images), final and held-out loss.
2. Measures the encoder's share of a training step: for `SHARE_GROUPS` groups of the workload's samples
   (length-sorted runs under the token budget, as batchd forms them), the forward + backward time of the
   encoder alone and of the whole model (one thread, least of 2 runs), and the share = encoder / whole.
3. Says what the gain should be: a step waits for its slowest rank in each phase, so with encoder share s
   of a step and encoder imbalance v1 (one phase) vs v2 (two phase), the step's encoder part shrinks by
   about s x (1 - v2 / v1) (the LLM part is the same plan in both).

Usage: python benchmarks/mllm_bench.py [--workload NAME] [--num-samples 192] [--world-size 2] [--out PATH]
       [--print]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli_runs import command, machine  # noqa: E402
from _harness import free_port  # noqa: E402
from _report import REPO, add_common_args, finish  # noqa: E402

SECTION = "mllm-bench"
WORKLOADS = REPO / "benchmarks" / "workloads"
SHARE_GROUPS = 6
MEASURES = ["batchd/bench.py", "batchd/_train", "batchd/_mllm.py", "client", "core", "service"]


def encoder_share(workload: Path, num_samples: int, token_budget: int, seed: int = 0) -> dict[str, float]:
    """Encoder / whole-model forward+backward time over length-sorted groups of the workload's samples."""
    import torch

    from batchd import read_workload
    from batchd.client import collate_padded
    from batchd.testing import bench_model as build_model
    from batchd.testing import bench_payload as payload
    from batchd.testing import to_torch

    torch.set_num_threads(1)
    samples = read_workload(workload)[:num_samples]
    lengths = [s.length for s in samples]
    images = [[list(im) for im in s.images] for s in samples]
    order = sorted(range(len(samples)), key=lambda i: lengths[i])
    groups, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > token_budget:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    step = max(1, len(groups) // SHARE_GROUPS)
    picked = [g for g in groups[::step] if any(images[i] for i in g)][:SHARE_GROUPS]
    model = build_model("tiny", seed, max(lengths) + 1, images=True)
    enc_t, all_t = [], []
    for g in picked:
        batch = to_torch(collate_padded([payload(i, lengths, seed, images) for i in g]))

        def enc(batch=batch):
            model.zero_grad(set_to_none=True)
            model.encode(batch).sum().backward()

        def whole(batch=batch):
            model.zero_grad(set_to_none=True)
            model(batch).float().logsumexp(-1).mean().backward()

        for fn, out in ((enc, enc_t), (whole, all_t)):
            best = float("inf")
            for _ in range(2):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            out.append(best)
    return {
        "groups": len(picked),
        "encoder_s": sum(enc_t),
        "whole_s": sum(all_t),
        "share": sum(enc_t) / sum(all_t) if sum(all_t) else float("nan"),
        "share_median": statistics.median(e / a for e, a in zip(enc_t, all_t, strict=False)),
    }


def _exchange_worker(
    rank: int, world: int, port: int, rows: list[list[int]], d_model: int, repeats: int, out
) -> None:
    import torch
    import torch.distributed as dist

    from batchd.client import exchange_image_embeddings

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        times = []
        for send in rows:  # send[r][d]: rows r sends to d; one image per (r, d) pair is enough for timing
            recv = [send[e][rank] for e in range(world)]
            tokens = [n for n in recv if n]
            batch = {
                "vision_send_splits": torch.tensor(send[rank]),
                "vision_recv_splits": torch.tensor(recv),
                "vision_image_tokens": torch.tensor(tokens, dtype=torch.int64),
                "vision_placement": torch.arange(len(tokens)),
            }
            enc = torch.randn(sum(send[rank]), d_model, requires_grad=True)
            best = float("inf")
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                exchange_image_embeddings(enc, batch).sum().backward()
                best = min(best, time.perf_counter() - t0)
            times.append(best)
        out.put((rank, times))
    finally:
        dist.destroy_process_group()


def exchange_time(
    workload: Path,
    num_samples: int,
    world: int,
    token_budget: int,
    window: int,
    d_model: int = 128,
    repeats: int = 3,
) -> dict[str, float]:
    """Forward + backward time of `exchange_image_embeddings` (gloo, `world` processes on this host)
    for the exchanges the two-phase plan makes on this workload's steps (the simulator's plan, same
    spec as the bench): the all-to-all the trainers run, without the model around it."""
    import torch.multiprocessing as mp

    from batchd import read_workload
    from batchd.core import JobSpec, Phases, PolicySpec, Simulator

    spec = JobSpec(
        world_size=world,
        token_budget=token_budget,
        policy=PolicySpec(name="balanced", window=window, depth=8),
        phases=Phases(count=2),
    )
    rows = []
    for step in Simulator(read_workload(workload)[:num_samples], spec):
        send = [[0] * world for _ in range(world)]
        for st in step:
            for im in st.exchange.encode:
                send[st.info.rank][im.owner] += im.tokens
        if any(any(r) for r in send):
            rows.append(send)
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_exchange_worker, args=(r, world, port, rows, d_model, repeats, q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    per_step = [max(got[r][k] for r in got) for k in range(len(rows))]
    moved = [sum(send[e][d] for e in range(world) for d in range(world) if e != d) for send in rows]
    return {
        "steps": len(rows),
        "mean_s": statistics.fmean(per_step),
        "rows_per_step": statistics.fmean(moved),
        "d_model": d_model,
    }


SYSTEM_KEYS = (
    "wall_s",
    "speedup_vs_fixed",
    "speedup_vs_odb-0.1.2",
    "steps",
    "samples",
    "missing",
    "duplicates",
    "padding_efficiency",
    "vision_imbalance",
    "final_loss",
    "heldout_loss",
    "skipped",
)


def record(s: dict[str, Any], share: dict[str, float], exch: dict[str, float]) -> dict[str, Any]:
    """The figures the section shows: per system, the encoder share, the exchange's time and the
    two-phase saving expected (share x (1 - v2 / v1)) and measured."""
    systems = {n: {k: v[k] for k in SYSTEM_KEYS if k in v} for n, v in s["systems"].items()}
    one, two = systems.get("batchd-balanced", {}), systems.get("batchd-2phase", {})
    v1, v2 = one.get("vision_imbalance"), two.get("vision_imbalance")
    step_s = two["wall_s"] / two["steps"] if "wall_s" in two and two["steps"] else None
    both = bool(v1 and v2 and "wall_s" in one and "wall_s" in two)
    return {
        "setup": {
            "workload": Path(s["workload"]).name,
            **{k: s.get(k) for k in ("num_samples", "images", "world_size", "token_budget", "window")},
        },
        "systems": systems,
        "order": list(systems),  # the run's order (the JSON's keys are sorted)
        "share": share,
        "exchange": {**exch, "step_s": step_s, "of_step": exch["mean_s"] / step_s if step_s else None},
        "two_phase": {
            "v1": v1,
            "v2": v2,
            "expected_saving": share["share"] * (1 - v2 / v1) if both else None,
            "measured_saving": 1 - two["wall_s"] / one["wall_s"] if both else None,
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workload", default="bimodal", help="a workload of benchmarks/workloads (default bimodal)"
    )
    p.add_argument("--num-samples", type=int, default=192)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)
    add_common_args(p)
    args = p.parse_args(argv)
    from batchd.bench import MM_SYSTEMS, run_bench

    workload = WORKLOADS / f"{args.workload}.csv"
    t0 = time.perf_counter()
    s = run_bench(
        workload=workload,
        num_samples=args.num_samples,
        world_size=args.world_size,
        token_budget=args.token_budget,
        systems=MM_SYSTEMS,
        window=args.window,
        depth=8,  # as recorded (the spec's default is 4)
        heldout=16,
        repeats=args.repeats,
        plots=False,
        progress=lambda m: print(m, file=sys.stderr, flush=True),
    )
    share = encoder_share(workload, args.num_samples, args.token_budget)
    exch = exchange_time(workload, args.num_samples, args.world_size, args.token_budget, args.window)
    data = {**record(s, share, exch), "wall_s": time.perf_counter() - t0, "machine": machine()}
    config = {
        "command": command("mllm_bench.py", argv if argv is not None else sys.argv[1:]),
        **{k: v for k, v in vars(args).items() if k not in ("out", "print")},
    }
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
