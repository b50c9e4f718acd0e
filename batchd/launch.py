"""Starting and stopping batchd's processes on one machine: what `batchd demo`, `batchd bench` and the
multi-process tests share.

`Processes` starts children in their own session with a run marker in their environment and stops them
all on any exit path (a `Reaper` process ends them even if the parent is SIGKILLed); `start_services`
starts a coordinator and N rank services (`batchd coordinator` / `batchd rank` as subprocesses) and
waits for their ports; `start_trainers` / `wait_trainers` run the demo trainer (`batchd._train.demo`) on
each rank. Linux only (PR_SET_PDEATHSIG, /proc).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchd.core import JobFailed, JobSpec
from batchd.proto import Progress

SERVICE_START_S = 120.0  # a rank service with --dataset starts its actors before it listens

__all__ = [
    "MARKER_ENV",
    "SERVICE_START_S",
    "Processes",
    "Reaper",
    "die_with_parent",
    "free_port",
    "rank_argv",
    "spec_argv",
    "start_node_agents",
    "start_services",
    "start_trainers",
    "wait_port",
    "wait_trainers",
]


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


def die_with_parent(argv: list[str]) -> list[str]:
    """`argv` wrapped so that the child is SIGTERMed when this process dies (Linux; elsewhere unchanged)."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _PARENT_DEATH_LAUNCHER, str(os.getpid()), *argv]


# The reaper (`Reaper`): blocks on a pipe whose only writer is the demo, so the read returns (EOF) when
# the demo exits, however it exits. It then ends the demo's processes (SIGTERM, then SIGKILL after a
# grace), except the demo itself if it is still alive (a normal exit), and removes the demo's temp dir.
# /proc only, no psutil.
#
# The demo's processes are those that carry its run marker in their environment, their descendants, and
# every process it saw as one while it waited. The marker alone misses some: a process that sets its
# title (Ray's agents, `ray::DashboardAgent`, via setproctitle) zeroes the start of its environment
# block in /proc/PID/environ, and where the marker falls there depends on the environment's order.
# Their parent (the raylet) carries it, so descent finds them while it lives, and the snapshot taken
# while waiting finds them once it is gone (they are reparented then). A (pid, start time) pair names a
# process, so a reused pid is never signalled.
_REAPER = r"""
import os, select, shutil, signal, sys, time
fd, parent, work, marker = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4].encode()
signal.signal(signal.SIGINT, signal.SIG_IGN)
me = os.getpid()

def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None

parent_start = start_time(parent)

def scan():
    # {pid: (ppid, start time, marked)} of live processes. A process that exits while it is read can
    # give a short or empty file (it counts as gone for this pass): nothing here may end the reaper.
    procs = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if fields[0] in (b"Z", b"X"):
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    has = marker in f.read().split(b"\0")
            except OSError:
                has = False  # another user's process
            procs[int(name)] = (int(fields[1]), fields[19], has)
        except (OSError, IndexError, ValueError):
            continue
    return procs

known = {}  # pid -> start time of each process seen as the demo's

def targets():
    procs = scan()
    children = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    roots = [pid for pid, (_, _, has) in procs.items() if has]
    if parent in procs and procs[parent][1] == parent_start:  # the demo, not a process that reused its pid
        roots += children.get(parent, [])
    found, stack = set(), roots
    while stack:
        pid = stack.pop()
        if pid not in found:
            found.add(pid)
            stack.extend(children.get(pid, []))
    found |= {pid for pid, start in known.items() if pid in procs and procs[pid][1] == start}
    found -= {me, parent}
    for pid in list(known):
        if pid not in procs or procs[pid][1] != known[pid]:
            del known[pid]
    known.update((pid, procs[pid][1]) for pid in found)
    return found

def signal_all(sig):
    pids = targets()
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    return pids

try:
    while True:
        if select.select([fd], [], [], 1.0)[0]:
            if not os.read(fd, 4096):
                break
        else:
            targets()
except OSError:
    pass

# SIGTERM, a grace, then SIGKILL again and again: a dying parent (Ray's raylet) may still spawn a child
# (its agents) after a pass, so the passes repeat until none is left (or 8 s passed). The temp dir goes
# whatever happens.
try:
    pids, deadline = signal_all(signal.SIGTERM), time.monotonic() + 2.0
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = targets()
    deadline = time.monotonic() + 6.0
    while pids and time.monotonic() < deadline:
        signal_all(signal.SIGKILL)
        time.sleep(0.1)
        pids = targets()
finally:
    shutil.rmtree(work, ignore_errors=True)
"""

