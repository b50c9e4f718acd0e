"""A new user's first day (issue 41): what a fresh clone and the README meet, through the real CLI.

Each defect is checked where the user meets it: `batchd ...` in a subprocess (exit status, the lines on
stderr), from a temporary working directory, never from the checkout. Waits are deadlines on events.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _procs import free_block, wait_until

import batchd
from batchd import bench
from batchd.core import BlockLayout, BlockView
from batchd.preprocess import RecordDataset, demo_tokenizer

PACKAGE_WORKLOADS = Path(batchd.__file__).resolve().parent / "workloads"


def _env() -> dict[str, str]:
    """The user's environment: `batchd` on PATH, no torchrun or Ray variables, no workload override."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS"):
        env.pop(var, None)
    for var in ("BATCHD_WORKLOADS", "BATCHD_NODE_AGENT", "TORCHELASTIC_ERROR_FILE"):
        env.pop(var, None)
    return env


def _run(*args: str, cwd: Path, timeout: float):
    return subprocess.run(
        ["batchd", *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )


# -- 1. the bench's default workload ships with the package --------------------------------------------
def test_every_default_workload_is_package_data(monkeypatch):
    """The bench's defaults (CPU, CUDA) resolve inside the installed package, not in a `shared` folder
    beside a checkout; the files are the public length files (one positive integer per line)."""
    monkeypatch.delenv("BATCHD_WORKLOADS", raising=False)
    for device in bench.DEFAULTS.values():
        found = bench.default_workload(device["workload"])
        assert found is not None and found.resolve().parent == PACKAGE_WORKLOADS, (device, found)
        lengths = found.read_text().split()
        assert len(lengths) == 4096 and all(int(x) > 0 for x in lengths), found
    names = sorted(p.name for p in PACKAGE_WORKLOADS.iterdir())
    assert names == ["llava-like.txt", "odb-synthetic.txt", "sharegpt4o-like.txt", "ultrachat-like.txt"]


# -- 2. the demo's baseline is fixed batching at B=2 ----------------------------------------------------
@pytest.mark.slow
def test_demo_compares_with_fixed_batching_at_b2_and_says_so(tmp_path):
    """L=2048 and synthetic samples of at most 511 tokens: the old OOM-safe rule would pick B=4; the
    baseline is B=2, the bench's, and the printed report says it."""
    proc = _run(
        "demo", "--synthetic", "--num-samples", "40", "--token-budget", "2048", cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout.splitlines()
    fixed = [ln for ln in out if ln.startswith("fixed batching ")]
    assert len(fixed) == 1 and "at batch size B=2 (as batchd bench)" in fixed[0], proc.stdout
    speedup = [ln for ln in out if ln.startswith("speedup ")]
    assert len(speedup) == 1 and speedup[0].endswith("x over fixed batching at B=2"), proc.stdout
    assert "fixed batching at batch size B=2 (as batchd bench)" in proc.stderr, proc.stderr[-3000:]


# -- 3. batchd torchrun ends a failed job with the trainers' own lines ----------------------------------
def _tail_after(err: str, header: str) -> list[str]:
    lines = err.splitlines()
    assert header in lines, err[-3000:]
    return lines[lines.index(header) + 1 :]


@pytest.mark.slow
def test_torchrun_failure_ends_in_the_trainers_one_line_errors(tmp_path):
    """Two trainers that cannot find their rank service: exit 1, then the ranks' own lines, no traceback
    and no torchrun failure summary."""
    proc = _run("torchrun", "--nproc-per-node", "2", "-m", "batchd.train", cwd=tmp_path, timeout=240)
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    for noise in ("Traceback", "ChildFailedError", "Root Cause", "error_file"):
        assert noise not in err, err[-3000:]
    tail = _tail_after(err, "batchd torchrun: the worker group failed:")
    assert len(tail) == 2 and tail[0].startswith("[rank 0] ") and tail[1].startswith("[rank 1] "), tail
    reason = "batchd.train: error: where is the rank service? pass --node-agent HOST:PORT"
    assert any(reason in line for line in tail), tail  # the rank that failed first says it in its own words
    for line in tail:  # the other one too, or (torchrun stopped it first) how it ended
        assert reason in line or "ended by SIGTERM" in line, tail


@pytest.mark.slow
def test_torchrun_failure_without_an_error_line_names_the_exit_status(tmp_path):
    """A trainer that exits without an error line of its own (argparse's usage error, before batchd's
    handling): its exit status, in one line."""
    args = ("torchrun", "--nproc-per-node", "1", "-m", "batchd.train", "--no-such-flag")
    proc = _run(*args, cwd=tmp_path, timeout=240)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    tail = _tail_after(proc.stderr, "batchd torchrun: the worker group failed:")
    assert tail == ["[rank 0] exited with status 2 (its own lines above say why)"], tail
    assert "unrecognized arguments: --no-such-flag" in proc.stderr, proc.stderr[-3000:]


def test_a_trainer_flag_error_is_its_one_line_and_its_torchrun_error_file(monkeypatch, capsys, tmp_path):
    """`--epochs 0` is a flag error (exit 2, `[rank R] batchd.train: error: ...`, README "Exit statuses";
    it was exit 1 without the prefix), and under torchrun the same line is the rank's error file, in the
    format torch.distributed.elastic reads (what `batchd torchrun` prints at the end)."""
    from batchd import train

    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert train.main(["--base-port", "7100", "--epochs", "0"]) == 2
    finally:  # the trainer's quiet-stop handlers are not this test process's
        for s, handler in handlers.items():
            signal.signal(s, handler)
    line = "[rank 0] batchd.train: error: --epochs must be >= 1, got 0"
    assert capsys.readouterr().err.strip() == line
    message = json.loads((tmp_path / "error.json").read_text())["message"]
    assert message["message"] == line == message["extraInfo"]["py_callstack"], message


# -- 4. the services' promised lines (README, "Exit statuses") ------------------------------------------
def _job(tmp_path: Path, world_size: int = 2) -> tuple[Path, int]:
    """A synthetic job's config (no Ray) on free ports; returns (config, the coordinator's port)."""
    port = free_block(2 * world_size + 2)
    (tmp_path / "lengths.txt").write_text("".join(f"{100 + 37 * i}\n" for i in range(16)))
    config = tmp_path / "job.toml"
    config.write_text(
        f'[job]\nworld_size = {world_size}\ntoken_budget = 1024\n[data]\nlengths = "lengths.txt"\n'
        f"[coordinator]\nport = {port}\nstartup_timeout_s = 3.0\nlease_s = 2.0\n"
        f"[rank]\nbase_port = {port + 1}\nclient_grace_s = 1.0\n"
    )
    return config, port


def _stopped(args: list[str], sig: int, tmp_path: Path) -> tuple[int, str]:
    """Starts `batchd ARGS --port-file`, sends `sig` once it serves; (exit status, stderr)."""
    port_file = tmp_path / f"port-{sig}.json"
    proc = subprocess.Popen(
        ["batchd", *args, "--port-file", str(port_file)],
        cwd=tmp_path,
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(f"{args[0]} serving", port_file.exists, 120)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_coordinator_interrupted_says_so(tmp_path, sig, status):
    config, _ = _job(tmp_path)
    code, err = _stopped(["coordinator", "--config", str(config)], sig, tmp_path)
    assert code == status and err.splitlines()[-1] == "batchd coordinator: interrupted", (code, err[-2000:])
    assert "Traceback" not in err, err[-2000:]


def test_node_agent_interrupted_says_so(tmp_path):
    config, _ = _job(tmp_path)
    args = ["node", "--config", str(config), "--local-ranks", "2", "--node-rank", "0"]
    code, err = _stopped(args, signal.SIGINT, tmp_path)
    assert code == 130 and err.splitlines()[-1] == "batchd node: interrupted", (code, err[-2000:])


@pytest.mark.slow
def test_coordinator_and_node_agent_end_a_failed_job_with_its_reason(tmp_path):
    """Rank 1 never registers: the coordinator fails the job after its start-up timeout; it and the node
    agent of rank 0 end with `batchd CMD: the job failed: <reason>`, exit 1, not a log line."""
    config, _ = _job(tmp_path)
    coordinator = subprocess.Popen(
        ["batchd", "coordinator", "--config", str(config)],
        cwd=tmp_path,
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        node = _run(
            "node",
            "--config",
            str(config),
            "--local-ranks",
            "1",
            "--node-rank",
            "0",
            cwd=tmp_path,
            timeout=120,
        )
        _, coord_err = coordinator.communicate(timeout=60)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
    reason = "rank(s) [1] did not register within the start-up timeout (3s)"
    assert coordinator.returncode == 1, coord_err[-2000:]
    assert coord_err.splitlines()[-1] == f"batchd coordinator: the job failed: {reason}", coord_err[-2000:]
    assert node.returncode == 1, node.stderr[-2000:]
    last = node.stderr.splitlines()[-1]
    assert last.startswith("batchd node: the job failed: ") and reason in last, node.stderr[-2000:]


# -- 5. and 6. bad records: non-UTF-8 lines quarantined; the limit judges the job's share --------------
def _record(i: int, word: str = "plus") -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"What is {i} {word} {i}?"},
            {"role": "assistant", "content": f"It is {2 * i}."},
        ]
    }


def _views(path: Path, world_size: int = 2) -> list[set[int]]:
    """The ids each rank of the demo reads (seed 0, epoch 0, shuffled: the demo's job)."""
    ds = RecordDataset(str(path))
    return [
        set(BlockView(BlockLayout(ds.block_rows, ds.block_bytes), r, world_size).ids())
        for r in range(world_size)
    ]


def _records_file(path: Path, schema_bad: set[int], latin1: set[int], n: int = 66) -> Path:
    lines = []
    for i in range(n):
        if i in schema_bad:
            lines.append(json.dumps({"messages": "hello there"}).encode())
        elif i in latin1:  # a good record, but not UTF-8: "café" in Latin-1
            lines.append(json.dumps(_record(i, "café"), ensure_ascii=False).encode("latin-1"))
        else:
            lines.append(json.dumps(_record(i)).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.slow
def test_a_file_9_percent_bad_passes_the_default_limit_though_one_rank_reads_13_percent(tmp_path):
    """66 records, 6 bad (9.1%): 4 in the view of the rank that reads 31 (12.9%, above the default 10%),
    2 of them Latin-1 lines in the other's. The job passes: the limit judges the job's records; and the
    non-UTF-8 lines are quarantined and counted (they were decoded with U+FFFD and trained)."""
    probe = _records_file(tmp_path / "probe.jsonl", set(), set())
    small, large = sorted(_views(probe), key=len)
    assert len(small) == 31 and len(large) == 35, (len(small), len(large))
    schema_bad, latin1 = set(sorted(small)[:4]), set(sorted(large)[:2])
    data = _records_file(tmp_path / "mine.jsonl", schema_bad, latin1)
    assert _views(data) == _views(probe)  # the bad lines moved no record to another rank
    assert len(schema_bad) / len(small) > 0.1 > (len(schema_bad) + len(latin1)) / 66

    proc = _run("demo", "--dataset", str(data), "--no-baseline", "--json", cwd=tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    pre = json.loads(proc.stdout.strip().splitlines()[-1])["preprocess"]
    kept_file = Path(pre["quarantine_file"])  # the demo keeps it beside its temporary directory
    kept = [json.loads(line) for line in kept_file.read_text().splitlines()]
    kept_file.unlink()
    assert pre["reasons"] == {"schema": 4, "invalid_utf8": 2}, pre
    assert pre["quarantined"] == 6 and pre["samples"] == 60 and pre["records_read"] == 66, pre
    utf8 = {q["id"]: q["reason"] for q in kept if q["reason"].startswith("invalid_utf8")}
    assert set(utf8) == latin1, kept
    assert all(r.startswith("invalid_utf8: byte 0xe9 at column ") for r in utf8.values()), utf8


@pytest.mark.slow
def test_a_file_above_the_limit_overall_fails_naming_the_share(tmp_path):
    """66 records, 8 bad (12.1%), 4 in each rank's view: the job fails, one line naming the job's share."""
    probe = _records_file(tmp_path / "probe.jsonl", set(), set())
    views = _views(probe)
    bad = set(sorted(views[0])[:4]) | set(sorted(views[1])[:4])
    data = _records_file(tmp_path / "mine.jsonl", bad, set())
    proc = _run("demo", "--dataset", str(data), "--no-baseline", cwd=tmp_path, timeout=400)
    err = proc.stderr
    assert proc.returncode == 1 and "Traceback" not in err, (proc.returncode, err[-3000:])
    failed = [ln for ln in err.splitlines() if ln.startswith("batchd demo: the job failed: ")]
    assert len(failed) == 1, err[-3000:]
    Path(failed[0].split("; see ", 1)[1].split(". Fix the data", 1)[0]).unlink()  # the demo's kept copy
    assert "8 of the 66 records ranks 0, 1 read (12.1%) are bad" in failed[0], failed[0]
    assert "max_bad_fraction = 0.1" in failed[0] and "by reason: schema 8" in failed[0], failed[0]


# -- 7. a second node agent on a running job's config fails at once on its port -------------------------
def test_node_agent_on_a_port_in_use_fails_at_once_naming_it(tmp_path):
    """The port a node agent would serve on is held (as by a running agent of the same job): `batchd node`
    exits 2 in one line naming the port and the process holding it, before it starts or joins a Ray."""
    port = free_block(3)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(_record(i)) + "\n" for i in range(8)))
    demo_tokenizer(tmp_path / "tok.json")
    config = tmp_path / "job.toml"
    config.write_text(
        '[job]\nworld_size = 2\ntoken_budget = 1024\n[data]\ndataset = "train.jsonl"\n'
        f'[pipeline]\ntokenizer = "tok.json"\n[coordinator]\nport = {port}\n[rank]\nbase_port = {port + 1}\n'
    )
    with socket.socket() as held:
        held.bind(("127.0.0.1", port + 1))
        held.listen()
        proc = _run(
            "node",
            "--config",
            str(config),
            "--local-ranks",
            "2",
            "--node-rank",
            "0",
            cwd=tmp_path,
            timeout=120,
        )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert lines[0].startswith(
        f"batchd node: error: the node agent's port {port + 1} on 127.0.0.1 is in use"
    ), lines
    assert f"by pid {os.getpid()} " in lines[0], lines  # what holds it: this test's process
