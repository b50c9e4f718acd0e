"""What a benchmark script records, and how a section of docs/benchmarks.md is rendered from it.

A script measures and ends with `write_result(...)`: one JSON file per section under
`benchmarks/results/<section>.json` holding the figures (`data`), the settings that produced them
(`config`), the commit measured (`commit`, `dirty`) and the code the section measures (`measures`, for
`render.py --stale`). The prose and tables live in `benchmarks/templates/<section>.md.j2`, which
receive that JSON as `r`; `render.py` assembles docs/benchmarks.md from all of them. No script writes
Markdown.

The result file's keys (sorted, indent 1, trailing newline):

- `section`: the section's name (the template's stem).
- `commit`: full sha of HEAD when measured; `dirty`: whether core/, proto/, service/, client/ or
  batchd/ had uncommitted changes then.
- `measured_at`: UTC ISO time.
- `measures`: repo-relative paths (files or dirs) of the code the figures depend on.
- `config`: the script's arguments and settings.
- `data`: the figures, JSON-safe (numbers, strings, lists, dicts; NaN and inf become null).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "benchmarks.md"
RESULTS = REPO / "benchmarks" / "results"
TEMPLATES = REPO / "benchmarks" / "templates"
DEFAULT_WORKLOADS = REPO / "batchd" / "workloads"  # the public length files (package data)
CODE_DIRS = ("core", "proto", "service", "client", "batchd")  # what `dirty` looks at

__all__ = [
    "CODE_DIRS",
    "DEFAULT_WORKLOADS",
    "DOCS",
    "REPO",
    "RESULTS",
    "TEMPLATES",
    "add_common_args",
    "command_line",
    "environment",
    "finish",
    "fmt",
    "format_profile",
    "head_commit",
    "idle_share",
    "json_safe",
    "load_result",
    "machine",
    "measured",
    "merged_stats",
    "render_section",
    "table",
    "write_result",
]


# -- recording ---------------------------------------------------------------------------------------
def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()


def head_commit(cwd: Path = REPO) -> str:
    """The full sha of HEAD ("unknown" outside a git checkout)."""
    try:
        return _git("rev-parse", "HEAD", cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def code_dirty(cwd: Path = REPO) -> bool:
    """Whether the package's code (`CODE_DIRS`) has uncommitted changes (untracked files included)."""
    try:
        return bool(_git("status", "--porcelain", "--", *CODE_DIRS, cwd=cwd))
    except (OSError, subprocess.SubprocessError):
        return False


def json_safe(value: Any) -> Any:
    """`value` as plain JSON: dicts (keys as str), lists (from tuples, sets sorted), numbers, strings,
    bools, None; NaN/inf -> None; numpy scalars and arrays -> Python numbers and lists; Paths -> str.
    Raises TypeError on anything else (a result must not depend on repr())."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, set | frozenset):
        return [json_safe(v) for v in sorted(value)]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # numpy scalar or array
        return json_safe(value.tolist())
    raise TypeError(f"not JSON-safe: {type(value).__name__} {value=}")


def write_result(
    section: str,
    data: dict[str, Any],
    *,
    measures: Sequence[str],
    config: dict[str, Any],
    out: Path | None = None,
) -> Path:
    """Writes section `section`'s result to `RESULTS/<section>.json` (or `out`) and returns the path.

    `measures` are repo-relative paths (files or dirs; at least one); one that does not exist is
    recorded anyway, with a warning on stderr (a long run is not lost to a moved file; `--stale` still
    follows its history). `data` and `config` pass through `json_safe`. The file is the whole record
    of the run: render.py needs nothing else.
    """
    if not measures:
        raise ValueError(f"measures must name the code the section measures: {section=}")
    missing = [m for m in measures if not (REPO / m).exists()]
    if missing:
        print(f"warning: {section}: measured paths not in the tree: {missing}", file=sys.stderr)
    record = {
        "section": section,
        "commit": head_commit(),
        "dirty": code_dirty(),
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "measures": sorted(measures),
        "config": json_safe(config),
        "data": json_safe(data),
    }
    path = Path(out) if out is not None else RESULTS / f"{section}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, sort_keys=True, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return path


def load_result(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
    return result


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the flags every script has: `--out PATH` (write the result there instead of
    `RESULTS/<section>.json`; smoke runs use a tmp path) and `--print` (print the rendered section)."""
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here instead")
    parser.add_argument("--print", action="store_true", help="print the rendered section on stdout")
    return parser


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """How a result was made, for its `config`: `python benchmarks/<script> ARGS` (`argv`, or
    sys.argv[1:] when None) without `--out PATH` and `--print`, which say where it went."""
    args, out, skip = list(sys.argv[1:] if argv is None else argv), [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif a != "--print" and not a.startswith("--out="):
            out.append(a)
    return " ".join([f"python benchmarks/{Path(script).name}", *out])


def finish(
    args: argparse.Namespace,
    section: str,
    data: dict[str, Any],
    *,
    measures: Sequence[str],
    config: dict[str, Any],
) -> Path:
    """A script's last step: `write_result` to `args.out` (or the default path), says where on stderr
    and, with `args.print`, prints the section rendered from what was written."""
    path = write_result(section, data, measures=measures, config=config, out=args.out)
    print(f"wrote {path}", file=sys.stderr)
    if args.print:
        print(render_section(load_result(path)))
    return path


# -- rendering ---------------------------------------------------------------------------------------
def fmt(value: object, digits: int = 3) -> str:
    """A table cell: None/NaN -> "-", floats with `digits` decimals, anything else str()."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table (columns whose cells are all numbers are right-aligned)."""
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [
        bool(cells) and all(_is_num(r[i]) for r in cells if r[i] not in ("-", ""))
        for i in range(len(headers))
    ]
    rule = (("-" * (w + 1) + ":") if n else ("-" * (w + 2)) for w, n in zip(widths, numeric, strict=True))
    out = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join(rule) + "|",
    ]
    for r in cells:
        padded = (c.rjust(w) if n else c.ljust(w) for c, w, n in zip(r, widths, numeric, strict=True))
        out.append("| " + " | ".join(padded) + " |")
    return "\n".join(out)