MARKER_ENV = "BATCHD_DEMO_RUN"


class Reaper:
    """A process that cleans up after the demo when the demo exits, even by SIGKILL (see `_REAPER`).

    It ends every process whose environment holds `MARKER_ENV=<marker>`, every descendant of those and of
    this process, and every process it saw as one of them while this process lived; then it removes
    `work`. `close()` (the demo's normal exit) lets it run at once and waits for it.
    """

    def __init__(self, work: Path, marker: str) -> None:
        self.marker = marker
        read_fd, self._write_fd = os.pipe()  # neither end is inherited by other children (PEP 446)
        env = {k: v for k, v in os.environ.items() if k != MARKER_ENV}
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _REAPER,
                    str(read_fd),
                    str(os.getpid()),
                    str(work),
                    f"{MARKER_ENV}={marker}",
                ],
                pass_fds=(read_fd,),
                env=env,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        finally:
            os.close(read_fd)

    def close(self, timeout: float = 10.0) -> None:
        if self._write_fd is None:
            return
        os.close(self._write_fd)
        self._write_fd = None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


class Processes:
    """Children that are terminated (then killed) whatever happens.

    Each child runs in its own session (a terminal's Ctrl-C reaches only this process, which stops the
    children in order) and gets SIGTERM from the kernel when this process dies (Linux). `env` is added
    to every child's environment.
    """

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.log_dir = log_dir
        self.env = dict(env or {})

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **self.env}
        with open(self.log_dir / f"{name}.log", "w") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                die_with_parent(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
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


def wait_port(path: Path, proc: subprocess.Popen, name: str, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())["port"]
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode} before listening")
        time.sleep(0.05)
    raise TimeoutError(f"{name} did not listen within {timeout:g}s")


