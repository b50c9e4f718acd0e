"""`batchd bench` for the docs: runs it (or reads a saved bench.json) and records section "bench": the
command line, each system's figures, the derived reading and the plots (docs/img/bench_*.png).

Result: benchmarks/results/bench.json (template benchmarks/templates/bench.md.j2).

Usage: python benchmarks/bench_systems.py [--num-samples 1024] [--repeats 1] [--from-json FILE]
       [--out PATH] [--print] [any other `batchd bench` flag after --, e.g. -- --window 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli_runs import machine  # noqa: E402
from _report import REPO, add_common_args, finish, idle_share  # noqa: E402

SECTION = "bench"
IMG = REPO / "docs" / "img"
MEASURES = ["batchd/bench.py", "batchd/_train", "batchd/_model.py", "client", "core", "service"]
SYSTEM_KEYS = (
    "wall_s",
    "wall_s_runs",
    "speedup_vs_fixed",
    "speedup_vs_odb-0.1.2",
    "steps",
    "steps_per_rank",
    "samples",
    "missing",
    "duplicates",
    "padding_efficiency",
    "tokens_per_rank_step",
    "rank_imbalance",
    "stall_fraction",
    "trainer_cpu_s",
    "final_loss",
    "heldout_loss",
    "real_tokens",
    "materialized_tokens",
    "skipped",
)
SETUP_KEYS = (
    "workload",
    "num_samples",
    "mean_length",
    "longest",
    "heldout",
    "world_size",
    "model",
    "lr",
    "seed",
    "token_budget",
    "window",
    "depth",
    "odb_workers",
    "fixed_batch_size",
    "layout",
    "lr_scaling",
)


def reading(systems: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The figures the "Targets and reading" part quotes (None without fixed, ODB and a batchd system)."""
    sy = {k: v for k, v in systems.items() if "wall_s" in v}
    ours = {k: v for k, v in sy.items() if k.startswith("batchd-")}
    if "fixed" not in sy or "odb-0.1.2" not in sy or not ours:
        return None
    best = max(ours, key=lambda k: ours[k]["speedup_vs_fixed"])
    k = min(len(v["loss_curve"]) for v in sy.values()) - 1
    return {
        "best": best,
        "best_vs_fixed": ours[best]["speedup_vs_fixed"],
        "best_vs_odb": ours[best]["speedup_vs_odb-0.1.2"],
        "ours": sorted(ours, key=list(sy).index),
        "loss_step": k + 1,
        "loss_at_step": {n: v["loss_curve"][k] for n, v in sy.items()},
    }


def record(s: dict[str, Any]) -> dict[str, Any]:
    """The JSON-safe figures of one bench output `s` (plots as paths relative to docs/)."""
    rel = [
        Path(p).relative_to(REPO / "docs").as_posix()
        if Path(p).is_absolute() and (REPO / "docs") in Path(p).parents
        else str(p)
        for p in s.get("plots", [])
    ]
    return {
        "setup": {
            **{k: s.get(k) for k in SETUP_KEYS},
            "workload": Path(s["workload"]).name,
        },
        "systems": {n: {k: v[k] for k in SYSTEM_KEYS if k in v} for n, v in s["systems"].items()},
        "order": list(s["systems"]),  # the run's order (the JSON's keys are sorted)
        "reading": reading(s["systems"]),
        "plots": rel,
    }


def from_json(path: Path) -> tuple[dict[str, Any], float]:
    """A saved bench.json, its plots redrawn under docs/img from the saved curves."""
    s = json.loads(Path(path).read_text())
    if s.get("plots"):
        from batchd.bench import write_plots

        title = (
            f"{Path(s['workload']).stem}, {s['num_samples']} samples, N={s['world_size']}, "
            f"L={s['token_budget']}, {s['model']}, {s['device']}"
        )
        s["plots"] = [str(p) for p in write_plots(s["systems"], IMG, title)]
    return s, s.get("total_s", 0.0)


def run(bench_args: list[str]) -> dict[str, Any]:
    """`batchd bench` with the CLI's own flags and defaults, in this process."""
    from batchd.bench import add_arguments, parse_systems, run_bench

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(bench_args)
    return run_bench(
        workload=a.workload,
        num_samples=a.num_samples,
        world_size=a.world_size,
        token_budget=a.token_budget,
        systems=parse_systems(a.systems) if a.systems else None,
        device=a.device,
        model=a.model,
        out=REPO / a.out,
        seed=a.seed,
        window=a.window,
        depth=a.depth,
        heldout=a.heldout,
        odb_workers=a.odb_workers,
        lr=a.lr,
        timeout=a.timeout,
        repeats=a.repeats,
        lr_scaling=a.lr_scaling,
        epochs=a.epochs,
        step_time=a.step_time,
        deterministic=a.deterministic,
        progress=lambda m: print(m, file=sys.stderr, flush=True),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-samples", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--from-json", metavar="FILE", help="record a saved bench.json instead of running")
    ap.add_argument("extra", nargs="*", help="more `batchd bench` flags (after --)")
    add_common_args(ap)
    args = ap.parse_args(argv)
    # --out (a smoke run): the plots and bench.json go to a temp dir, never under docs/img
    img = "docs/img" if args.out is None else tempfile.mkdtemp(prefix="bench-systems-")
    bench_args = ["--num-samples", str(args.num_samples), "--repeats", str(args.repeats), *args.extra]
    t0 = time.perf_counter()
    idle0 = idle_share()
    if args.from_json:
        s, wall = from_json(Path(args.from_json))
    else:
        s = run([*bench_args, "--out", img])
        wall = time.perf_counter() - t0
    data = {
        **record(s),
        "wall_s": wall,
        "idle_before": idle0,
        "idle_after": idle_share(),
        "machine": machine(),
    }
    config = {
        "command": "batchd bench " + " ".join(bench_args),
        "num_samples": args.num_samples,
        "repeats": args.repeats,
        "extra": args.extra,
        "from_json": args.from_json,
    }
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