def _is_num(s: str) -> bool:
    try:
        float(s.rstrip("x%").replace(",", ""))
        return True
    except ValueError:
        return False


def machine(shared: str | None = None) -> str:
    """The machine line of a result: "CPython 3.11.7, 2 CPU(s), x86_64", with "shared by `shared`" after
    the CPU count when the measured processes share the cores."""
    import os
    import platform

    where = f" shared by {shared}" if shared else ""
    return (
        f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPU(s){where}, "
        f"{platform.machine()}"
    )


def measured(r: Mapping[str, Any]) -> str:
    """The line every section states under its title: "Measured at commit abc1234 on 2026-12-02"."""
    note = " (with uncommitted code changes)" if r.get("dirty") else ""
    return f"Measured at commit {str(r['commit'])[:7]} on {str(r['measured_at'])[:10]}{note}."


def environment(templates: Path = TEMPLATES) -> Any:
    """The jinja2 environment of the section templates: undefined names raise; `fmt`, `table` and
    `measured` are filters and globals, `zip` a global; block tags do not leave blank lines (so a
    line that ends in a block tag loses its newline: end such lines with text or an expression)."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    for name, fn in (("fmt", fmt), ("table", table), ("measured", measured)):
        env.filters[name] = fn
        env.globals[name] = fn
    env.globals["zip"] = zip  # pairs of runs (before/after) in one loop
    return env


def render_section(r: Mapping[str, Any], templates: Path = TEMPLATES) -> str:
    """Section `r["section"]` rendered from its template with `r`, between its markers."""
    name = r["section"]
    body = environment(templates).get_template(f"{name}.md.j2").render(r=r).strip("\n")
    return f"<!-- {name}:begin -->\n{body}\n<!-- {name}:end -->"


# -- measuring helpers shared by the scripts -------------------------------------------------------
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

    def __init__(self, prof: Any) -> None:
        prof.snapshot_stats()
        self.stats = prof.stats

    def create_stats(self) -> None:
        pass


def merged_stats(profiles: Sequence[Any]) -> Any:
    """One `pstats.Stats` of several `cProfile.Profile`s' completed calls (None if none has any)."""
    import pstats

    stats = None
    for prof in profiles:
        snap = _Snapshot(prof)
        if not snap.stats:
            continue
        stats = pstats.Stats(snap) if stats is None else (stats.add(snap) or stats)  # type: ignore[arg-type]
    return stats


def format_profile(stats: Any, top: int) -> str:
    """The `top` functions of `stats` by own time, as pstats prints them."""
    import io

    buf = io.StringIO()
    stats.stream = buf
    stats.sort_stats("tottime").print_stats(top)
    return buf.getvalue().rstrip() + "\n"
