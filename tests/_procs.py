"""Process and port helpers shared by the multi-process tests."""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

FREE_PORTS = (20000, 32768)  # below Linux's ephemeral range (32768-60999), which port-0 binds draw from


def free_block(n: int) -> int:
    """A port p with p .. p + n - 1 all free on loopback right now, drawn from `FREE_PORTS`: below the
    ephemeral range, so a server that another test process binds to port 0 meanwhile (CI runs the fast
    tests beside the slow ones) cannot take a port handed out here before its job binds it."""
    rng = random.Random(f"{os.getpid()}:{time.monotonic_ns()}")
    lo, hi = FREE_PORTS
    for _ in range(200):
        base = rng.randrange(lo, hi - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports in {FREE_PORTS}")


def processes_with_marker(marker: str) -> list[str]:
    """Live (non-zombie) processes whose environment holds `marker` ("NAME=value"), as "pid: cmdline"."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker.encode() not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found.append(f"{proc.name}: {cmd[:200]}")
    return found


def _stat(pid: int | str) -> list[str] | None:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(root: int) -> dict[int, str]:
    """Live descendants of `root` now, as {pid: start time} (a pid with another start time is reused).

    The environment marker alone can miss a process: one that sets its title (Ray's agents) zeroes the
    start of its environment block as /proc shows it, and the marker may fall there.
    """
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        fields = _stat(proc.name)
        if fields is None or fields[0] in ("Z", "X"):
            continue
        children.setdefault(int(fields[1]), []).append(int(proc.name))
        starts[int(proc.name)] = fields[19]
    found: dict[int, str] = {}
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        if pid not in found:
            found[pid] = starts[pid]
            stack.extend(children.get(pid, []))
    return found


def still_alive(snapshot: dict[int, str]) -> list[str]:
    """The processes of a `descendants` snapshot that are still alive (not zombies), as "pid: cmdline"."""
    found = []
    for pid, start in snapshot.items():
        fields = _stat(pid)
        if fields is None or fields[0] in ("Z", "X") or fields[19] != start:
            continue
        try:
            cmd = (
                (Path("/proc") / str(pid) / "cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
        except OSError:
            continue
        found.append(f"{pid}: {cmd[:200]}")
    return found


def start_times(pids: list[int]) -> dict[int, str]:
    """{pid: start time} of those of `pids` alive now, in the form `descendants` gives."""
    found = {}
    for pid in pids:
        fields = _stat(pid)
        if fields is not None and fields[0] not in ("Z", "X"):
            found[pid] = fields[19]
    return found


def wait_until(what, cond, timeout: float, log=lambda: "") -> None:
    """Waits until `cond()` holds, checking every 0.2 s; AssertionError naming `what` (and `log()`) after
    `timeout` seconds: a deadline on an event, never a sleep-then-assert."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout:g}s\n{log()}")


def spawn(fn, args: tuple, nprocs: int, limit_s: float = 600.0) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)` with a hang backstop: the processes are killed and
    AssertionError raised when they still run after `limit_s` (liveness, not speed: keep it generous).
    A process that raised re-raises here, as `spawn` does."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + limit_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(
                f"{nprocs} spawned processes of {fn.__name__} still ran after {limit_s:g}s (a hang)"
            )


def gloo_rank(
    rank: int, world: int, out_dir: str, run, args: tuple, hang_s: float, pg_timeout_s: float
) -> None:
    """A spawned rank: joins a gloo group (file rendezvous in `out_dir`), pickles `run(rank, *args)` to
    out_dir/rank{rank}.pkl, and leaves the group after a barrier (no rank tears its connections down while
    a peer may still be in a collective). Past `hang_s` faulthandler prints every thread's stack and exits."""
    import datetime
    import faulthandler
    import pickle

    import torch
    import torch.distributed as dist

    faulthandler.enable(all_threads=True)
    faulthandler.dump_traceback_later(hang_s, exit=True)  # a hang prints where it is
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    try:
        result = run(rank, *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def gloo_ranks(run, args: tuple, world: int, out_dir: Path, limit_s: float, pg_timeout_s: float) -> list:
    """`run(rank, *args)` on `world` spawned gloo ranks (`gloo_rank`): their results in rank order. A rank
    that raises fails here; ranks still running after `limit_s` are killed and AssertionError raised."""
    import pickle

    spawn(gloo_rank, (world, str(out_dir), run, args, limit_s - 20, pg_timeout_s), world, limit_s)
    return [pickle.loads((Path(out_dir) / f"rank{r}.pkl").read_bytes()) for r in range(world)]
