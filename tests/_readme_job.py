"""The README's "A real job" recipe as a bash script, for the tests that run it as a user would.

`readme_script` takes the block from README.md and adds only what a user edits or what a shared test
machine needs: free ports, a smaller budget, window and dataset, a smaller model for the trainer, and a
final `wait` for the services. `job_env` is the environment of one job (its marker, its TMPDIR);
`end_job` ends what is left of a job, by marker.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

from _procs import free_block, processes_with_marker

REPO = Path(__file__).resolve().parents[1]
# The sample dataset's size in the tests (the README makes 256). `make_demo_dataset` writes at least one
# bad record of each kind (7); 160 records keep them under max_bad_fraction (0.1) of a rank's view even
# if all fell on one rank, so the job trains as the README's does.
RECORDS = 160


def readme_job_block() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("A real job")
    return re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)


def readme_script(
    cport: int, rport: int, train_args: str = "", before_train: tuple[str, ...] = (), node_args: str = ""
) -> list[str]:
    """The README block as script lines, edited as the module docstring says; `train_args` are added to
    the trainer's line, `before_train` lines go just before it, `node_args` to the node agent's line."""
    block = readme_job_block()
    script = ["set -euo pipefail"]
    for line in block.splitlines():
        if line.startswith("batchd torchrun "):
            assert "--node-agent 127.0.0.1:7100" in line, line
            line = line.split("#")[0].replace(
                "--node-agent 127.0.0.1:7100", f"--node-agent 127.0.0.1:{rport}"
            )
            line += " --d-model 32 --n-layers 1 --n-heads 2 --summary summary-{rank}.json " + train_args
            script += list(before_train)
        line = line.replace('make_demo_dataset(".", 256)', f'make_demo_dataset(".", {RECORDS})')
        if node_args and line.startswith("batchd node "):
            line = line.replace(" &", f" {node_args} &", 1)
        script.append(line)
        if line.startswith("batchd config --example"):  # the user's edit
            script.append(
                f"sed -i -e 's/^port = 7000/port = {cport}/' -e 's/^base_port = 7100/base_port = {rport}/' "
                "-e 's/^token_budget = 8192/token_budget = 1024/' -e 's/^window = 512/window = 64/' job.toml"
            )
    script += ['for p in $(jobs -p); do wait "$p"; done']  # the services exit on their own, status 0
    assert any(ln.startswith("batchd node ") for ln in script), block
    return script


def job_env(ray_tmp: str, marker: str) -> dict[str, str]:
    """A job's environment: the venv's commands first, `TMPDIR` (short socket paths for Ray), its marker
    ("NAME=value", inherited by all its processes), and nothing of a torchrun or Ray around the tests."""
    bindir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ.get('PATH', '')}",
        "TMPDIR": ray_tmp,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        marker.split("=")[0]: marker.split("=")[1],
    }
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS"):
        env.pop(var, None)
    return env


def trained_ids(work: Path, ranks: int = 2) -> list[int]:
    """Every sample id the trainers logged (`--ids-log ids-{rank}.jsonl`), all ranks, in order."""
    ids = []
    for r in range(ranks):
        for line in (work / f"ids-{r}.jsonl").read_text().splitlines():
            ids += json.loads(line)["ids"]
    return ids


def surviving_steps(work: Path, rank: int) -> tuple[list[dict], dict[tuple[int, int], list[list[int]]]]:
    """Rank `rank`'s ids logs split by run (`ids-{rank}.run{k}.jsonl` of earlier commands, then
    `ids-{rank}.jsonl`) and torchrun restart: (the steps of the lineage that survives: each run's steps
    before the point the next run resumed at; every delivery of each (epoch, step), in order)."""
    runs: dict[tuple[int, int], list[dict]] = collections.defaultdict(list)
    deliveries: dict[tuple[int, int], list[list[int]]] = collections.defaultdict(list)
    files = sorted(work.glob(f"ids-{rank}.run*.jsonl")) + [work / f"ids-{rank}.jsonl"]
    for k, path in enumerate(files):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            runs[(k, entry["restart"])].append(entry)
            deliveries[(entry["epoch"], entry["step"])].append(entry["ids"])
    order = sorted(runs)
    kept = []
    for k, run in enumerate(order):
        later = runs[order[k + 1]] if k + 1 < len(order) else []
        resumed = min(((e["epoch"], e["step"]) for e in later), default=None)
        kept += [e for e in runs[run] if resumed is None or (e["epoch"], e["step"]) < resumed]
    return kept, deliveries


def restart_job(work: Path, lengths: list[int], deterministic: bool = True, epochs: int = 2) -> int:
    """Writes a 2-rank job over synthetic `lengths` into `work` (lengths.txt, job.toml journaling both
    services as `batchd config --example` does, updates of several steps); returns the node agent's port."""
    (work / "lengths.txt").write_text("\n".join(map(str, lengths)) + "\n")
    cport, aport = free_block(1), free_block(2)
    (work / "job.toml").write_text(
        '[job]\nworld_size = 2\ntoken_budget = 1024\npolicy = "balanced"\nwindow = 32\ndepth = 4\n'
        f"seed = 3\nepochs = {epochs}\ndeterministic = {str(deterministic).lower()}\n"
        "tokens_per_update = 3000\n"
        '[data]\nlengths = "lengths.txt"\n'
        f'[coordinator]\nport = {cport}\nlease_s = 60.0\nstate_dir = "state/coordinator"\n'
        f'[rank]\nbase_port = {aport}\nstate_dir = "state/ranks"\n'
    )
    return aport


def end_job(marker: str, timeout: float = 60.0) -> list[str]:
    """Lets the processes of the job with `marker` exit (up to `timeout`), kills what is left (by pid) and
    returns what was left, as "pid: cmdline". A deadline on liveness, not speed: Ray's workers exit once
    they find their raylet gone, which took more than 15 s beside two CPU burners (tests/test_two_jobs.py);
    a process that leaked stays for good."""
    deadline = time.monotonic() + timeout
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = processes_with_marker(marker)
    for entry in left:
        with contextlib.suppress(OSError):
            os.kill(int(entry.split(":", 1)[0]), signal.SIGKILL)
    return left
