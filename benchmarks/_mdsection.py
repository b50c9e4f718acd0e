"""Shared helpers of the benchmark scripts: paths, Markdown tables and marker-delimited doc sections.

Each benchmark script owns one section of docs/benchmarks.md, delimited by
`<!-- NAME:begin -->` and `<!-- NAME:end -->`. A script replaces only its own section, so several
benchmarks share the file; a missing file is created with the common header, a missing section is
appended at the end.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "benchmarks.md"
DEFAULT_WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"

HEADER = """\
# batchd benchmarks

Every number on this page is produced by a script under `benchmarks/`; each script rewrites only its
own section (between `<!-- NAME:begin -->` / `<!-- NAME:end -->` markers), so the sections can be
refreshed independently. Rerun from the repository root with the project venv:

```
python benchmarks/simulate_workloads.py   # batching quality on the public workloads (< 1 min)
python benchmarks/throughput.py           # grouping/alignment throughput and 1M-sample simulate (minutes)
```

`simulate_workloads.py` reads the length files from `../shared/workloads` (override with
`--workloads DIR`). The ODB rows need `pip install online-dynamic-batching==0.1.2` (extra `bench`);
without it they read "not installed".

## Metrics

All costs use the **padded** model unless stated: a group of `k` samples whose longest is `m` costs
`k x m` tokens; `L` is the per-rank, per-step token budget and `N` the number of ranks.

- **steps**: global (synchronized) training steps to consume the epoch, i.e. per-rank step count.
- **ideal**: `ceil(real / (N x L))`, the steps a perfectly packed, perfectly balanced run would need.
- **oracle**: offline optimum under the same rules: all lengths of the epoch known up front, sorted
  longest first, grouped count-optimally (`batchd.core.contiguous_greedy`), `ceil(groups / N)` steps.
  No online policy that keeps every group within `L` can take fewer steps.
- **steps/oracle**, **steps/ideal**: the ratios of the above.
- **idle**: (rank, step) slots with no data (an IDLE step: zero-weight forward/backward).
- **padding_eff**: real tokens / materialized tokens (`sum k x m`).
- **step_eff**: real tokens / (steps x N x L): how much of the paid-for budget carries data.
- **cvl** (compute_vs_limit): sum over steps of the slowest rank's cost / (real / N). The straggler
  bound: 1.0 means every step is as cheap as a perfectly balanced, padding-free run; 1.38 means 38%
  more wall time than that limit. For the oracle, its groups are sorted by cost and dealt into rows of
  N (one row per step), which minimizes this sum for its group multiset.
- **moved**: samples trained on a rank other than the one whose sampler view produced them.
- **missing** / **dup**: sample ids never emitted / emitted more than once (both must be 0).
- **over_L**: steps on which a multi-sample group costs more than `L` (only the fixed-size baselines,
  which ignore the budget).
- **targets**: the issue's acceptance targets on config A: `local`: padding_eff >= 0.95 and
  steps <= 1.15 x oracle; `balanced`: padding_eff >= 0.97, steps <= 1.05 x oracle and cvl <= 1.10.
"""


def revision() -> str:
    """The commit the numbers were measured on: short hash, plus a note if the package's code (core/,
    batchd/, service/, client/, proto/) has local changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "core", "batchd", "service", "client", "proto"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown revision"
    return f"commit {head}" + (" + uncommitted code changes" if dirty else "")


def begin(name: str) -> str:
    return f"<!-- {name}:begin -->"


def end(name: str) -> str:
    return f"<!-- {name}:end -->"


def update_section(name: str, body: str, path: Path = DOCS) -> Path:
    """Replaces the text between `name`'s markers in `path` (creating file or section if missing)."""
    block = f"{begin(name)}\n{body.rstrip()}\n{end(name)}"
    text = path.read_text(encoding="utf-8") if path.exists() else HEADER
    b, e = text.find(begin(name)), text.find(end(name))
    if b >= 0 and e > b:
        text = text[:b] + block + text[e + len(end(name)) :]
    elif b >= 0 or e >= 0:
        raise ValueError(f"{path}: unbalanced markers for section {name!r}; fix the file by hand")
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def publish(
    name: str, body: str | Sequence[str], no_write: bool, path: Path = DOCS, echo: bool = False
) -> None:
    """A script's last step: writes `body` (text or lines) as section `name` of `path`, saying so on
    stderr; with `no_write` only prints it; with `echo` prints it on stdout as well as writing it."""
    text = body if isinstance(body, str) else "\n".join(body)
    if no_write or echo:
        print(text)
    if not no_write:
        print(f"wrote section {name!r} of {update_section(name, text, path)}", file=sys.stderr)


def fmt(value: object, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table (numbers right-aligned)."""
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [
        bool(cells) and all(_is_num(r[i]) for r in cells if r[i] not in ("-", ""))
        for i in range(len(headers))
    ]
    rule = (("-" * (w + 1) + ":") if n else ("-" * (w + 2)) for w, n in zip(widths, numeric, strict=False))
    out = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=False)) + " |",
        "|" + "|".join(rule) + "|",
    ]
    for r in cells:
        padded = (c.rjust(w) if n else c.ljust(w) for c, w, n in zip(r, widths, numeric, strict=False))
        out.append("| " + " | ".join(padded) + " |")
    return "\n".join(out)


def _is_num(s: str) -> bool:
    try:
        float(s.rstrip("x%").replace(",", ""))
        return True
    except ValueError:
        return False


# -- shared by the benchmark scripts -------------------------------------------------------------
def idle_share(seconds: float = 3.0) -> float:
    """Share of the machine's CPU time that was idle over the next `seconds` (from /proc/stat)."""

    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        return vals[3] + vals[4], sum(vals)

    try:
        i0, t0 = snap()
        time.sleep(seconds)
        i1, t1 = snap()
    except OSError:
        return float("nan")
    return (i1 - i0) / max(t1 - t0, 1)


class _Snapshot:
    """A per-thread profiler's completed calls, read without disabling it from another thread.

    `Profile.create_stats()` (what `pstats.Stats(profile)` calls) closes the frames still open in the
    profiled thread with the *calling* thread's `thread_time`, which charges garbage to whatever was
    blocked or running at that moment; `snapshot_stats()` counts only completed calls.
    """

    def __init__(self, prof) -> None:
        prof.snapshot_stats()
        self.stats = prof.stats

    def create_stats(self) -> None:
        pass


def merged_stats(profiles):
    import pstats

    stats = None
    for prof in profiles:
        snap = _Snapshot(prof)
        if not snap.stats:
            continue
        stats = pstats.Stats(snap) if stats is None else (stats.add(snap) or stats)
    return stats


def format_profile(stats, top: int) -> str:
    import io

    buf = io.StringIO()
    stats.stream = buf
    stats.sort_stats("tottime").print_stats(top)
    return buf.getvalue().rstrip() + "\n"
