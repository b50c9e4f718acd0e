"""The check of one chaos job (benchmarks/chaos.py), after its parties have ended.

Per epoch: every sample id exactly once across ranks (records the pipeline quarantined, listed in the
`quarantine.jsonl` of the job's directory with their epoch, expected absent and counted apart), the same
contiguous steps 0..n-1 on every rank, a replayed step carrying the same ids as the first time, and every
party's final incarnation exiting 0, or, for an unrecoverable fault, non-zero with a message naming the
killed party's rank.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from _chaos_plan import UNRECOVERABLE, JobPlan
from _chaos_procs import Party, last_error

Steps = dict[int, dict[int, dict[int, list[int]]]]  # epoch -> rank -> step -> ids


@dataclasses.dataclass(frozen=True)
class JobEnd:
    """What a job left to check: its plan, parties (by name; `trainers` among them), the harness's notes,
    the dataset's deliberately bad records (id -> reason), its directory and the trainers' ids logs."""

    plan: JobPlan
    parties: dict[str, Party]
    trainers: list[Party]
    notes: list[str]
    bad: dict[int, str]
    work: Path
    logs: dict[int, list[dict[str, Any]]]


def exits(parties: dict[str, Party]) -> dict[str, list[dict[str, Any]]]:
    """Per party, each incarnation's exit code, why it was ended (None: on its own) and its error."""
    return {
        name: [
            {
                "code": proc.returncode,
                "why": party.expected_end.get(k),
                "error": (last_error(party.log, False) if proc.returncode else None),
            }
            for k, proc in enumerate(party.procs)
        ]
        for name, party in parties.items()
        if party.procs
    }


def final_failures(parties: dict[str, Party]) -> dict[str, int]:
    """Parties whose last incarnation exited non-zero, the victim of a fault not restarted by design aside."""
    return {
        name: party.proc.returncode
        for name, party in parties.items()
        if party.procs
        and party.proc.returncode != 0
        and not (party.expected_end.get(len(party.procs) - 1) or "").startswith("chaos")
    }


def steps_of(logs: dict[int, list[dict[str, Any]]]) -> tuple[Steps, int, int]:
    """(the ids of each epoch's steps per rank, replays whose ids differ, replayed steps)."""
    steps: Steps = {}
    conflicts = replays = 0
    for r, entries in logs.items():
        for e in entries:
            cell = steps.setdefault(e["epoch"], {}).setdefault(r, {})
            if e["step"] in cell:
                replays += 1
                conflicts += cell[e["step"]] != e["ids"]
            else:
                cell[e["step"]] = e["ids"]
    return steps, conflicts, replays


def quarantined(work: Path) -> dict[int, dict[int, str]]:
    """Epoch -> quarantined record id -> reason, from the rank services' `quarantine.jsonl`."""
    out: dict[int, dict[int, str]] = collections.defaultdict(dict)
    qfile = work / "quarantine.jsonl"
    if qfile.exists():
        for ln in qfile.read_text().splitlines():
            if ln.strip():
                q = json.loads(ln)
                out[q.get("epoch", 0)][int(q["id"])] = q["reason"]
    return out


def epoch_tally(end: JobEnd, steps: Steps) -> tuple[list[dict[str, Any]], list[str]]:
    """(per epoch: steps per rank, samples, lost, duplicated, unexpected, quarantined; the epochs whose
    ranks ran unequal or gapped steps)."""
    p, quarantine = end.plan, quarantined(end.work)
    per_epoch, unequal = [], []
    for epoch in range(p.epochs):
        by_rank = steps.get(epoch, {})
        counts = [len(by_rank.get(r, {})) for r in range(p.world_size)]
        contiguous = all(sorted(by_rank.get(r, {})) == list(range(counts[r])) for r in range(p.world_size))
        if len(set(counts)) != 1 or not contiguous:
            unequal.append(f"epoch {epoch}: steps per rank {counts}" + ("" if contiguous else " (gaps)"))
        ids = [i for r in by_rank.values() for s in r.values() for i in s]
        q = quarantine.get(epoch, {})
        expected = set(range(p.num_samples)) - set(q)
        seen = collections.Counter(ids)
        per_epoch.append(
            {
                "epoch": epoch,
                "steps": counts,
                "samples": len(ids),
                "lost": len(expected - set(seen)),
                "dup": sum(c - 1 for c in seen.values() if c > 1),
                "unexpected": len(set(seen) - expected),
                "quarantined": len(q),
                "quarantined_by_fault": {i: why for i, why in q.items() if i not in end.bad},
            }
        )
    return per_epoch, unequal


def _failed_as_designed(end: JobEnd, final_bad: dict[str, int]) -> bool | None:
    """For a job with an unrecoverable fault injected: whether every other party failed naming the killed
    trainer's rank (and the harness noted nothing); None for a job without one."""
    unrecoverable = [f for f in end.plan.faults if f.injected and f.kind in UNRECOVERABLE]
    if not unrecoverable:
        return None
    f = unrecoverable[0]
    rank_re = re.compile(rf"\brank {f.target}\b")
    survivors = [n for n in end.parties if n != f.victim]  # each must fail and name the rank
    named = all(final_bad.get(n) and rank_re.search(last_error(end.parties[n].log)) for n in survivors)
    return bool(named) and not end.notes


def check(end: JobEnd) -> dict[str, Any]:
    """The job's verdict and counts (the keys of a result of chaos.json's `results`)."""
    final_bad = final_failures(end.parties)
    messages = end.notes + [
        f"{name} exit {code}: {last_error(end.parties[name].log)}" for name, code in final_bad.items()
    ]
    completed = bool(end.trainers) and all(t.procs and t.proc.returncode == 0 for t in end.trainers)
    steps, conflicts, replays = steps_of(end.logs)
    per_epoch, unequal = epoch_tally(end, steps)
    lost, dup, unexpected = (sum(e[k] for e in per_epoch) for k in ("lost", "dup", "unexpected"))
    designed = _failed_as_designed(end, final_bad)
    if designed is not None:  # must fail, every party, naming the killed trainer's rank
        ok = designed
        verdict = "failed as designed" if ok else "did not fail as designed"
    else:
        data_ok = completed and lost == 0 and dup == 0 and unexpected == 0 and conflicts == 0 and not unequal
        ok = data_ok and not final_bad and not end.notes
        verdict = "ok" if ok else ("FAILED" if not completed or final_bad or end.notes else "WRONG DATA")
    return {
        "ok": ok,
        "verdict": verdict,
        "completed": completed,
        "lost": lost if completed else None,
        "lost_incomplete": None if completed else lost,
        "duplicated": dup,
        "unexpected": unexpected,
        "conflicting_replays": conflicts,
        "replayed_steps": replays,
        "unequal_steps": unequal,
        "epochs": per_epoch,
        "exits": exits(end.parties),
        "messages": messages,
        "quarantined_expected": len(end.bad),
    }
