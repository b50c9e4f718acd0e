"""The wall time `[job] deterministic` costs, on the demo and on the bench (docs/benchmarks.md).

Runs interleaved pairs, default and `--deterministic`, the order alternating from pair to pair so that
drift in the machine's speed does not land on one mode, through the real CLI (`batchd demo --json
--no-baseline`, `batchd bench --json --systems ...`), and reports per pair the batchd epoch's wall time
(the trainers' `wall_s`), the ratio deterministic / default, the steps, the final loss and whether the
runs of a mode made the same batches (the demo's `step_digests`). Ratios are taken within a pair: the
machine is shared and noisy, so compare the median ratio, not the seconds.

    python benchmarks/deterministic_cost.py --pairs 3 [--demo-samples 1024] [--bench-samples 512]
        [--demo-actors 2] [--skip-bench] [--json]

`--demo-actors 1` makes preprocessing the slower side (one actor for both ranks), where a deterministic
rank waits for its window's slowest sample.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

BENCH_SYSTEMS = "batchd-balanced,batchd-packed"


def _run(argv: list[str], timeout: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "batchd", *argv, "--json"], capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
            "digest": hash(tuple(s.get("step_digests") or ())),
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


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| pair | default wall s | deterministic wall s | ratio | steps default / det | final loss default / det |",
        "| --: | --: | --: | --: | --: | --: |",
    ]
    for k, p in enumerate(result["demo"], 1):
        a, b = p["default"], p["deterministic"]
        lines.append(
            f"| {k} | {a['wall_s']:.2f} | {b['wall_s']:.2f} | {p['ratio']:.2f} | {a['steps']} / {b['steps']} "
            f"| {a['loss_last']:.3f} / {b['loss_last']:.3f} |"
        )
    lines.append(
        f"\ndemo: median ratio {result['demo_median_ratio']:.2f}; deterministic runs identical: "
        f"{result['demo_deterministic_identical']}; default runs identical: {result['demo_default_identical']}"
    )
    if result.get("bench"):
        lines += [
            "",
            "| pair | system | default wall s | deterministic wall s | ratio | steps default / det |",
            "| --: | --- | --: | --: | --: | --: |",
        ]
        for k, p in enumerate(result["bench"], 1):
            for name, ratio in p["ratio"].items():
                a, b = p["default"][name], p["deterministic"][name]
                lines.append(
                    f"| {k} | {name} | {a['wall_s']:.2f} | {b['wall_s']:.2f} | {ratio:.2f} | "
                    f"{a['steps']} / {b['steps']} |"
                )
        lines.append(
            "\nbench: median ratio per system "
            + ", ".join(f"{n} {r:.2f}" for n, r in result["bench_median_ratio"].items())
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--demo-samples", type=int, default=1024)
    p.add_argument("--demo-actors", type=int, default=2)
    p.add_argument("--bench-samples", type=int, default=512)
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--json", action="store_true")
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
        "pairs": args.pairs,
        "demo_samples": args.demo_samples,
        "demo_actors": args.demo_actors,
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
    print(json.dumps(result) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
