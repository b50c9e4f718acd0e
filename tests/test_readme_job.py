"""The README's "A real job" recipe, run as written by bash in an empty directory.

The block is taken from README.md and run line by line; the test only adds what a user edits or what
a shared test machine needs: after `batchd config --example`, job.toml gets free ports, a smaller
budget and window (the README's "edit" step), the sample dataset is smaller, the trainer gets a
smaller model and the port of the edited config, and a final `wait` for the services. Checked: the
script succeeds, both trainers ran the same number of steps, the coordinator and the node agent exited
0 on their own, the agent served both ranks on one embedded Ray it started, and no process of the job
is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from _procs import free_block, processes_with_marker

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def readme_job_block() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("A real job")
    return re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)


def stats_fields() -> set[str]:
    """The fields the README's "Stats file" table documents."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("### Stats file"):].split("\n## ", 1)[0]
    return {f for row in table.splitlines() if row.startswith("| `")
            for f in re.findall(r"`([a-z_]+)`", row.split(" | ")[0])}


def test_readme_real_job_runs_as_written(tmp_path):
    block = readme_job_block()
    cport, rport = free_block(1), free_block(2)
    script = ["set -euo pipefail"]
    for line in block.splitlines():
        if line.startswith("torchrun "):
            assert "--node-agent 127.0.0.1:7100" in line, line
            line = line.split("#")[0].replace("--node-agent 127.0.0.1:7100", f"--node-agent 127.0.0.1:{rport}")
            line += " --d-model 32 --n-layers 1 --n-heads 2 --summary summary-{rank}.json"
        line = line.replace("make_demo_dataset(\".\", 256)", "make_demo_dataset(\".\", 48)")
        if line.startswith("batchd node "):  # the README's "Stats file": one per rank, every field documented
            line = line.replace(" &", " --stats-file stats.json &")
        script.append(line)
        if line.startswith("batchd config --example"):  # the user's edit
            script.append(f"sed -i -e 's/^port = 7000/port = {cport}/' -e 's/^base_port = 7100/base_port = {rport}/' "
                          "-e 's/^token_budget = 8192/token_budget = 1024/' -e 's/^window = 512/window = 64/' job.toml")
    script += ['for p in $(jobs -p); do wait "$p"; done']  # the services exit on their own, status 0
    assert any(ln.startswith("batchd node ") for ln in script), block
    ray_tmp = tempfile.mkdtemp(prefix="bdj-", dir="/tmp")  # this job's own Ray temp root (short socket paths)
    marker = f"BATCHD_TEST_README={uuid.uuid4().hex}"
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '')}", "TMPDIR": ray_tmp,
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", marker.split("=")[0]: marker.split("=")[1]}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS"):
        env.pop(var, None)
    try:
        run = subprocess.run(["bash", "-c", "\n".join(script)], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=400)
        out = run.stdout[-4000:] + "\n--- stderr\n" + run.stderr[-6000:]
        assert run.returncode == 0, out
        results = [json.loads((tmp_path / f"summary-{r}.json").read_text()) for r in range(2)]
        assert results[0]["steps"] == results[1]["steps"] > 0, results
        started = re.findall(r"rank (\d): no Ray running on this host: started an embedded Ray \(gcs (\S+)\)", run.stderr)
        assert len(started) == 1 and "joined the Ray" not in run.stderr, out  # one Ray, in the agent
        assert re.search(r"node agent '[^']+' serving ranks \[0, 1\]", run.stderr), out
        assert "Traceback" not in run.stderr, out
        documented = stats_fields()
        for r in range(2):
            stats = json.loads((tmp_path / f"stats.rank{r}.json").read_text())
            assert stats["rank"] == r and set(stats) <= documented, (set(stats) - documented, stats)
    finally:
        deadline = time.monotonic() + 15  # the Ray a rank service started stops with it; let it exit
        while processes_with_marker(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = processes_with_marker(marker)
        for entry in left:  # this test's own processes, by pid ("pid: cmdline")
            with contextlib.suppress(OSError):
                os.kill(int(entry.split(":", 1)[0]), signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, "processes outlived the job:\n" + "\n".join(left)
