"""Optimizer updates replayed in one process: the held-out loss each system's updates give, over seeds.

Section "bench-updates" runs the systems for real (N gloo trainers, the daemon, ODB 0.1.2), a few
minutes per seed. What its held-out loss depends on is only how the epoch's samples are cut into
optimizer updates: every system's update gradient is the per-token mean over the update's samples
on all ranks (tests check that against a single-process reference), AdamW steps once per update at
the recipe's rate. So one process that steps AdamW once per update, on that per-token mean, gives the
same held-out loss as the distributed run (fixed, seed 0: 4.6472 both ways), deterministically and
at a fraction of the cost, and many seeds show what a seed-to-seed spread of three hides.

Systems (the bench's setup: odb-synthetic's first 1,024 lengths, the next 64 held out, N=2, L=8192,
window 128, depth 8, the tiny model, AdamW lr 1e-3 constant; G = C / 16, C the epoch's loss tokens,
i.e. fixed batching's mean per update):

- `fixed`: B=2 per rank, K=16 steps per update (the recipe: 64 samples per update).
- `stream`: the same sample stream (fixed's order), an update ending at the first sample at which the
  running loss tokens reach k x G (`UpdateWindows`, rule cumulative): updates of G tokens of a random
  stream, what token-count updates can best be.
- `batchd-packed` / `batchd-balanced`: the steps of `batchd.core.Simulator` (the daemon's planner,
  deterministic) for policy balanced with packed / padded rows, cut into updates by `UpdateWindows`
  with the samples' real loss tokens; `-unmixed` plans without `tokens_per_update`, so without the
  plan's mixing (`PlanInputs.mix`), as the planner did before it.

Per system: the held-out loss per seed, its mean and standard deviation, the mean's difference to
fixed's, the samples per update (min / max over the seeds) and the length CV (the coefficient of
variation over an epoch's updates of each update's mean sample length; the mean over seeds).

Result: benchmarks/results/update-replay.json (template benchmarks/templates/update-replay.md.j2).

Usage: python benchmarks/update_replay.py [--seeds 6] [--jobs 2] [--systems ...] [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import DEFAULT_WORKLOADS, add_common_args, command_line, finish  # noqa: E402

from batchd.core import CostModel, JobSpec, PolicySpec, Simulator, Updates, epoch_permutation  # noqa: E402
from batchd.testing import UpdateWindows  # noqa: E402

SECTION = "update-replay"
MEASURES = ("benchmarks/update_replay.py", "core")
SYSTEMS = (
    "fixed",
    "stream",
    "batchd-packed-unmixed",
    "batchd-packed",
    "batchd-balanced-unmixed",
    "batchd-balanced",
)
WORLD, BUDGET, SAMPLES, HELDOUT, UPDATES, BATCH, LR = 2, 8192, 1024, 64, 16, 2, 1e-3


def _lengths(workloads: Path) -> list[int]:
    return [int(x) for x in (workloads / "odb-synthetic.txt").read_text().split()][: SAMPLES + HELDOUT]


def _loss_tokens(lengths: list[int], seed: int) -> list[int]:
    from batchd.client import loss_tokens
    from batchd.testing import bench_payload

    return [loss_tokens(bench_payload(i, lengths, seed)["labels"]) for i in range(SAMPLES)]


def _cut(steps: list[list[int]], tokens: list[int], g: int) -> list[list[int]]:
    """The steps' samples cut into updates by `UpdateWindows` (cumulative, G = `g`), one epoch."""
    windows, out, cur = UpdateWindows(g, "tokens", "cumulative"), [], []
    ends = windows.close([len(s) for s in steps], [sum(tokens[i] for i in s) for s in steps], True).ends
    for step, end in zip(steps, ends, strict=True):
        cur += step
        if end:
            out.append(cur)
            cur = []
    return out


