"""Runs of the `batchd` CLI with `--json`, through the shared harness, for the scripts that time them.

`cli_json(argv, timeout)` runs `python -m batchd *argv --json` as one harness child (its own process
group, stopped on any exit; output in a log under a temp dir) and returns the summary the CLI prints as
its last JSON line, with the whole command's wall time. Also the machine description the sections
print. Used by demo_speedup.py, demo_pipeline.py and deterministic_cost.py.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import Harness
from _report import REPO

__all__ = ["cli_json", "command", "load_average", "machine"]


def cli_json(argv: list[str], timeout: float) -> tuple[dict[str, Any], float]:
    """(summary, seconds) of one `python -m batchd *argv --json`: the last line of its output that
    parses as a JSON object. Raises RuntimeError (with the log's tail) if it exits non-zero and
    TimeoutError after `timeout` seconds."""
    with tempfile.TemporaryDirectory(prefix="batchd-cli-") as tmp, Harness(Path(tmp)) as h:
        t0 = time.perf_counter()
        h.start("batchd", [sys.executable, "-m", "batchd", *argv, "--json"], cwd=REPO)
        code = h.wait("batchd", timeout)
        outer = time.perf_counter() - t0
        text = h.log("batchd", 1 << 24)
    if code != 0:
        raise RuntimeError(f"batchd {' '.join(argv)} exited with {code}:\n{text[-3000:]}")
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                summary: dict[str, Any] = json.loads(line)
            except ValueError:
                continue
            return summary, outer
    raise RuntimeError(f"batchd {' '.join(argv)} printed no JSON summary:\n{text[-3000:]}")


def machine() -> dict[str, Any]:
    """The interpreter and machine the figures come from."""
    return {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "cpus": os.cpu_count(),
        "arch": platform.machine(),
    }


def load_average() -> float:
    """The 1-minute load average (NaN where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def command(script: str, argv: list[str]) -> str:
    """The command line that produced a result: `python benchmarks/<script>` and its arguments, less
    the output flags (`--out PATH`, `--print`), which do not change what is measured."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif a != "--print" and not a.startswith("--out="):
            kept.append(a)
    return shlex.join(["python", f"benchmarks/{script}", *kept])
