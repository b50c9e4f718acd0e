"""`python -m batchd.train` as a user starts it, before (or without) its rank service.

- Pointed at an address nobody listens on, it logs whom it waits for and why every 5 s, and at the end
  of `--startup-timeout` exits 2 with one line naming the address, not a traceback.
- Started before its services (coordinator + rank service from one config file, started once the
  trainer said it waits), it trains the whole epoch, and, off a terminal, logs its progress in samples
  out of the job's total every $BATCHD_PROGRESS_S seconds.

Real processes through the real CLI; every wait is a deadline on an event (a log line, an exit).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _procs import free_block

PY = sys.executable
WAITING = "waiting for the rank service at 127.0.0.1:{port} (rank 0 of 1)"


def _free_port() -> int:
    return free_block(1)  # below the ephemeral range: no port-0 server elsewhere takes it meanwhile


def _trainer_env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def _until(what: str, cond, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g}s:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)


@pytest.mark.slow
def test_a_trainer_pointed_at_nobody_says_whom_it_waits_for_then_exits_2_in_one_line():
    port = _free_port()  # bound and released: nobody listens there
    proc = subprocess.run(
        [PY, "-m", "batchd.train", "--node-agent", f"127.0.0.1:{port}", "--startup-timeout", "8"],
        capture_output=True,
        text=True,
        env=_trainer_env(),
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    waiting = [ln for ln in lines if WAITING.format(port=port) in ln]
    assert waiting and all("Connection refused" in ln for ln in waiting), proc.stderr
    errors = [ln for ln in lines if "batchd.train: error:" in ln]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr
    assert f"127.0.0.1:{port}" in errors[0] and "unreachable for 8s" in errors[0], errors[0]
    assert "RankStatus retried every 0.2s since start-up" in errors[0], errors[0]


@pytest.mark.slow
def test_a_trainer_started_before_its_services_waits_then_trains_and_logs_progress_with_the_total(tmp_path):
    n = 120
    (tmp_path / "lengths.txt").write_text("".join(f"{1 + (7 * i) % 90}\n" for i in range(n)))
    cport, rport = _free_port(), _free_port()
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        f'[job]\nworld_size = 1\ntoken_budget = 256\npolicy = "local"\nwindow = 32\n'
        f'[data]\nlengths = "lengths.txt"\n[coordinator]\nport = {cport}\n[rank]\nbase_port = {rport}\n'
    )
    # >= 21 steps (5400 tokens, 256 a step) of >= 0.1 s: the 1 s progress interval passes at least once
    trainer_log = tmp_path / "trainer.log"
    logs = [open(tmp_path / name, "w") for name in ("trainer.log", "coord.log", "rank.log")]
    trainer = subprocess.Popen(
        [
            PY,
            "-m",
            "batchd.train",
            "--base-port",
            str(rport),
            "--startup-timeout",
            "120",
            "--step-time",
            "0.1",
            "--d-model",
            "16",
            "--n-layers",
            "1",
            "--n-heads",
            "2",
            "--summary",
            str(tmp_path / "summary.json"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=logs[0],
        env=_trainer_env(BATCHD_PROGRESS_S="1"),
        cwd=tmp_path,
    )
    procs = [trainer]
    try:
        _until("waiting line", lambda: WAITING.format(port=rport) in trainer_log.read_text(), 60, trainer_log)
        assert trainer.poll() is None
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for role, log in (("coordinator", logs[1]), ("rank", logs[2])):
            extra = ["--rank", "0"] if role == "rank" else []
            procs.append(
                subprocess.Popen(
                    [PY, "-m", "batchd", role, "--config", str(cfg), *extra],
                    stderr=log,
                    env=env,
                    cwd=tmp_path,
                )
            )
        assert trainer.wait(timeout=240) == 0, trainer_log.read_text()[-4000:]
        assert [p.wait(timeout=60) for p in procs[1:]] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    text = trainer_log.read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] > 0 and "Traceback" not in text, text[-4000:]
    line = re.compile(
        rf"rank 0: epoch 1/1: (\d+)/{n} samples \(\d+%\), (\d+) steps, [\d.]+ samples/s, ETA \w+"
    )
    periodic = [m for m in map(line.search, text.splitlines()) if m]
    assert periodic and all(0 < int(m.group(1)) < n for m in periodic), text[-4000:]
    assert re.search(
        rf"rank 0: epoch 1/1: {n}/{n} samples \(100%\), {summary['steps']} steps, done in", text
    ), text[-4000:]


@pytest.mark.slow
def test_a_trainer_whose_vocabulary_is_not_the_services_tokenizers_says_so_in_one_line(tmp_path):
    """Token ids past the model's embedding: one line naming --tokenizer, exit 2, not an IndexError traceback
    (the rank service serves ids of its tokenizer; the trainer was built for a smaller vocabulary)."""
    (tmp_path / "lengths.txt").write_text("".join(f"{20 + i}\n" for i in range(16)))
    cport, rport = _free_port(), _free_port()
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        f'[job]\nworld_size = 1\ntoken_budget = 256\nwindow = 16\n[data]\nlengths = "lengths.txt"\n'
        f"[coordinator]\nport = {cport}\n[rank]\nbase_port = {rport}\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    services = [
        subprocess.Popen(
            [PY, "-m", "batchd", role, "--config", str(cfg), *extra],
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=tmp_path,
        )
        for role, extra in (("coordinator", []), ("rank", ["--rank", "0"]))
    ]
    try:  # `batchd rank --lengths` serves ids below 512; this model has 8 rows
        proc = subprocess.run(
            [
                PY,
                "-m",
                "batchd.train",
                "--base-port",
                str(rport),
                "--vocab-size",
                "8",
                "--d-model",
                "16",
                "--n-layers",
                "1",
                "--n-heads",
                "2",
            ],
            capture_output=True,
            text=True,
            env=_trainer_env(),
            cwd=tmp_path,
            timeout=180,
        )
    finally:
        for p in services:
            p.kill()
            p.wait()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "batchd.train: error:" in ln]
    assert (
        len(errors) == 1 and "past the model's vocabulary of 8" in errors[0] and "--tokenizer" in errors[0]
    ), proc.stderr[-3000:]
