"""`batchd demo`: the main job on an embedded default, end to end, against fixed batching.

One command starts the coordinator, N rank services (each feeding its rank from a synthetic tokenized
dataset with long-tail realized lengths), and N trainer processes (torch.distributed gloo on CPU) that
train a tiny causal LM for one epoch through the batchd client. Then it runs the same model on the same
samples with fixed batching (DistributedSampler semantics, OOM-safe batch size floor(L / longest))
and reports both. Every process is a child of this one and is terminated on any exit path.

Why the tiny model is compute-bound: each step costs ~6 x 0.5M params x padded tokens FLOPs (about
3 GFLOP for a 1024-token step, ~100 ms on one CPU thread) while the per-step overhead (2 MB gloo
all-reduce, AdamW over 0.5M params, Python) is a few ms, so wall time follows padded tokens and step
count, which is what batching changes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

DEMO_BUDGET = 1024


def demo_lengths(num_samples: int, seed: int = 7, longest: int = 512) -> list[int]:
    """A long-tail length mix like ODB's synthetic benchmark (72% short, 22% medium, 6% long), scaled
    so the longest sample is `longest` tokens."""
    rng = np.random.default_rng(seed)
    scale = longest / 4096
    n_short, n_med = int(num_samples * 0.72), int(num_samples * 0.22)
    parts = [rng.integers(64, 384, n_short), rng.integers(384, 1400, n_med),
             rng.integers(1400, 4096, num_samples - n_short - n_med)]
    lengths = np.maximum((np.concatenate(parts) * scale).astype(int), 2)
    rng.shuffle(lengths)
    return lengths.tolist()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Runs in each child before it execs the real command: Linux then sends it SIGTERM when the demo dies,
# even by SIGKILL (PR_SET_PDEATHSIG survives exec). A launcher rather than Popen(preexec_fn=...): a
# preexec_fn forces a plain fork() that runs the parent's at-fork handlers, and gRPC's abort the child
# (epoll_wait: Bad file descriptor) when the parent has gRPC threads, as a test driving the daemon does.
_PARENT_DEATH_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(143)  # the parent is already gone\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def _die_with_parent(argv: list[str]) -> list[str]:
    """`argv` wrapped so that the child is SIGTERMed when this process dies (Linux; elsewhere unchanged)."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _PARENT_DEATH_LAUNCHER, str(os.getpid()), *argv]


