"""The `batchd` command line: simulate, config, tokenizer, tiny-vlm, coordinator, rank, node, demo, bench.

`batchd coordinator` and `batchd rank` take a job config file (`--config`, see `batchd._config`);
every flag overrides one key of it, and the merged result is validated before anything starts.
Errors (bad flags, bad config, a dead peer) exit with status 2 and a one-line message naming the field
or party; a failed job exits 1 with `batchd CMD: the job failed: <reason>`, Ctrl-C / SIGTERM 130 with
`batchd CMD: interrupted` (`batchd coordinator` exits 143 on SIGTERM).

The commands' parsers and handlers live with their group: `batchd._cli_tools` (simulate, config,
tokenizer, tiny-vlm), `batchd._cli_services` (coordinator, rank, node), `batchd._cli_demo` (demo),
`batchd.bench` (bench); the flags they share in `batchd._cli_flags`. Here: the parser of them all and
`main`, which maps every command's outcome to its exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import signal
import sys
from collections.abc import Sequence

from batchd._bench_cli import add_bench_parser
from batchd._cli_calibrate import add_calibrate_parser
from batchd._cli_demo import add_demo_parser, print_demo
from batchd._cli_services import add_service_parsers
from batchd._cli_tools import add_tool_parsers

__all__ = ["build_parser", "main", "print_demo"]


def build_parser() -> argparse.ArgumentParser:
    """The `batchd` parser: every command, in the order `batchd --help` lists them."""
    parser = argparse.ArgumentParser(prog="batchd", description="batchd: token-budget batching as a service.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_tool_parsers(sub)  # simulate, config, tokenizer, tiny-vlm
    add_service_parsers(sub)  # coordinator, rank, node
    add_demo_parser(sub)
    add_bench_parser(sub)
    add_calibrate_parser(sub)
    sub.add_parser(
        "torchrun",
        help="torchrun for a batchd job: restarts that work, one line on Ctrl-C (same arguments)",
        description="torch.distributed.run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (restarted worker "
        "groups connect to each other, pytorch #135712) and a one-line end on Ctrl-C / SIGTERM (exit "
        "130 / 143) that says how to resume; every argument is torchrun's (`batchd torchrun --help` "
        "prints torchrun's own).",
    )
    return parser


# Exit statuses, the same for every command (README, "Exit statuses").
EXIT_OK = 0
EXIT_JOB_FAILED = 1  # the job failed: a party failed or is gone, too many bad records, samples lost
EXIT_ERROR = 2  # a flag, a config key, a file, or a party that cannot be reached (one line names it)
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM
EXIT_TERMINATED = 143  # SIGTERM, from `batchd coordinator` (and `batchd torchrun`)
EXIT_CLOSED_PIPE = 141  # standard output was closed early (`| head`): nothing more is printed


def main(argv: Sequence[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else list(argv)
    if args_in[:1] == ["torchrun"]:  # every argument is torchrun's: not parsed here
        from batchd._torchrun import main as torchrun_main

        return torchrun_main(args_in[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("coordinator", "rank", "node"):
        if not faulthandler.is_enabled():
            faulthandler.enable()  # a daemon dying in native code (gRPC, torch) leaves its stacks in its log
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where a stuck one is
    from batchd.core import BatchdError, JobFailed

    try:
        status = args.func(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe is handled below
        if status in (EXIT_INTERRUPTED, EXIT_TERMINATED) and args.command in ("coordinator", "rank", "node"):
            print(f"batchd {args.command}: interrupted", file=sys.stderr, flush=True)  # a service's stop
        return status
    except KeyboardInterrupt as exc:
        print(
            f"batchd {args.command}: interrupted{f' {exc}' if str(exc) else ''}", file=sys.stderr, flush=True
        )
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`| head`): end quietly, as command-line tools do
        return _closed_pipe()
    except JobFailed as exc:
        print(f"batchd {args.command}: the job failed: {exc}", file=sys.stderr)
        return EXIT_JOB_FAILED
    except BatchdError as exc:  # a party that cannot be reached (or refuses): the line names it
        print(f"batchd {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except (ValueError, OSError, RuntimeError, TimeoutError) as exc:
        print(f"batchd {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _closed_pipe() -> int:
    """Points stdout at /dev/null so the interpreter's final flush cannot fail again; the status for
    SIGPIPE."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return EXIT_CLOSED_PIPE


if __name__ == "__main__":
    sys.exit(main())
