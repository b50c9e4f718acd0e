"""The README's "A real job" recipe, run as written by bash in an empty directory, then its ids check.

The block is taken from README.md and run line by line; the test only adds what a user edits or what
a shared test machine needs: after `batchd config --example`, job.toml gets free ports, a smaller
budget and window (the README's "edit" step), the sample dataset is smaller, the trainer gets a
smaller model and the port of the edited config, and a final `wait` for the services. Checked: the
script succeeds, both trainers ran the same number of steps, the coordinator and the node agent exited
0 on their own, the agent served both ranks on one embedded Ray it started, and no process of the job
is left. Then the README's "Check that every sample was trained once" block, run as written on the
trainers' `--ids-log` files, reports every record that was not quarantined trained once.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import uuid

import pytest
from _procs import free_block
from _readme_job import REPO, end_job, job_env, readme_script, surviving_steps

pytestmark = pytest.mark.slow


def stats_fields() -> set[str]:
    """The fields the "Stats file" table of docs/operations.md documents."""
    text = (REPO / "docs" / "operations.md").read_text()
    table = text[text.index("## Stats file") :].split("\n## ", 1)[0]
    return {
        f
        for row in table.splitlines()
        if row.startswith("| `")
        for f in re.findall(r"`([a-z_]+)`", row.split(" | ")[0])
    }


def ids_check_block() -> str:
    """The README's bash block after "Check that every sample was trained once"."""
    text = (REPO / "README.md").read_text()
    start = text.index("Check that every sample was trained once")
    return re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)


def test_readme_real_job_runs_as_written(tmp_path):
    cport, rport = free_block(1), free_block(2)
    script = readme_script(  # stats per rank (docs/operations.md); rank 1's trainer dies once at its 5th step
        cport,
        rport,
        train_args="--checkpoint-every 3 --crash-at 0:5:1 --ids-log ids-{rank}.jsonl",
        node_args="--stats-file stats.json",
    )
    ray_tmp = tempfile.mkdtemp(prefix="bdj-", dir="/tmp")  # short socket paths for Ray
    marker = f"BATCHD_TEST_README={uuid.uuid4().hex}"
    env = job_env(ray_tmp, marker)
    try:
        run = subprocess.run(
            ["bash", "-c", "\n".join(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,  # a backstop against a hang: it took 415 s beside two CPU burners
        )
        out = run.stdout[-4000:] + "\n--- stderr\n" + run.stderr[-6000:]
        assert run.returncode == 0, out
        results = [json.loads((tmp_path / f"summary-{r}.json").read_text()) for r in range(2)]
        assert results[0]["steps"] == results[1]["steps"] > 0, results
        # torchrun restarted the group from its checkpoint at step 3: every id once in what survives
        assert "resumed from ckpt/rank-0.pt at epoch 0 step 3" in run.stderr, out
        kept = [i for r in range(2) for e in surviving_steps(tmp_path, r)[0] for i in e["ids"]]
        assert len(kept) == len(set(kept)) > 0, out
        started = re.findall(r"rank (\d): started an embedded Ray for this job \(gcs (\S+)\)", run.stderr)
        assert len(started) == 1 and "joined" not in run.stderr, out  # one Ray, in the agent
        assert re.search(r"node agent '[^']+' serving ranks \[0, 1\]", run.stderr), out
        assert "Traceback" not in run.stderr, out
        for noise in (
            "max_restarts > 0",
            "Token authentication is enabled",
        ):  # Ray's, caused by batchd: silenced
            assert noise not in run.stderr, out
        documented = stats_fields()
        for r in range(2):
            stats = json.loads((tmp_path / f"stats.rank{r}.json").read_text())
            assert stats["rank"] == r and set(stats) <= documented, (set(stats) - documented, stats)
        # the README's check, as written, on the trainers' --ids-log files (a restart replayed steps)
        check = subprocess.run(
            ["bash", "-c", ids_check_block()],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.returncode == 0, check.stderr
        trained, want, twice = re.fullmatch(
            r"(\d+) of (\d+) samples trained, (\d+) more than once\n", check.stdout
        ).groups()
        assert trained == want and int(want) > 0 and twice == "0", check.stdout
        assert int(want) == len(kept) == len(set(kept)), (check.stdout, len(kept))
    finally:
        left = end_job(marker)  # the Ray a rank service started stops with it; let it exit
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, "processes outlived the job:\n" + "\n".join(left)