def spec_argv(spec: JobSpec) -> list[str]:
    """The `batchd coordinator` / `batchd rank` flags that give exactly `spec` (every leaf, by its key):
    the inverse of the CLI's flags, which are derived from the same `JobSpec` leaves (`JobSpec.keys`)."""
    argv = []
    for key, value in spec.keys().items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def rank_argv(
    spec: list[str],
    rank: int,
    coordinator_port: int,
    lengths_file: Path | None,
    port: int,
    port_file: Path,
    extra: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """The command line of rank service `rank` (`port` 0 picks a free one; no `lengths_file`: the data
    source comes from `extra`, e.g. `--dataset`)."""
    lengths = ["--lengths", str(lengths_file)] if lengths_file is not None else []
    return [
        sys.executable,
        "-m",
        "batchd",
        "rank",
        *spec,
        "--rank",
        str(rank),
        "--coordinator",
        f"127.0.0.1:{coordinator_port}",
        *lengths,
        "--port",
        str(port),
        "--port-file",
        str(port_file),
        *extra,
    ]


def start_services(
    procs: Processes,
    work: Path,
    spec: list[str],
    world_size: int,
    lengths_file: Path | None,
    coordinator_args: list[str] | tuple[str, ...] = (),
    rank_args: list[str] | tuple[str, ...] | Callable[[int], list[str]] = (),
) -> tuple[int, list[int]]:
    """Starts the coordinator ("coordinator") and the rank services ("rank-R") on free loopback ports;
    returns (coordinator port, rank service ports) once every one listens. `rank_args` may be a function
    of the rank."""
    coord = procs.start(
        "coordinator",
        [
            sys.executable,
            "-m",
            "batchd",
            "coordinator",
            *spec,
            "--port",
            "0",
            "--port-file",
            str(work / "coord.port"),
            *coordinator_args,
        ],
    )
    cport = wait_port(work / "coord.port", coord, "coordinator")
    ports = []
    procs_r = []
    for r in range(world_size):  # started together: each may spend seconds starting its Ray actors
        extra = rank_args(r) if callable(rank_args) else rank_args
        argv = rank_argv(spec, r, cport, lengths_file, 0, work / f"rank-{r}.port", extra)
        procs_r.append(procs.start(f"rank-{r}", argv))
    for r, p in enumerate(procs_r):
        ports.append(wait_port(work / f"rank-{r}.port", p, f"rank service {r}", SERVICE_START_S))
    return cport, ports


def start_node_agents(
    procs: Processes,
    work: Path,
    spec: list[str],
    world_size: int,
    local_ranks: int,
    lengths_file: Path | None,
    coordinator_args: list[str] | tuple[str, ...] = (),
    node_args: list[str] | tuple[str, ...] | Callable[[int], list[str]] = (),
) -> tuple[int, list[int]]:
    """Starts the coordinator ("coordinator") and world_size / local_ranks node agents ("node-G",
    serving ranks G*K .. G*K+K-1) on free loopback ports; returns (coordinator port, the service port
    of every rank: its agent's) once every one listens. `node_args` may be a function of the node
    rank G."""
    if local_ranks < 1 or world_size % local_ranks:
        raise ValueError(f"local_ranks must divide world_size, got {local_ranks=} {world_size=}")
    coord = procs.start(
        "coordinator",
        [
            sys.executable,
            "-m",
            "batchd",
            "coordinator",
            *spec,
            "--port",
            "0",
            "--port-file",
            str(work / "coord.port"),
            *coordinator_args,
        ],
    )
    cport = wait_port(work / "coord.port", coord, "coordinator")
    agents = []
    for g in range(world_size // local_ranks):
        extra = node_args(g) if callable(node_args) else node_args
        lengths = ["--lengths", str(lengths_file)] if lengths_file is not None else []
        agents.append(
            procs.start(
                f"node-{g}",
                [
                    sys.executable,
                    "-m",
                    "batchd",
                    "node",
                    *spec,
                    "--local-ranks",
                    str(local_ranks),
                    "--node-rank",
                    str(g),
                    "--name",
                    f"node-{g}",
                    "--coordinator",
                    f"127.0.0.1:{cport}",
                    *lengths,
                    "--port",
                    "0",
                    "--port-file",
                    str(work / f"node-{g}.port"),
                    *extra,
                ],
            )
        )
    ports = [
        wait_port(work / f"node-{g}.port", p, f"node agent {g}", SERVICE_START_S)
        for g, p in enumerate(agents)
    ]
    return cport, [ports[r // local_ranks] for r in range(world_size)]


def start_trainers(
    procs: Processes,
    work: Path,
    tag: str,
    world_size: int,
    common: dict[str, Any],
    per_rank: list[dict[str, Any]] | tuple[dict[str, Any], ...],
    module: str = "batchd._train.demo",
) -> tuple[int, list[Path]]:
    """Starts `world_size` trainer processes ("TAG-R") of `module` (`python -m module --config
    TAG-R.cfg.json`); returns (gloo master port, result paths)."""
    port = free_port()
    outs = []
    for r in range(world_size):
        cfg = {
            **common,
            **per_rank[r],
            "rank": r,
            "world_size": world_size,
            "master_port": port,
            "out": str(work / f"{tag}-{r}.json"),
        }
        cfg_path = work / f"{tag}-{r}.cfg.json"
        cfg_path.write_text(json.dumps(cfg))
        procs.start(f"{tag}-{r}", [sys.executable, "-m", module, "--config", str(cfg_path)])
        outs.append(Path(cfg["out"]))
    return port, outs


JOB_FAILED = "the job failed: "


def job_failure_line(log: str) -> str | None:
    """The reason in a trainer's one-line "... the job failed: WHY" (the last such line of `log`), or None."""
    for line in reversed(log.splitlines()):
        if JOB_FAILED in line:
            return line.split(JOB_FAILED, 1)[1].strip()
    return None


def progress_path(out: str | Path) -> Path:
    """Where a trainer whose result goes to `out` keeps its progress for `wait_trainers`."""
    return Path(out).with_suffix(".progress")


class StepTicker:
    """A trainer process's progress for its parent: samples and steps so far, in `progress_path(out)` as
    "SAMPLES STEPS", rewritten (atomically) at most every `period_s` by `tick`, and by `write` at the
    end. No collective in a timed loop: one `monotonic()` per step and a tiny file every `period_s`."""

    def __init__(self, out: str | Path, period_s: float = 0.5) -> None:
        self.path, self.period_s = progress_path(out), period_s
        self.samples = self.steps = 0
        self._last = time.monotonic()

    def tick(self, samples: int, steps: int = 1) -> None:
        self.samples += samples
        self.steps += steps
        if time.monotonic() - self._last >= self.period_s:
            self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".progress.tmp")
        tmp.write_text(f"{self.samples} {self.steps}\n")
        tmp.replace(self.path)
        self._last = time.monotonic()


def _read_progress(outs: list[Path]) -> tuple[int, int]:
    """(samples of every rank together, steps of the furthest rank) from the trainers' progress files."""
    samples = steps = 0
    for out in outs:
        try:
            a, b = progress_path(out).read_text().split()
        except (OSError, ValueError):  # not written yet
            continue
        samples, steps = samples + int(a), max(steps, int(b))
    return samples, steps


def _failed_trainer(procs: Processes, name: str, code: int | None, lines: int = 40) -> str:
    """A failed trainer's exit status and the end of its log: every one is shown, since the first
    (rank 0) often only saw a peer go away, and the cause is in that peer's own log."""
    tail = "\n".join(procs.log(name).splitlines()[-lines:])
    return f"trainer {name} exited with {code}:\n{tail}"


def wait_trainers(
    procs: Processes, tag: str, outs: list[Path], timeout: float, progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Waits for the "TAG-*" trainers; returns their results. `progress` (a `batchd.proto.Progress`)
    follows the trainers' `StepTicker`s meanwhile, and is closed.

    Raises `JobFailed` with the reason a failed trainer gave in its "the job failed: ..." line (the job
    failed: a party or the data), else RuntimeError with every failed trainer's status and log tail."""
    deadline = time.monotonic() + timeout
    mine = [(n, p) for n, p in procs.procs if n.startswith(f"{tag}-")]
    try:
        for _, p in mine:
            while True:
                try:
                    p.wait(
                        max(min(deadline - time.monotonic(), 0.5), 0.01)
                        if progress
                        else max(deadline - time.monotonic(), 1)
                    )
                    break
                except subprocess.TimeoutExpired:
                    if progress is None or time.monotonic() >= deadline:
                        raise TimeoutError(f"trainers {tag} did not finish within {timeout:g}s") from None
                    samples, steps = _read_progress(outs)
                    progress.update(samples - progress.n, steps - progress.steps)
        if progress is not None:
            samples, steps = _read_progress(outs)
            progress.update(samples - progress.n, steps - progress.steps)
    finally:
        if progress is not None:
            progress.close()
    bad = [(n, p.returncode) for n, p in mine if p.returncode != 0]
    if bad:
        for name, _ in bad:  # a trainer that heard the job fail says why in one line: that is the failure
            why = job_failure_line(procs.log(name))
            if why is not None:
                raise JobFailed(why)
        raise RuntimeError("\n".join(_failed_trainer(procs, name, code) for name, code in bad))
    return [json.loads(o.read_text()) for o in outs]
