"""The report of a chaos run (benchmarks/chaos.py): the totals over its jobs, the section's tables
(templates/chaos.md.j2) and the text printed at the end."""

from __future__ import annotations

import collections
import os
import platform
from typing import Any

from _report import table


def summarize(results: list[dict[str, Any]], notes: list[str], wall_s: float) -> dict[str, Any]:
    planned, injected, skipped = collections.Counter(), collections.Counter(), collections.Counter()
    for r in results:
        for f in r["faults"]:
            planned[f["kind"]] += 1
            injected[f["kind"]] += f["injected"]
            skipped[f["kind"]] += not f["injected"]
    failed = [
        {"job": r["job"], "verdict": r["verdict"], "messages": r["messages"]} for r in results if not r["ok"]
    ]
    return {
        "jobs": len(results),
        "wall_s": round(wall_s, 1),
        "faults": {
            k: {"planned": planned[k], "injected": injected[k], "skipped": skipped[k]} for k in planned
        },
        "lost": sum(r["lost"] or 0 for r in results),
        "lost_in_failed_jobs": sum(r["lost_incomplete"] or 0 for r in results),
        "duplicated": sum(r["duplicated"] for r in results),
        "unexpected": sum(r["unexpected"] for r in results),
        "conflicting_replays": sum(r["conflicting_replays"] for r in results),
        "jobs_unequal_steps": sum(bool(r["unequal_steps"]) for r in results if r["completed"]),
        "jobs_failed": len(failed),
        "failures": failed,
        "notes": notes,
        "results": results,
    }


def fault_text(f: dict[str, Any]) -> str:
    s = f"{f['kind']}@{f['at_step']}"
    if f["injected"]:
        s += f" {f['victim']} t={f['t_s']:g}s"
        if f["recovered_s"] is not None:
            s += f" back {f['recovered_s']:g}s"
    if f["note"]:
        s += f" ({f['note']})"
    return s


def job_rows(report: dict[str, Any]) -> list[list[object]]:
    rows = []
    for r in report["results"]:
        p = r["plan"]
        steps = "/".join(
            str(e["steps"][0]) if len(set(e["steps"])) == 1 else str(e["steps"]) for e in r["epochs"]
        )
        rows.append(
            [
                r["job"],
                p["source"],
                p["num_samples"],
                f"{p['step_time']:g}",
                "; ".join(fault_text(f) for f in r["faults"]) or "-",
                steps,
                "-" if r["lost"] is None else r["lost"],
                r["duplicated"],
                f"{sum(e['quarantined'] for e in r['epochs'])} "
                f"({sum(len(e['quarantined_by_fault']) for e in r['epochs'])})",
                r["verdict"],
                f"{r['wall_s']:.0f}",
            ]
        )
    return rows


JOB_HEADERS = [
    "job",
    "source",
    "samples",
    "step s",
    "faults (kind@step victim time)",
    "steps/epoch",
    "lost",
    "dup",
    "quarantined (by fault)",
    "result",
    "wall s",
]


def section_data(report: dict[str, Any]) -> dict[str, Any]:
    """What the section shows of a run's report (the per-job tables' cells, totals, failures)."""
    fk = report["faults"]
    totals = [report["jobs"], sum(v["planned"] for v in fk.values()), sum(v["injected"] for v in fk.values())]
    totals += [report["lost"], report["duplicated"], report["jobs_unequal_steps"], report["jobs_failed"]]
    return {
        "totals_headers": ["jobs", "faults planned", "injected", "lost", "duplicated", "unequal steps"]
        + ["jobs failed"],
        "totals": [totals],
        "kinds_headers": ["fault kind", "planned", "injected", "skipped"],
        "kinds": [[k, v["planned"], v["injected"], v["skipped"]] for k, v in sorted(fk.items())],
        "job_headers": JOB_HEADERS,
        "jobs": job_rows(report),
        "notes": report["notes"],
        "failures": report["failures"],
        "wall_s": report["wall_s"],
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def print_report(report: dict[str, Any]) -> None:
    print()
    print(table(JOB_HEADERS, job_rows(report)))
    print()
    fk = report["faults"]
    print(
        "faults by kind: "
        + ", ".join(f"{k} {v['injected']}/{v['planned']} injected" for k, v in sorted(fk.items()))
    )
    print(
        f"jobs {report['jobs']}, failed {report['jobs_failed']}; samples lost {report['lost']} "
        "(completed jobs; "
        f"{report['lost_in_failed_jobs']} more in failed jobs), duplicated {report['duplicated']}, "
        f"unexpected {report['unexpected']}, conflicting replays {report['conflicting_replays']}, "
        f"jobs with unequal steps {report['jobs_unequal_steps']}"
    )
    for n in report["notes"]:
        print(f"note: {n}")
    for f in report["failures"]:
        print(f"job {f['job']} {f['verdict']}:")
        for m in f["messages"]:
            print(f"    {m}")
