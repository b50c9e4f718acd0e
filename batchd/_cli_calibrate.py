"""`batchd calibrate`: the command line of `batchd._calibrate` (its docstring says what it measures)."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from batchd._cli_flags import positive
from batchd.core import parse_bytes


def _size(text: str) -> int:
    """argparse type: a size such as 24GiB or 512MiB (`batchd.core.parse_bytes`)."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure a model on a device: fit the cost model and the largest token budget",
        description=textwrap.fill(
            "Trains the model on a designed set of batches (padded and packed; lengths doubling from "
            "--min-length to --max-tokens), times forward + backward + optimizer step and takes each "
            "step's peak memory (CUDA: the allocator's peak; CPU: parameters, gradients, optimizer state "
            "and the activations autograd saved), fits overhead + linear x tokens + quadratic x attention "
            "pairs, and writes the [job] fragment (token_budget, [job.cost]) to OUT/calibration.toml, with "
            "the measured batches (calibration.json) and a plot of measured against predicted step time "
            "(calibration.svg).",
            100,
        ),
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--model", default="tiny", help="a reference model: tiny or llama-100m (~110M; default tiny)"
    )
    which.add_argument("--hf-model", metavar="DIR", help="a stock Hugging Face model directory (offline)")
    which.add_argument(
        "--entry",
        metavar="MODULE:FUNCTION",
        help="your own model: FUNCTION(device) returns the model or (model, optimizer); it is called as "
        "batchd.client.train_step calls it",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--layouts", default="padded,packed", help="the batch layouts to measure (default padded,packed)"
    )
    p.add_argument("--min-length", type=positive, default=32, help="the shortest sample (default 32)")
    p.add_argument(
        "--max-tokens", type=positive, default=2048, help="the largest batch measured (default 2048)"
    )
    p.add_argument("--repeats", type=positive, default=3, help="timed steps per batch (default 3)")
    p.add_argument(
        "--memory-limit",
        type=_size,
        default=None,
        metavar="SIZE",
        help="the memory the budget must fit, e.g. 24GiB (default: CUDA the device's, CPU the available)",
    )
    p.add_argument("--margin", type=float, default=0.1, help="memory kept free (default 0.1 = 10%%)")
    p.add_argument(
        "--out", default="calibration", metavar="DIR", help="where to write (default ./calibration)"
    )
    p.add_argument("--quiet", action="store_true", help="no line per measured batch")
    p.set_defaults(func=_calibrate_cmd)


def _calibrate_cmd(args: argparse.Namespace) -> int:
    from batchd._calibrate import CalibrateOptions, calibrate, fragment, table, write_outputs

    opts = CalibrateOptions(
        model=args.model,
        hf_model=args.hf_model,
        entry=args.entry,
        device=args.device,
        dtype=args.dtype,
        layouts=tuple(x.strip() for x in args.layouts.split(",") if x.strip()),
        min_length=args.min_length,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        memory_limit=args.memory_limit,
        margin=args.margin,
    )

    def log(line: str) -> None:
        if not args.quiet:
            print(f"batchd calibrate: {line}", file=sys.stderr, flush=True)

    cal = calibrate(opts, log)
    files = write_outputs(cal, Path(args.out))
    print(table(cal))
    print()
    print(fragment(cal), end="")
    print(f"\nwrote {', '.join(str(f) for f in files)}")
    return 0
