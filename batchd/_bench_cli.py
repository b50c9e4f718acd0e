"""`batchd bench`'s subcommand for `batchd`'s parser. Light: the parser imports it; the bench (its processes,
torch in its trainers) is imported only when the command runs."""

from __future__ import annotations

import argparse

from batchd._bench_options import HELP, add_arguments


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the `bench` subcommand to an argparse subparsers object; its handler is `args.func`."""
    p = subparsers.add_parser(
        "bench",
        help="real side-by-side run: fixed, ODB 0.1.2, batchd",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=_bench_command)
    return p


def _bench_command(args: argparse.Namespace) -> int:
    from batchd.bench import bench_command

    return bench_command(args)
