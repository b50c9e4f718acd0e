"""An elastic job end to end, as real processes (the harness of benchmarks/elastic.py): 4 ranks on 2 node
agents; one agent is SIGKILLed mid-epoch and every other party fails fast; the job resumes at 2 ranks from
the trainers' checkpoint (`batchd coordinator --resize` on the old state dir, the surviving agent on its
own, its journals of the old size set aside), is preempted (every process SIGKILLed), and grows to 3 ranks
(a new one-rank agent). Every sample id of the epoch is trained exactly once across the runs, each run's
ranks resume at one step and make equal steps, and every party of the last run exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import elastic  # noqa: E402

pytestmark = pytest.mark.slow


def test_an_agent_killed_job_resumes_at_2_ranks_then_grows_to_3(tmp_path):
    job = elastic.ElasticJob(elastic.scenario(3, num_samples=1200), tmp_path, log=lambda *_: None)
    res = job.run(timeout_s=240)
    phases = res["phases"]
    detail = f"logs in {tmp_path}: {phases}"
    assert (res["lost"], res["duplicated"], res["samples"]) == (0, 0, 1200), detail
    assert [p["world"] for p in phases] == [4, 2, 3], detail
    assert all(p["equal_steps"] and len(p["first_step"]) == 1 for p in phases), detail
    assert 0 < phases[1]["first_step"][0] < phases[2]["first_step"][0], detail  # each resumed mid-epoch
    killed = phases[0]["codes"]
    assert killed.pop("agent-1") == -9, detail
    assert all(code not in (0, None) for code in killed.values()), detail  # failed fast, none hung
    assert all(code == 0 for code in phases[-1]["codes"].values()), detail
    assert not any(p["hung"] for p in phases), detail
    assert res["ok"], detail
