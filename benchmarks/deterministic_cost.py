"""The wall time `[job] deterministic` costs, on the demo and on the bench (section "deterministic").

Runs interleaved pairs, default and `--deterministic`, the order alternating from pair to pair so that
drift in the machine's speed does not land on one mode, through the real CLI (`batchd demo --json
--no-baseline`, `batchd bench --json --systems ...`), and records per pair the batchd epoch's wall time
(the trainers' `wall_s`), the ratio deterministic / default, the steps, the final loss and whether the
runs of a mode made the same batches (the demo's `step_digests`). Ratios are taken within a pair: the
machine is shared and noisy, so compare the median ratio, not the seconds.

Result: benchmarks/results/deterministic.json (template benchmarks/templates/deterministic.md.j2).

    python benchmarks/deterministic_cost.py --pairs 3 [--demo-samples 1024] [--bench-samples 512]
        [--demo-actors 2] [--skip-bench] [--out PATH] [--print]

`--demo-actors 1` makes preprocessing the slower side (one actor for both ranks), where a deterministic
rank waits for its window's slowest sample.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli_runs import cli_json, command, machine  # noqa: E402
from _report import add_common_args, finish  # noqa: E402

SECTION = "deterministic"
MEASURES = [
    "batchd/demo.py",
    "batchd/_demo_ray.py",
    "batchd/_demo_run.py",
    "batchd/bench.py",
    "core",
    "service",
]
BENCH_SYSTEMS = "batchd-balanced,batchd-packed"


def _run(argv: list[str], timeout: float) -> dict[str, Any]:
    return cli_json(argv, timeout)[0]


def _digest(steps: list[str] | None) -> str:
    """One stable fingerprint of a run's batches (its `step_digests`)."""
    return hashlib.sha256("".join(steps or ()).encode()).hexdigest()[:16]


def demo_pair(k: int, samples: int, actors: int, timeout: float) -> dict[str, Any]:
    """One pair of demos (default, deterministic; the order alternates with k): wall, steps, loss, digests."""
    out: dict[str, Any] = {}
    for det in (False, True) if k % 2 == 0 else (True, False):
        s = _run(
            ["demo", "--no-baseline", "--num-samples", str(samples), "--num-actors", str(actors)]
            + (["--deterministic"] if det else []),
            timeout,
        )
        out["deterministic" if det else "default"] = {
            "wall_s": s["wall_s"],
            "steps": s["steps_per_rank"][0],
            "loss_last": s["loss_last"],
            "digest": _digest(s.get("step_digests")),
            "stall": s["preprocess"]["stall_fraction"],
        }
    out["ratio"] = out["deterministic"]["wall_s"] / out["default"]["wall_s"]
    return out


def bench_pair(k: int, samples: int, timeout: float) -> dict[str, Any]:
    """One pair of bench runs over the batchd systems; wall time and steps per system and mode."""
    out: dict[str, Any] = {}
    for det in (False, True) if k % 2 == 0 else (True, False):
        s = _run(
            ["bench", "--systems", BENCH_SYSTEMS, "--num-samples", str(samples)]
            + (["--deterministic"] if det else []),
            timeout,
        )
        out["deterministic" if det else "default"] = {
            name: {"wall_s": r["wall_s"], "steps": r["steps"], "heldout_loss": r["heldout_loss"]}
            for name, r in s["systems"].items()
        }
    out["ratio"] = {
        name: out["deterministic"][name]["wall_s"] / out["default"][name]["wall_s"] for name in out["default"]
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--demo-samples", type=int, default=1024)
    p.add_argument("--demo-actors", type=int, default=2)
    p.add_argument("--bench-samples", type=int, default=512)
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    add_common_args(p)
    args = p.parse_args(argv)
    demo = []
    for k in range(args.pairs):
        demo.append(demo_pair(k, args.demo_samples, args.demo_actors, args.timeout))
        print(
            f"[deterministic_cost] demo pair {k + 1}: ratio {demo[-1]['ratio']:.2f}",
            file=sys.stderr,
            flush=True,
        )
    result: dict[str, Any] = {
        "demo": demo,
        "demo_median_ratio": statistics.median(p["ratio"] for p in demo),
        "demo_deterministic_identical": len({p["deterministic"]["digest"] for p in demo}) == 1,
        "demo_default_identical": len({p["default"]["digest"] for p in demo}) == 1,
    }
    if not args.skip_bench:
        bench = []
        for k in range(args.pairs):
            bench.append(bench_pair(k, args.bench_samples, args.timeout))
            print(
                f"[deterministic_cost] bench pair {k + 1}: {bench[-1]['ratio']}", file=sys.stderr, flush=True
            )
        result["bench"] = bench
        result["bench_median_ratio"] = {
            n: statistics.median(p["ratio"][n] for p in bench) for n in bench[0]["ratio"]
        }
    config = {
        "command": command("deterministic_cost.py", list(argv if argv is not None else sys.argv[1:])),
        **{k: v for k, v in vars(args).items() if k not in ("out", "print")},
        "bench_systems": BENCH_SYSTEMS,
    }
    finish(args, SECTION, {**result, "machine": machine()}, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
