"""This host's processes as /proc shows them, for `_ray`: which belong to a Ray, and ending what is left
of a Ray that went away.

The seam with `_ray`: that module decides when a Ray is this job's (`job_ray_address`) and when one went
away (`SharedRay.watch`); this one only reads and signals processes: this user's pids (`own_pids`), the
Ray processes naming a GCS (`ray_processes`) and their job tag (`has_env`, `JOB_ENV`), a process tree
with start times (`descendants`, `start_time`: a reused pid is not the same process), liveness
(`alive`), and `end_leftovers` (SIGTERM, then SIGKILL, of the agents and workers a killed raylet left).
Where there is no /proc, every look finds nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

log = logging.getLogger("batchd.preprocess")

JOB_ENV = "BATCHD_RAY_JOB"  # carried by the processes of an embedded Ray: the key of the job that started it


def own_pids() -> list[int]:
    """The pids of this user's processes on this host, ascending (a /proc scan; [] where there is none)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    out = []
    with contextlib.suppress(OSError):
        for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
            with contextlib.suppress(OSError):
                if uid is None or os.stat(f"/proc/{pid}").st_uid == uid:
                    out.append(pid)
    return out


def has_env(pid: int, tag: bytes) -> bool:
    """Whether process `pid` started with `tag` ("NAME=value") in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return tag in f.read().split(b"\0")
    except OSError:
        return False


def ray_processes() -> list[tuple[int, str]]:
    """(pid, cmdline) of this user's Ray processes on this host that name a GCS (`--gcs-address=`)."""
    out = []
    for pid in own_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if "--gcs-address=" in cmd:
            out.append((pid, cmd))
    return out


AGENT_START_S = 30.0  # a raylet starts its agents within this many seconds of its own start


def orphaned_agents(raylet_start: str | None) -> set[int]:
    """This user's Ray processes (`ray::` titles) left without a parent (adopted by pid 1) that started
    within AGENT_START_S of the raylet started at `raylet_start` (clock ticks since boot, /proc's): the
    agents of that raylet when it was killed before the watch saw them."""
    if raylet_start is None:
        return set()
    lo = int(raylet_start)
    hi = lo + int(AGENT_START_S * os.sysconf("SC_CLK_TCK"))
    out = set()
    for pid in own_pids():
        fields = stat(pid)
        if not fields or fields[0] in ("Z", "X") or fields[1] != "1" or not lo <= int(fields[19]) <= hi:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::"):
                    out.add(pid)
        except OSError:
            continue
    return out


def end_leftovers(
    job: str | None, family: dict[int, str], raylet_start: str | None = None, grace_s: float = 5.0
) -> None:
    """Ends what is left of an embedded Ray that went away: Ray's agents (DashboardAgent, RuntimeEnvAgent)
    and workers outlive a raylet killed with SIGKILL. Only processes this Ray started: its raylet's
    descendants seen alive (`family`, {pid: start time}, so a reused pid is spared), its agents orphaned
    before the watch saw them (`orphaned_agents`, by the raylet's start time) and those
    carrying this job's `$BATCHD_RAY_JOB` (inherited from this process when it started that Ray; Ray's
    agents may hide it, setting their title over it); never this process."""
    mine = {pid for pid, start in family.items() if start_time(pid) == start} | orphaned_agents(raylet_start)
    if job:
        tag = f"{JOB_ENV}={job}".encode()
        mine.update(pid for pid in own_pids() if has_env(pid, tag))
    mine.discard(os.getpid())
    for sig in (15, 9):  # SIGTERM, then SIGKILL for what is still there after the grace
        for pid in mine:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while sig == 15 and time.monotonic() < deadline and any(alive(p) for p in mine):
            time.sleep(0.1)
    if mine:
        log.info("ended %d leftover process(es) of the Ray that went away", len(mine))


def stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    fields = stat(pid)
    return fields[19] if fields and fields[0] not in ("Z", "X") else None


def descendants(root: int) -> dict[int, str]:
    """The live descendants of `root`, as {pid: start time}."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                fields = stat(int(name))
                if fields and fields[0] not in ("Z", "X"):
                    children.setdefault(int(fields[1]), []).append(int(name))
                    starts[int(name)] = fields[19]
    found: dict[int, str] = {}
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        if pid not in found and pid in starts:
            found[pid] = starts[pid]
            stack.extend(children.get(pid, []))
    return found


def alive(pid: int) -> bool:
    fields = stat(pid)
    return bool(fields) and fields is not None and fields[0] not in ("Z", "X")