class Processes:
    """Children that are terminated (then killed) whatever happens."""

    def __init__(self, log_dir: Path) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.log_dir = log_dir

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(self.log_dir / f"{name}.log", "w") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(_die_with_parent(argv), stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append((name, proc))
        return proc

    def get(self, name: str) -> subprocess.Popen:
        return dict(self.procs)[name]

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def stop(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5
        for _, p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait_port(path: Path, proc: subprocess.Popen, name: str, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())["port"]
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode} before listening")
        time.sleep(0.05)
    raise TimeoutError(f"{name} did not listen within {timeout:g}s")


def spec_args(world_size: int, budget: int, policy: str, window: int, depth: int, seed: int) -> list[str]:
    return ["--world-size", str(world_size), "--token-budget", str(budget), "--policy", policy,
            "--window", str(window), "--depth", str(depth), "--seed", str(seed)]


def rank_argv(spec: list[str], rank: int, coordinator_port: int, lengths_file: Path, port: int,
              port_file: Path, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The command line of rank service `rank` (`port` 0 picks a free one)."""
    return [sys.executable, "-m", "batchd", "rank", *spec, "--rank", str(rank),
            "--coordinator", f"127.0.0.1:{coordinator_port}", "--lengths", str(lengths_file),
            "--port", str(port), "--port-file", str(port_file), *extra]


def start_services(procs: Processes, work: Path, spec: list[str], world_size: int, lengths_file: Path,
                   coordinator_args: list[str] | tuple[str, ...] = (),
                   rank_args: list[str] | tuple[str, ...] = ()) -> tuple[int, list[int]]:
    """Starts the coordinator ("coordinator") and the rank services ("rank-R") on free loopback ports;
    returns (coordinator port, rank service ports) once every one listens."""
    coord = procs.start("coordinator", [sys.executable, "-m", "batchd", "coordinator", *spec, "--port", "0",
                                        "--port-file", str(work / "coord.port"), *coordinator_args])
    cport = _wait_port(work / "coord.port", coord, "coordinator")
    ports = []
    for r in range(world_size):
        argv = rank_argv(spec, r, cport, lengths_file, 0, work / f"rank-{r}.port", rank_args)
        p = procs.start(f"rank-{r}", argv)
        ports.append(_wait_port(work / f"rank-{r}.port", p, f"rank service {r}"))
    return cport, ports


def start_trainers(procs: Processes, work: Path, tag: str, world_size: int, common: dict[str, Any],
                   per_rank: list[dict[str, Any]]) -> tuple[int, list[Path]]:
    """Starts `world_size` trainer processes ("TAG-R"); returns (gloo master port, result paths)."""
    port = free_port()
    outs = []
    for r in range(world_size):
        cfg = {**common, **per_rank[r], "rank": r, "world_size": world_size, "master_port": port,
               "out": str(work / f"{tag}-{r}.json")}
        cfg_path = work / f"{tag}-{r}.cfg.json"
        cfg_path.write_text(json.dumps(cfg))
        procs.start(f"{tag}-{r}", [sys.executable, "-m", "batchd.client._trainer", "--config", str(cfg_path)])
        outs.append(Path(cfg["out"]))
    return port, outs


def wait_trainers(procs: Processes, tag: str, outs: list[Path], timeout: float) -> list[dict[str, Any]]:
    """Waits for the "TAG-*" trainers; raises with the first failing one's log, else returns results."""
    deadline = time.monotonic() + timeout
    mine = [(n, p) for n, p in procs.procs if n.startswith(f"{tag}-")]
    for _, p in mine:
        try:
            p.wait(max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"trainers {tag} did not finish within {timeout:g}s") from None
    bad = [(n, p.returncode) for n, p in mine if p.returncode != 0]
    if bad:
        name = bad[0][0]
        raise RuntimeError(f"trainer {name} exited with {bad[0][1]}:\n{procs.log(name)}")
    return [json.loads(o.read_text()) for o in outs]


def _trainers(procs: Processes, work: Path, tag: str, world_size: int, common: dict[str, Any],
              per_rank: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    _, outs = start_trainers(procs, work, tag, world_size, common, per_rank)
    return wait_trainers(procs, tag, outs, timeout)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_demo(world_size: int = 2, num_samples: int = 1024, token_budget: int = DEMO_BUDGET, policy: str = "balanced",
             window: int = 128, depth: int = 4, seed: int = 0, baseline: bool = True, progress=None,
             timeout: float = 900.0, keep_dir: bool = False) -> dict[str, Any]:
    """Runs the demo; returns the summary dict `batchd demo --json` prints."""
    say = progress or (lambda msg: None)
    if threading.current_thread() is threading.main_thread():  # SIGTERM unwinds like Ctrl-C: children stop
        signal.signal(signal.SIGTERM, _raise_interrupt)
    work = Path(tempfile.mkdtemp(prefix="batchd-demo-"))
    procs = Processes(work)
    lengths = demo_lengths(num_samples)
    lengths_file = work / "lengths.txt"
    lengths_file.write_text("\n".join(map(str, lengths)) + "\n")
    t_start = time.perf_counter()
    try:
        spec = spec_args(world_size, token_budget, policy, window, depth, seed)
        say(f"starting coordinator and {world_size} rank services ({num_samples} samples, L={token_budget}, "
            f"policy {policy})")
        _, ports = start_services(procs, work, spec, world_size, lengths_file)
        say(f"training one epoch on {world_size} gloo DDP trainers through batchd")
        results = _trainers(procs, work, "batchd", world_size, {"mode": "batchd", "seed": seed},
                            [{"service": f"127.0.0.1:{ports[r]}"} for r in range(world_size)], timeout)
        summary = summarize(lengths, results)
        summary["startup_and_teardown_s"] = time.perf_counter() - t_start - summary["wall_s"]
        if baseline:
            bs = max(1, token_budget // max(lengths))
            say(f"baseline: the same epoch with fixed batching (batch size {bs})")
            base = _trainers(procs, work, "fixed", world_size,
                             {"mode": "fixed", "seed": seed, "lengths": lengths, "batch_size": bs},
                             [{} for _ in range(world_size)], timeout)
            b = summarize(lengths, base, check_coverage=False)
            summary["baseline"] = {"wall_s": b["wall_s"], "steps": b["steps_per_rank"][0], "batch_size": bs,
                                   "padding_efficiency": b["padding_efficiency"], "loss_last": b["loss_last"]}
            summary["speedup"] = b["wall_s"] / summary["wall_s"]
        return summary
    finally:
        procs.stop()
        if not keep_dir:
            shutil.rmtree(work, ignore_errors=True)


def summarize(lengths: list[int], results: list[dict[str, Any]], check_coverage: bool = True) -> dict[str, Any]:
    ids = [i for r in results for step in r["sample_ids"] for i in step]
    counts: dict[int, int] = {}
    for i in ids:
        counts[i] = counts.get(i, 0) + 1
    real = sum(r["real_tokens"] for r in results)
    padded = sum(r["padded_tokens"] for r in results)
    losses = [x for x in results[0]["losses"] if x == x]
    return {
        "steps_per_rank": [r["steps"] for r in results],
        "emitted": len(ids),
        "missing": sum(1 for i in range(len(lengths)) if i not in counts),
        "duplicates": sum(c - 1 for c in counts.values() if c > 1),
        "idle": sum(r["idle"] for r in results),
        "real_tokens": real, "padded_tokens": padded,
        "padding_efficiency": real / padded if padded else 1.0,
        "wall_s": max(r["wall_s"] for r in results),
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
    }
