"""What restarts cost: the steps a rank service holds for a rewind, and each kind of failure's recovery.

Part 1, held steps (in process: `tests/_jobs.InProcessJob`, a coordinator and 2 rank services over loopback
gRPC, the odb-synthetic workload, L=8192, balanced, window 64, depth 8): 2 trainer threads take a
checkpoint (`BatchClient.state_dict()`) every N steps for N in `--intervals`, padded and packed, and crash
at step 3.5 N. Measured per rank: the bytes of one held batch (mean), the most bytes held for a rewind over
the run (the steps since the older of the last two checkpoints: up to 2 N, just before a checkpoint), the
time from a restarted trainer's connect to its first batch (a rewind N / 2 steps back, served from memory),
and the same from the moment both rank services were killed and started again from their journals (the
held steps re-made from the source) to that first batch.

Part 2, failures (real processes, the README recipe's defaults: the config journals both services,
`client_grace_s` 600, `batchd torchrun --max-restarts 3`, `python -m batchd.train --checkpoint-every 5`, a
node agent of 2 ranks, 1 s steps): one job per kind of failure, each injected once after `--fault-after`
steps: a trainer that dies (`--crash-at`); the node agent, the coordinator, and (in the per-rank layout:
one `batchd rank` per trainer rank) a rank service SIGKILLed and started again at once with the same
command (a supervisor's `restart: on-failure`). Measured from the logs: the time to notice it (torchrun's
failure line; the coordinator's "stream broke" line; the node agent's "stream to the coordinator ...
broke" or "coordinator ... is unreachable" line; the trainer's first "waiting for the rank service" line,
which comes after 5 s of retries), how long training stood still (the widest gap between rank 0's steps
after the fault, less one step time: the trainers go on with the batches already made while a service
restarts), and the samples lost and duplicated in the lineage that survives (both must be 0).

Usage: python benchmarks/restart.py [--intervals 10,50] [--fault-after 12] [--step-time 1.0] [--out PATH]
       [--print]
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import DEFAULT_WORKLOADS, add_common_args, command_line, finish, machine  # noqa: E402

SECTION = "restart"
MEASURES = ("benchmarks/restart.py", "batchd", "client", "service", "proto", "core")
BUDGET = 8192


# -- part 1: held steps ------------------------------------------------------------------------------------
def held(collate: str, interval: int, lengths: list[int], work: Path) -> dict[str, Any]:
    from _jobs import job_pool

    from batchd.core import JobSpec, PolicySpec

    spec = JobSpec(
        world_size=2,
        token_budget=BUDGET,
        seed=3,
        policy=PolicySpec(name="balanced", window=64, depth=8, collate=collate),
    )
    out: dict[str, Any] = {"collate": collate, "interval": interval}
    with job_pool() as start:
        job = start(spec, lengths, rank_state_dir=work)
        peaks = [0, 0]
        sizes: list[float] = []
        states: list[list[dict]] = [[], []]
        stop_at = 3 * interval + interval // 2  # a crash halfway between two checkpoints

        def trainer(r: int) -> None:
            with job.client(r) as c:
                for n, _ in enumerate(c, 1):
                    if n % interval == 0:
                        states[r].append(c.state_dict())
                    streams = job.cores[r].streams
                    with job.cores[r].cond:
                        peaks[r] = max(peaks[r], streams.held_bytes())
                        consumed = [i for i in streams.batches if i < job.cores[r].delivery.acked]
                        if consumed:
                            sizes.append(streams.held_bytes() / len(consumed))
                    if n == stop_at:
                        return

        threads = [threading.Thread(target=trainer, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["batch_bytes"] = sum(sizes) / len(sizes)
        out["held_mib"] = max(peaks) / 2**20
        out["rewind_first_batch_s"] = first_batch(job, states)
        t0 = time.perf_counter()
        for r in range(2):  # killed and started again: the journal's held steps are re-made
            job.restart_rank(r)
        out["restored_first_batch_s"] = time.perf_counter() - t0 + first_batch(job, states)
    return out


def first_batch(job: Any, states: list[list[dict]]) -> float:
    """Both trainers restarted from their last checkpoint: the slower one's time to its first batch."""
    took = [0.0, 0.0]

    def one(r: int) -> None:
        with job.client(r, reconnect_timeout_s=60) as c:
            c.load_state_dict(states[r][-1])
            t0 = time.perf_counter()
            next(iter(c))
            took[r] = time.perf_counter() - t0

    threads = [threading.Thread(target=one, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(took)


# -- part 2: failures --------------------------------------------------------------------------------------
def _commands(
    kind: str, aport: int, fault_after: int, step_time: float
) -> tuple[dict[str, list[str]], list[str]]:
    """The job's service commands by party name (the coordinator, then `batchd rank` x 2 for `kind` "rank",
    else one `batchd node`) and the trainers' `batchd torchrun` (crashing rank 0 at `fault_after` for
    "trainer")."""
    argv = {"coordinator": ["batchd", "coordinator", "--config", "job.toml"]}
    if kind == "rank":  # the per-rank layout: one `batchd rank` per trainer rank, rank 1 the victim
        argv |= {f"rank{r}": ["batchd", "rank", "--config", "job.toml", "--rank", str(r)] for r in (0, 1)}
        where = ["--base-port", str(aport)]
    else:
        argv["node"] = ["batchd", "node", "--config", "job.toml", "--local-ranks", "2", "--node-rank", "0"]
        where = ["--node-agent", f"127.0.0.1:{aport}"]
    crash = ["--crash-at", f"0:{fault_after}:1"] if kind == "trainer" else []
    train = [
        "batchd", "torchrun", "--nproc-per-node", "2", "--max-restarts", "3", "--standalone", "-m",
        "batchd.train", *where, "--checkpoint", "ckpt", "--checkpoint-every",
        "5", "--ids-log", "ids-{rank}.jsonl", "--step-time", str(step_time), "--vocab-size", "512",
        "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--log-every", "0", *crash,
    ]  # fmt: skip
    return argv, train


def failure(kind: str, fault_after: int, step_time: float, work: Path) -> dict[str, Any]:
    from _procs import free_block, wait_until
    from _readme_job import end_job, job_env, surviving_steps

    from batchd.demo import demo_lengths

    samples = 400
    (work / "lengths.txt").write_text("\n".join(map(str, demo_lengths(samples, seed=3))) + "\n")
    cport, aport = free_block(1), free_block(2)
    (work / "job.toml").write_text(
        '[job]\nworld_size = 2\ntoken_budget = 1024\npolicy = "balanced"\nwindow = 32\ndepth = 4\n'
        '[data]\nlengths = "lengths.txt"\n'
        f'[coordinator]\nport = {cport}\nstate_dir = "state/coordinator"\n'
        f'[rank]\nbase_port = {aport}\nstate_dir = "state/ranks"\nclient_grace_s = 600.0\n'
    )
    marker = f"BATCHD_BENCH_RESTART={uuid.uuid4().hex}"
    env = job_env(tempfile.mkdtemp(prefix="bdb-", dir="/tmp"), marker)
    argv, train = _commands(kind, aport, fault_after, step_time)
    logs = {n: open(work / f"{n}.log", "a") for n in [*argv, "torchrun"]}

    def start(name: str, cmd: list[str]) -> subprocess.Popen:
        return subprocess.Popen(cmd, cwd=work, env=env, stdout=logs[name], stderr=subprocess.STDOUT)

    def steps() -> list[dict]:
        return [json.loads(ln) for f in work.glob("ids-*.jsonl") for ln in f.read_text().splitlines()]

    procs = {n: start(n, a) for n, a in argv.items()}
    group = start("torchrun", train)
    t_fault = None
    try:
        wait_until("steps", lambda: len({e["step"] for e in steps() if e["epoch"] == 0}) >= fault_after, 300)
        victim = {"node": "node", "coordinator": "coordinator", "rank": "rank1"}.get(kind)
        if victim is not None:
            procs[victim].send_signal(signal.SIGKILL)
            t_fault = time.time()
            procs[victim].wait(10)
            procs[victim] = start(victim, argv[victim])
        ok = group.wait(600) == 0
        for p in procs.values():
            ok = ok and p.wait(60) == 0
    finally:
        for p in [group, *procs.values()]:
            if p.poll() is None:
                p.kill()
        end_job(marker)
        for f in logs.values():
            f.close()
    every = steps()
    if kind == "trainer":  # the crash comes right after the dying trainer logged its step
        t_fault = max(e["t"] for e in every if e["restart"] == 0)
    assert t_fault is not None
    text = {n: (work / f"{n}.log").read_text() for n in logs}
    log_name, pattern = {
        "trainer": ("torchrun", r"^E(\d{4} [\d:.]+) .*failed \(exitcode: 1\)"),
        "node": ("coordinator", r"^([\d-]+ [\d:,]+) WARNING .*its stream broke"),
        "coordinator": ("node", r"^([\d-]+ [\d:,]+) WARNING .*coordinator at \S+ (is unreachable|broke)"),
        "rank": ("torchrun", r"^([\d-]+ [\d:,]+) INFO .*waiting for the rank service at .*rank 1"),
    }[kind]
    noticed = _stamp(text[log_name], pattern, torch_format=kind == "trainer")
    rank0 = sorted(json.loads(ln)["t"] for ln in (work / "ids-0.jsonl").read_text().splitlines())
    # the longest the trainers stood still after the fault: the widest gap between rank 0's steps, less a step
    pause = max((b - a for a, b in zip(rank0, rank0[1:], strict=False) if b > t_fault), default=0.0)
    seen: collections.Counter = collections.Counter()
    for rank in range(2):
        seen.update(i for e in surviving_steps(work, rank)[0] for i in e["ids"])
    return {
        "kind": kind,
        "ok": ok,
        "notice_s": None if noticed is None else max(noticed - t_fault, 0.0),
        "pause_s": max(pause - step_time, 0.0),
        "lost": samples - len(seen),
        "duplicated": sum(c - 1 for c in seen.values()),
    }


def _stamp(log: str, pattern: str, torch_format: bool = False) -> float | None:
    """The wall-clock time of the first log line matching `pattern` (batchd's "%Y-%m-%d %H:%M:%S,ms" or
    torch's "MMDD HH:MM:SS.us" of this year)."""
    m = re.search(pattern, log, re.M)
    if m is None:
        return None
    if torch_format:
        year = dt.datetime.now().year
        when = dt.datetime.strptime(f"{year}{m.group(1)}", "%Y%m%d %H:%M:%S.%f")
    else:
        when = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
    return when.timestamp()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--intervals", default="10,50", help="checkpoint intervals (steps), a comma list")
    ap.add_argument("--fault-after", type=int, default=12, help="steps of epoch 0 before the fault")
    ap.add_argument("--step-time", type=float, default=1.0, help="seconds per trainer step")
    add_common_args(ap)
    args = ap.parse_args(argv)
    intervals = [int(x) for x in args.intervals.split(",")]
    lengths = [int(x) for x in (DEFAULT_WORKLOADS / "odb-synthetic.txt").read_text().split()]
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="batchd-restart-") as tmp:
        for collate in ("padded", "packed"):
            for n in intervals:
                row = held(collate, n, lengths, Path(tmp) / f"held-{collate}-{n}")
                rows.append(row)
                print(json.dumps(row), flush=True)
        failures = []
        for kind in ("trainer", "node", "coordinator", "rank"):
            work = Path(tmp) / f"fail-{kind}"
            work.mkdir()
            failures.append(failure(kind, args.fault_after, args.step_time, work))
            print(json.dumps(failures[-1]), flush=True)
    data = {"held": rows, "failures": failures, "wall_s": time.perf_counter() - t0, "machine": machine()}
    config = {"intervals": intervals, "fault_after": args.fault_after, "step_time": args.step_time}
    config.update(budget=BUDGET, world_size=2, window=64, depth=8, workload="odb-synthetic")
    config["command"] = command_line(__file__, argv)
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0 if all(f["ok"] and f["lost"] == f["duplicated"] == 0 for f in failures) else 1


if __name__ == "__main__":
    sys.exit(main())
