"""The `batchd` command line: `batchd simulate` (more subcommands arrive with the daemon)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from batchd.core import COST_MODELS, MODES, OVER_BUDGET, POLICIES, SimConfig, read_lengths, simulate


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="run N virtual ranks and the coordinator over a length file (the daemon's core code)",
        description="Simulates one epoch of batchd over realized lengths (one integer per line; the sample "
        "id is the 0-based line number) and prints the batching metrics.",
    )
    p.add_argument("--lengths", required=True, metavar="FILE", help="one integer length per line")
    p.add_argument("--world-size", type=_positive, required=True, metavar="N", help="number of ranks")
    p.add_argument("--token-budget", type=_positive, required=True, metavar="L", help="L_max per rank step")
    p.add_argument("--policy", choices=POLICIES, default="local", help="grouping policy (default: local)")
    p.add_argument("--window", type=_positive, default=512, metavar="W", help="per-rank buffer in samples")
    p.add_argument("--batch-size", type=_positive, default=8, metavar="B", help="B of fixed/sorted")
    p.add_argument("--mode", choices=MODES, default="join", help="termination mode (default: join)")
    p.add_argument("--cost", choices=COST_MODELS, default="padded", help="cost model (default: padded)")
    p.add_argument("--over-budget", choices=OVER_BUDGET, default="singleton",
                   help="samples longer than L (default: singleton)")
    p.add_argument("--seed", type=int, default=0, help="seeds views and emission order")
    p.add_argument("--shuffle", action="store_true", help="permute ids before splitting them over ranks")
    p.add_argument("--depth", type=_positive, default=8, metavar="D",
                   help="output slots per rank (alignment capacity)")
    p.add_argument("--max-wait", type=_positive, default=16, help="rounds a sample may wait in a window")
    p.add_argument("--align", choices=("min", "odb"), default="min",
                   help="DGAP target rule (policy odb always uses odb)")
    p.add_argument("--quota", type=int, default=None, help="non-join sample quota (default: all samples)")
    p.add_argument("--no-refine", action="store_true", help="balanced: skip the capacity binary search")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    lengths = read_lengths(args.lengths)
    config = SimConfig(
        world_size=args.world_size, token_budget=args.token_budget, policy=args.policy, window=args.window,
        batch_size=args.batch_size, mode=args.mode, cost=args.cost, over_budget=args.over_budget,
        seed=args.seed, shuffle=args.shuffle, depth=args.depth, max_wait=args.max_wait, align=args.align,
        refine=not args.no_refine, quota=args.quota,
    )
    result = simulate(lengths, config)
    if args.json:
        print(json.dumps(result))
    else:
        width = max(len(k) for k in result)
        for key, value in result.items():
            if isinstance(value, float):
                value = f"{value:.4f}"
            print(f"{key:<{width}}  {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchd", description="batchd: token-budget batching as a service.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_simulate(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"batchd {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
