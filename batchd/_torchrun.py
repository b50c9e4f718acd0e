"""`batchd torchrun`: torchrun with the restart behaviour a batchd job needs, same arguments.

    batchd torchrun --nproc-per-node 2 --max-restarts 3 -m batchd.train --node-agent 127.0.0.1:7100 \\
        --checkpoint ckpt

It is `torch.distributed.run` (the code behind `torchrun`), and adds:
- `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` unless set: since torch 2.5 torchrun hands every restarted
  worker group the same rendezvous store, and the new group's gloo or NCCL connects to the old group's
  peers and fails (pytorch #135712); with the store not shared, `--max-restarts` restarts work, on one
  host or several.
- Ctrl-C and SIGTERM end it in one line, no traceback (exit 130 and 143): torchrun has stopped the
  workers by then, and the line says where the trainers' last checkpoint is and how to resume (run the
  same command again; the rank services keep the steps after the checkpoint for `client_grace_s`).
- A failed worker group (torchrun's ChildFailedError, after its restarts) ends in the failed ranks' own
  one-line errors (exit 1), no traceback and no torchrun summary: `batchd.train` writes its line to the
  error file torchrun gives each worker ($TORCHELASTIC_ERROR_FILE); a rank that left none (killed, or a
  crash outside batchd's handling) gets a line with its exit status or signal. torchrun runs without its
  `@record` wrapper, which would only copy the first error file and log that it has nowhere to put it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

EXIT_FAILED, EXIT_SIGINT, EXIT_SIGTERM = 1, 130, 143


def checkpoint_note(argv: Sequence[str]) -> str:
    """Where the trainers' last checkpoint is, from the worker's `--checkpoint DIR` (batchd.train's):
    "the trainers' last checkpoint in DIR is at epoch E step S", or a general line."""
    args = list(argv)
    directory = None
    for k, arg in enumerate(args):
        if arg == "--checkpoint" and k + 1 < len(args):
            directory = args[k + 1]
        elif arg.startswith("--checkpoint="):
            directory = arg.split("=", 1)[1]
    if directory is None:
        return "resume from the trainers' last checkpoint"
    positions = []
    for pos in Path(directory).glob("rank-*.pos.json"):
        try:
            state = json.loads(pos.read_text())
            positions.append((int(state["epoch"]), int(state["next_step"])))
        except (OSError, ValueError, KeyError):
            continue
    if not positions:
        return f"no checkpoint in {directory} yet: the trainers start the job over"
    epoch, step = max(positions)
    return f"the trainers resume from their last checkpoint in {directory} (epoch {epoch} step {step})"


def failure_lines(failures: Mapping[int, Any]) -> list[str]:
    """One line per failed rank of torchrun's `ChildFailedError.failures` (global rank -> ProcessFailure),
    by rank: the rank's own line from its error file, else its exit status or signal."""
    lines = []
    for rank, failure in sorted(failures.items()):
        message = failure.message if failure.error_file != "<N/A>" else None
        if isinstance(message, dict):
            message = message.get("message")
        if isinstance(message, str) and message.strip():
            lines.append(message.strip().splitlines()[-1])
        elif failure.exitcode < 0:
            lines.append(f"[rank {rank}] ended by {failure.signal_name()} (its own lines above say why)")
        else:
            lines.append(f"[rank {rank}] exited with status {failure.exitcode} (its own lines above say why)")
    return lines


def main(argv: Sequence[str]) -> int:
    """Runs torchrun with `argv` (see module docstring); returns the exit status."""
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.run(torchrun.parse_args(list(argv)))  # torchrun.main, less its @record
    except (SignalException, KeyboardInterrupt) as exc:
        sig = getattr(exc, "sigval", signal.SIGINT)
        name = signal.Signals(sig).name
        print(
            f"batchd torchrun: stopped by {name}; run the same command again to go on: "
            f"{checkpoint_note(argv)} (the rank services keep the steps after it for their client_grace_s)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_SIGTERM if sig == signal.SIGTERM else EXIT_SIGINT
    except ChildFailedError as exc:
        lines = "\n".join(failure_lines(exc.failures))
        print(f"batchd torchrun: the worker group failed:\n{lines}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    return 0