def partition(system: str, lengths: list[int], tokens: list[int], seed: int) -> list[list[int]]:
    """The epoch's updates of `system` (module docstring), each a list of sample ids."""
    g = -(-sum(tokens) // UPDATES)
    perm = epoch_permutation(SAMPLES, seed, 0)
    views = [perm[r::WORLD].tolist() for r in range(WORLD)]
    fixed_steps = [[i for v in views for i in v[k : k + BATCH]] for k in range(0, len(views[0]), BATCH)]
    if system == "fixed":
        return [sum(fixed_steps[u : u + UPDATES], []) for u in range(0, len(fixed_steps), UPDATES)]
    if system == "stream":
        return _cut([[i] for step in fixed_steps for i in step], tokens, g)
    _, layout, *unmixed = system.split("-")
    spec = JobSpec(
        world_size=WORLD,
        token_budget=BUDGET,
        seed=seed,
        policy=PolicySpec(
            name="balanced", window=128, depth=8, collate="packed" if layout == "packed" else "padded"
        ),
        cost=CostModel(name="packed" if layout == "packed" else "padded"),
        updates=Updates(tokens_per_update=None if unmixed else g),
    )
    sim = Simulator(lengths[:SAMPLES], spec)
    steps = [[s.id for step in per_rank for s in step.samples] for per_rank in sim]
    return _cut([s for s in steps if s], tokens, g)


def replay(updates: list[list[int]], lengths: list[int], seed: int) -> float:
    """AdamW (lr `LR`) stepped once per update on the per-token mean over its samples, from the
    bench's model at `seed`; returns the per-token loss on the held-out samples."""
    import torch

    from batchd.client import collate_packed, forward_logits, token_loss_sum
    from batchd.testing import bench_model, bench_payload

    torch.set_num_threads(1)
    model = bench_model("tiny", seed, max(lengths) + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for ids in updates:
        opt.zero_grad()
        payloads = sorted((bench_payload(i, lengths, seed) for i in ids), key=lambda p: -len(p["input_ids"]))
        rows: list[list[dict[str, Any]]] = [[]]
        for p in payloads:  # packed rows of at most L tokens: varlen attention, one sample per block
            if rows[-1] and sum(len(q["input_ids"]) for q in rows[-1]) + len(p["input_ids"]) > BUDGET:
                rows.append([])
            rows[-1].append(p)
        total = sum(int((p["labels"][1:] != -100).sum()) for p in payloads)
        for row in rows:
            batch = collate_packed(row)
            s, _ = token_loss_sum(forward_logits(model, batch), batch["labels"])
            (s / total).backward()
        opt.step()
    model.eval()
    loss, count = 0.0, 0
    with torch.no_grad():
        for i in range(SAMPLES, SAMPLES + HELDOUT):
            batch = collate_packed([bench_payload(i, lengths, seed)])
            s, n = token_loss_sum(forward_logits(model, batch), batch["labels"])
            loss, count = loss + float(s), count + n
    return loss / count


def run_one(system: str, seed: int, workloads: str) -> dict[str, Any]:
    lengths = _lengths(Path(workloads))
    tokens = _loss_tokens(lengths, seed)
    updates = partition(system, lengths, tokens, seed)
    means = [statistics.fmean(lengths[i] for i in u) for u in updates]
    return {
        "system": system,
        "seed": seed,
        "updates": len(updates),
        "samples": [len(u) for u in updates],
        "length_cv": statistics.pstdev(means) / statistics.fmean(means),
        "heldout": replay(updates, lengths, seed),
    }


def aggregate(runs: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in systems:
        per = sorted((r for r in runs if r["system"] == name), key=lambda r: r["seed"])
        held = [r["heldout"] for r in per]
        out[name] = {
            "heldout": held,
            "mean": statistics.fmean(held),
            "sd": statistics.stdev(held) if len(held) > 1 else 0.0,
            "updates": sorted({r["updates"] for r in per}),
            "samples_min": min(min(r["samples"]) for r in per),
            "samples_max": max(max(r["samples"]) for r in per),
            "length_cv": statistics.fmean(r["length_cv"] for r in per),
        }
    if "fixed" in out:
        for v in out.values():
            v["vs_fixed"] = v["mean"] - out["fixed"]["mean"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--jobs", type=int, default=2, help="replays run in parallel, one thread each")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    add_common_args(ap)
    args = ap.parse_args(argv)
    systems = args.systems.split(",")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        ap.error(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    t0 = time.perf_counter()
    tasks = [(s, seed) for seed in range(args.seeds) for s in systems]
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_one, s, seed, str(args.workloads)) for s, seed in tasks]
        runs = []
        for f in futures:
            runs.append(f.result())
            r = runs[-1]
            print(f"{r['system']} seed {r['seed']}: held-out {r['heldout']:.4f}", file=sys.stderr, flush=True)
    data = {"systems": aggregate(runs, systems), "order": systems, "runs": runs}
    data["wall_s"] = time.perf_counter() - t0
    config = {"seeds": args.seeds, "jobs": args.jobs, "systems": systems}
    config["command"] = command_line(__file__, argv)
    config.update(world_size=WORLD, token_budget=BUDGET, num_samples=SAMPLES, heldout=HELDOUT)
    config.update(updates=UPDATES, batch_size=BATCH, lr=LR, window=128, depth=8)
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
