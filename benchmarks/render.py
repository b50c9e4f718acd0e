"""Renders docs/benchmarks.md from the recorded results and the section templates.

    python benchmarks/render.py              # write docs/benchmarks.md
    python benchmarks/render.py --check      # exit 1 if the page differs or a result/template is orphaned
    python benchmarks/render.py --stale      # exit 1 if code a section measures changed after its run
    python benchmarks/render.py --commands   # the command that produces each section's result

Inputs: `benchmarks/results/<section>.json` (written by each script's `write_result`, see _report.py)
and `benchmarks/templates/<section>.md.j2` (the prose and tables; they receive the JSON as `r`).
The page is `_header.md.j2` followed by the sections in `ORDER`; entries of `ORDER` starting with
`_notes/` are static partials (one-off measurements taken by hand, each stating its commit), which
need no result. A section without a result renders as "not measured at this code": its command, and
where its last figures are (the page as it was before results were recorded, `LEGACY_PAGE`); `--stale`
lists it. Rendering is a pure function of those files: `--check` recomputes it and compares.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import DOCS, REPO, RESULTS, TEMPLATES, environment, load_result, render_section  # noqa: E402

# Today's section order of docs/benchmarks.md.
ORDER = (
    "simulate",
    "_notes/simulate",
    "throughput",
    "_notes/throughput",
    "align-latency",
    "rank-service",
    "preprocess",
    "demo",
    "demo-pipeline",
    "_notes/demo-pipeline",
    "bench",
    "_notes/bench",
    "calibrate",
    "epoch-boundary",
    "bench-epochs",
    "bench-updates",
    "update-replay",
    "chaos",
    "restart",
    "elastic",
    "node-balance",
    "_notes/node-balance",
    "node-latency",
    "_notes/node-latency",
    "node-balance-w128",
    "node-local",
    "phase-balance",
    "_notes/phase-balance",
    "encoder-phases",
    "bench-audio",
    "mllm-bench",
    "_notes/mllm-bench",
    "hf-processor",
    "streaming",
    "deterministic",
    "_notes/deterministic",
    "microbatch",
    "integrations",
    "_notes/integrations",
    "group-delivery",
    "cluster",
)

# The last commit whose docs/benchmarks.md was written by the scripts directly, before results were
# recorded as JSON: a section never measured since points there for its last figures.
LEGACY_PAGE = "366fa4cc5f"

# The full-size command that produces each section's result (run from the repository root with the
# project venv, on a quiet machine). Smoke runs use the scripts' smallest settings and `--out`.
FULL_RUNS = {
    "simulate": "python benchmarks/simulate_workloads.py",
    "throughput": "python benchmarks/throughput.py",
    "align-latency": "python benchmarks/align_latency.py",
    "rank-service": "python benchmarks/rank_service_throughput.py",
    "preprocess": "python benchmarks/preprocess_throughput.py --epochs 5",
    "demo": "python benchmarks/demo_speedup.py",
    "demo-pipeline": "python benchmarks/demo_pipeline.py --runs 2",
    "bench": "python benchmarks/bench_systems.py",
    "calibrate": "python benchmarks/calibrate_fit.py",
    "epoch-boundary": "python benchmarks/epoch_boundary.py",
    "bench-epochs": "python benchmarks/bench_epochs.py",
    "bench-updates": "python benchmarks/bench_updates.py",
    "update-replay": "python benchmarks/update_replay.py",
    "restart": "python benchmarks/restart.py",
    "chaos": "python benchmarks/chaos.py --jobs 6 --seed 0 --faults-per-job 2 --json /tmp/chaos_full.json "
    "--work /tmp/chaos_full",
    "elastic": "python benchmarks/elastic.py",
    "node-balance": "python benchmarks/node_balance.py",
    "node-latency": "python benchmarks/node_latency.py --profile --before 086f7f1",
    "node-balance-w128": "python benchmarks/node_balance.py --repeat 64 --window 128",
    "node-local": "python benchmarks/node_local.py",
    "phase-balance": "python benchmarks/phase_balance.py",
    "encoder-phases": "python benchmarks/encoder_phases.py",
    "bench-audio": "python benchmarks/bench_audio.py",
    "mllm-bench": "python benchmarks/mllm_bench.py",
    "hf-processor": "python benchmarks/hf_processor_throughput.py --samples 400 --rounds 5",
    "streaming": "python benchmarks/stream_scale.py",
    "deterministic": "python benchmarks/deterministic_cost.py --pairs 3 --bench-samples 256",
    "microbatch": "python benchmarks/microbatch_balance.py",
    "integrations": "python benchmarks/integrations.py",
    "group-delivery": "python benchmarks/group_delivery.py",
    "cluster": "python benchmarks/cluster.py",  # as root: it makes network namespaces
}


def sections() -> list[str]:
    """The sections that have a result (the entries of `ORDER` that are not static notes)."""
    return [s for s in ORDER if not s.startswith("_")]


def render_page(results: Path = RESULTS, templates: Path = TEMPLATES, partial: bool = False) -> str:
    """The whole page. A section without a result renders as `pending` says, unless `partial` (then it
    is left out with its notes: for previewing smoke results, never for the committed page)."""
    env = environment(templates)
    missing = {s for s in sections() if not (results / f"{s}.json").exists()}
    parts = [env.get_template("_header.md.j2").render().strip("\n")]
    for name in ORDER:
        if name.startswith("_"):
            if not (partial and name.removeprefix("_notes/") in missing):
                parts.append(env.get_template(f"{name}.md.j2").render().strip("\n"))
        elif name not in missing:
            parts.append(render_section(load_result(results / f"{name}.json"), templates))
        elif not partial:
            parts.append(pending(name))
    return "\n\n".join(parts) + "\n"


def pending(name: str) -> str:
    """The section of a benchmark with no result at this code: how to measure it, where its last figures
    are."""
    return (
        f"<!-- {name}:begin -->\n## `{name}`: not measured at this code yet\n\n"
        f"No result in `benchmarks/results/{name}.json`: run `{FULL_RUNS[name]}`, then "
        "`python benchmarks/render.py`. Its last figures, measured before results were recorded as "
        f"JSON (and before the code changed since), are in `git show {LEGACY_PAGE}:docs/benchmarks.md`, "
        f"between the `{name}` markers.\n<!-- {name}:end -->"
    )


def check(docs: Path = DOCS, results: Path = RESULTS, templates: Path = TEMPLATES) -> list[str]:
    """Problems that make the committed page wrong (empty: it is exactly the rendering): a result
    without a template, a section in neither `ORDER` nor the
    templates, a result naming another section, or a page that differs from the rendering."""
    problems = []
    names = set(sections())
    have_tpl = {p.name[: -len(".md.j2")] for p in templates.glob("*.md.j2") if not p.name.startswith("_")}
    have_json = {p.stem for p in results.glob("*.json")}
    problems += [f"result without a template: {n}" for n in sorted(have_json - have_tpl)]
    problems += [f"section not in render.ORDER: {n}" for n in sorted((have_tpl | have_json) - names)]
    problems += [f"section in render.ORDER without a template: {n}" for n in sorted(names - have_tpl)]
    for n in sorted(have_json):
        got = load_result(results / f"{n}.json").get("section")
        if got != n:
            problems.append(f"{n}.json records section {got!r}")
    if problems:
        return problems
    text = docs.read_text(encoding="utf-8") if docs.exists() else ""
    if text != render_page(results, templates):
        problems.append(f"{docs} differs from the rendering: run python benchmarks/render.py")
    return problems


def stale(
    results: Path = RESULTS, repo: Path = REPO, expected: Sequence[str] | None = None
) -> dict[str, list[str]]:
    """Section -> the commits (`%h subject`) that changed its `measures` after the commit it was
    measured on; only sections with such commits. An unknown commit counts as stale, and so does a
    section of `expected` (default: every section of `ORDER`) with no result (`["no result"]`)."""
    names = sections() if expected is None else list(expected)
    out: dict[str, list[str]] = {s: ["no result"] for s in names if not (results / f"{s}.json").exists()}
    for path in sorted(results.glob("*.json")):
        r = load_result(path)
        cmd = ["git", "log", "--format=%h %s", f"{r['commit']}..HEAD", "--", *r["measures"]]
        proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=60)
        commits = proc.stdout.split("\n") if proc.returncode == 0 else [f"unknown commit {r['commit']}"]
        commits = [c for c in commits if c.strip()]
        if commits:
            out[r["section"]] = commits
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 unless the page is the rendering")
    mode.add_argument("--stale", action="store_true", help="list sections measured before code changed")
    mode.add_argument("--commands", action="store_true", help="print each section's full-run command")
    ap.add_argument("--results", type=Path, default=RESULTS, help="directory of the result JSONs")
    ap.add_argument("--docs", type=Path, default=DOCS, help="the page to write or check")
    ap.add_argument("--partial", action="store_true", help="leave out sections without a result")
    args = ap.parse_args(argv)
    if args.commands:
        for name in sections():
            print(f"{name:18s} {FULL_RUNS[name]}")
        return 0
    if args.check:
        problems = check(args.docs, args.results)
        for p in problems:
            print(p, file=sys.stderr)
        return 1 if problems else 0
    if args.stale:
        found = stale(args.results)
        for name, commits in found.items():
            print(f"{name}: measured before {len(commits)} commit(s): " + "; ".join(commits))
        return 1 if found else 0
    args.docs.write_text(render_page(args.results, partial=args.partial), encoding="utf-8")
    print(f"wrote {args.docs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
