"""A CI-sized chaos run (benchmarks/chaos.py): one real multi-process job, a rank service, the coordinator
and a trainer SIGKILLed mid-job and restarted; nothing lost or duplicated, equal steps, every party exits 0.

The harness lives in benchmarks/chaos.py (the benchmark that publishes the full run's section of
docs/benchmarks.md); this test imports it from there. Synthetic samples only (no Ray: keeps it near a
minute on 2 cores); the full run covers the Ray actor kills.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import chaos  # noqa: E402

pytestmark = pytest.mark.slow


def test_rank_service_coordinator_and_trainer_killed_and_restarted(tmp_path):
    plan = chaos.JobPlan(
        index=0,
        seed=11,
        source="synthetic",
        num_samples=200,
        step_time=0.05,
        faults=[
            chaos.Fault("rank", at_step=4, target=1),
            chaos.Fault("coordinator", at_step=7),
            chaos.Fault("trainer", at_step=10, target=0),
        ],
    )
    report = chaos.run_jobs(
        [plan], tmp_path, coordinator_journal=True, job_timeout_s=150, log=lambda *_: None
    )
    (res,) = report["results"]
    logs = f"job logs in {tmp_path}; messages: {res['messages']}"
    assert [f["injected"] for f in res["faults"]] == [True, True, True], f"faults: {res['faults']}; {logs}"
    assert [f["victim"] for f in res["faults"]] == ["rank-1", "coordinator", "trainer-0"]
    assert res["completed"] and res["messages"] == [], logs
    assert res["lost"] == 0 and res["duplicated"] == 0 and res["unexpected"] == 0, res["epochs"]
    assert res["conflicting_replays"] == 0 and res["unequal_steps"] == [], res["epochs"]
    assert all(e["steps"][0] > 0 for e in res["epochs"]), res["epochs"]
    assert res["ok"] and report["jobs_failed"] == 0
    # every party's last incarnation exited 0; the killed ones were SIGKILLed (-9), the stopped group -15
    for name, incarnations in res["exits"].items():
        assert incarnations[-1]["code"] == 0, (name, incarnations)
        assert all(i["why"] for i in incarnations[:-1]), (name, incarnations)
    assert len(res["exits"]["rank-1"]) == 2 and len(res["exits"]["trainer-1"]) == 2
    assert len(res["exits"]["coordinator"]) == 2
