"""The network-fault scenarios of a cluster in a box, shared by tests/test_netcluster.py (which asserts
their outcomes) and benchmarks/cluster.py (which records their figures).

Each scenario runs one job on a `NetCluster` of a head and two trainer hosts (tests/_netjobs.py) and
returns what happened as plain data: exit codes and times (seconds after the fault), steps, and the
lines each party ended with. A failing scenario prints every party's log before it raises.
"""

from __future__ import annotations

import collections
import datetime
import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _netcluster import NetCluster
from _netjobs import AGENT_PORT, COORD_PORT, PY, HostJob, JobPlan, until, write_lengths

SPEC = ["--token-budget", "256", "--window", "16", "--depth", "2", "--seed", "5"]
TINY = ["--vocab-size", "512", "--d-model", "32", "--n-layers", "1", "--n-heads", "2"]
EVERY_EXIT_S = 180.0  # a deadline on the job's end; it only bounds a failing run
OUTAGE_S = 5.0  # the short faults' length
LONG_CUT_S = 12.0  # past_the_lease: the cut, longer than its lease (8 s), shorter than two


def synthetic(net: NetCluster, work: Path, n: int, lease_s: float, spec: list[str] = SPEC) -> HostJob:
    plan = JobPlan(
        spec=spec,
        lease_s=lease_s,
        lengths=str(write_lengths(work / "lengths.txt", n, hi=250)),
        trainer=[*TINY, "--step-time", "0.3", "--reconnect-timeout", "120", "--timeout", "300"],
    )
    return HostJob(net, work, plan)


def steps_after(job: HostJob, steps: int, what: str) -> float:
    """Waits until every rank logged `steps` more steps; returns the seconds it took."""
    t, start = time.monotonic(), job.steps_done()
    until(what, lambda: job.steps_done() >= start + steps, 120, job.dead())
    return time.monotonic() - t


class _Exits:
    """Records when each party of `names` exits, in seconds after `t0`."""

    def __init__(self, net: NetCluster, names: list[str], t0: float) -> None:
        self.net, self.names, self.t0 = net, names, t0
        self.at: dict[str, float] = {}

    def poll(self) -> bool:
        for name in self.names:
            if name not in self.at and self.net.get(name).poll() is not None:
                self.at[name] = round(time.monotonic() - self.t0, 1)
        return len(self.at) == len(self.names)


def _guarded(net: NetCluster, job: HostJob, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return body()
    except BaseException:
        print(net.all_logs())
        raise
    finally:
        job.close()


def ride_through(net: NetCluster, work: Path) -> dict[str, Any]:
    """Lease 12 s: a trainer host's link down 5 s, then the two trainer hosts partitioned from each other
    5 s (both reach the coordinator), then the coordinator's host cut off 5 s, each after some steps.
    Returns per fault the seconds from the fault, and from its end, to every rank's next 2 steps; the
    exit codes, steps per rank (every id once checked), fetched counts, and which of the job's paths took a
    new connection during each fault."""
    n = 360
    job = synthetic(net, work, n, lease_s=12.0)
    faults = {
        "trainer host cut": (lambda: net.cut("host2"), lambda: net.heal("host2")),
        "agents partitioned": (lambda: net.partition("host1", "host2"), lambda: net.join("host1", "host2")),
        "coordinator host cut": (lambda: net.cut("head"), lambda: net.heal("head")),
    }
    # during each fault, which of the job's own connections a new TCP connect can open (the outage was
    # real): host1 to host2's agent, each trainer host to the coordinator
    paths = {"host1->agent-host2": ("host1", "host2", AGENT_PORT)}
    paths |= {f"{h}->coordinator": (h, "head", COORD_PORT) for h in ("host1", "host2")}

    def body() -> dict[str, Any]:
        job.start_all()
        everyone = list(net.procs)
        steps_after(job, 3, "the first steps")
        figures = {}
        for name, (fault, heal) in faults.items():
            t = time.monotonic()
            fault()
            open_paths = {p: _connects(net, *where) for p, where in paths.items()}
            time.sleep(max(OUTAGE_S - (time.monotonic() - t), 0.0))  # the outage, not a wait for an event
            heal()
            again = steps_after(job, 2, f"steps after {name}")
            figures[name] = {
                "after_heal_s": round(again, 1),
                "after_fault_s": round(time.monotonic() - t, 1),
                "open_paths": sorted(p for p, ok in open_paths.items() if ok),
            }
        codes = job.wait_exit(everyone, EVERY_EXIT_S)
        return {
            "lease_s": 12.0,
            "outage_s": OUTAGE_S,
            "faults": figures,
            "codes": codes,
            "steps": job.check_every_id_once(n),
            "fetched_remote": {r: s["fetched_remote"] for r, s in job.stats().items()},
        }

    return _guarded(net, job, body)


def _connects(net: NetCluster, src: str, dst: str, port: int) -> bool:
    """Whether a TCP connect from host `src` to `dst`:`port` opens within 1 s now."""
    probe = f"import socket; socket.create_connection(({net.addr(dst)!r}, {port}), timeout=1).close()"
    return net.exec(src, [PY, "-c", probe], timeout=30).returncode == 0


def past_the_lease(net: NetCluster, work: Path) -> dict[str, Any]:
    """Lease 8 s; host2's link down for LONG_CUT_S, then up (within its agent's two leases). Returns each
    party's exit code and time after the cut, when the coordinator failed the job, and every party's
    log."""
    job = synthetic(net, work, 360, lease_s=8.0)

    def body() -> dict[str, Any]:
        job.start_all()
        everyone = list(net.procs)
        steps_after(job, 3, "the first steps")
        cut = time.monotonic()
        wall_cut = time.time()
        net.cut("host2")
        exits = _Exits(net, everyone, cut)
        until("host1's agent exits", lambda: exits.poll() or "agent-host1" in exits.at, 60)
        until(f"{LONG_CUT_S:g} s of outage", lambda: exits.poll() or time.monotonic() - cut >= LONG_CUT_S, 60)
        net.heal("host2")
        # patience (16 s) + the failed coordinator's stay + STUCK_EXIT_S (20 s) of a trainer blocked in gloo
        until("every party exits", exits.poll, 90)
        failed = re.search(
            r"^(\S+ \S+) ERROR batchd.coordinator\[\d+\]: job failed", net.log("coordinator", 10**6), re.M
        )
        noticed = None
        if failed:  # the log's local time, as time.time() is
            stamp = datetime.datetime.strptime(failed.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            noticed = round(stamp - wall_cut, 1)
        return {
            "lease_s": 8.0,
            "cut_s": LONG_CUT_S,
            "codes": {name: net.get(name).returncode for name in everyone},
            "exits_s": exits.at,
            "noticed_s": noticed,
            "logs": {name: net.log(name, 10**6) for name in everyone},
        }

    return _guarded(net, job, body)


def head_lost(net: NetCluster, work: Path) -> dict[str, Any]:
    """A Ray job (text Parquet, tiny LM), lease 8 s; the head (Ray head and coordinator) loses every
    process mid-job. Returns the exit codes and times after the loss of every party on the trainer hosts
    (Ray worker nodes included: Ray's GCS reconnect timeout set to 15 s) and their logs."""
    from batchd.preprocess import demo_tokenizer, make_demo_dataset

    data = make_demo_dataset(
        work / "data", num_samples=160, seed=7, image_fraction=0.0, bad_fraction=0.0, format="parquet"
    )
    tok = str(demo_tokenizer(work / "tok.json"))
    plan = JobPlan(
        spec=SPEC,
        lease_s=8.0,
        ray=True,
        dataset=str(data.path),
        tokenizer=tok,
        trainer=["--tokenizer", tok, *TINY[2:], "--step-time", "0.3", "--timeout", "300"],
        ray_env={"RAY_gcs_rpc_server_reconnect_timeout_s": "15"},
    )
    job = HostJob(net, work, plan)

    def body() -> dict[str, Any]:
        job.start_all()
        steps_after(job, 3, "the first steps")
        lost = time.monotonic()
        net.kill_host("head")
        remaining = [name for name, (host, _) in net.procs.items() if host != "head"]
        batchd = [name for name in remaining if not name.startswith("ray-")]
        exits = _Exits(net, remaining, lost)
        until("every batchd party exits", lambda: exits.poll() or all(n in exits.at for n in batchd), 56)
        until("the Ray worker nodes stop", exits.poll, 90)
        return {
            "lease_s": 8.0,
            "batchd": batchd,
            "codes": {name: net.get(name).returncode for name in remaining},
            "exits_s": exits.at,
            "logs": {name: net.log(name, 10**6) for name in batchd},
        }

    return _guarded(net, job, body)


def traffic(net: NetCluster, work: Path, lengths: Path, spec: list[str]) -> dict[str, Any]:
    """The synthetic job over `lengths` with `spec` (balanced), 2 trainer hosts of 2 ranks: each rank's
    moved samples (in process / fetched over the network, and the fetched bytes on the wire) against
    `batchd simulate --local-ranks 2` of the same lengths and spec."""
    plan = JobPlan(spec=spec, lease_s=60.0, lengths=str(lengths), trainer=[*TINY, "--timeout", "600"])
    job = HostJob(net, work, plan)

    def body() -> dict[str, Any]:
        job.start_all()
        job.wait_exit(list(net.procs), 900)
        n = len(lengths.read_text().split())
        steps = job.check_every_id_once(n)
        stats = job.stats()
        sim = subprocess.run(
            [PY, "-m", "batchd", "simulate", "--lengths", str(lengths), "--world-size", str(plan.world),
             *spec, "--local-ranks", "2", "--json", "--quiet"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        predicted = json.loads(sim.stdout)
        return {
            "samples": n,
            "steps": steps[0],
            "wall_s": round(job.elapsed(), 1),
            "ranks": {r: {k: v for k, v in s.items() if k.startswith("fetched")} for r, s in stats.items()},
            "simulated": {k: predicted[k] for k in predicted if "node_moved" in k or "node_bytes" in k}
            | {"steps": predicted["steps"]},
        }

    return _guarded(net, job, body)


def traffic_two_phase(net: NetCluster, work: Path, workload: Path, spec: list[str]) -> dict[str, Any]:
    """The synthetic job over a multimodal `workload` CSV with `spec` and `--phases 2`, 2 trainer hosts of 2
    ranks, trainers on `TinyMLLM` (`--images`): per host, the samples and bytes its agent fetched from the
    other host (`Fetch`) and the image-embedding rows its trainers sent to the other host's ranks in the
    vision exchange, against `batchd simulate --workload ... --phases 2 --local-ranks 2` of the same data."""
    spec = [*spec, "--phases", "2"]
    plan = JobPlan(
        spec=spec, lease_s=60.0, lengths=str(workload), trainer=[*TINY, "--images", "--timeout", "600"]
    )
    job = HostJob(net, work, plan)

    def body() -> dict[str, Any]:
        job.start_all()
        parties = list(net.procs)
        until("the job's end", lambda: all(net.get(p).poll() is not None for p in parties), 900, job.dead())
        n = len(workload.read_text().splitlines()) - 1
        steps = job.check_every_id_once(n)
        stats = job.stats()
        summaries = {r: json.loads((work / f"summary-{r}.json").read_text()) for r in range(plan.world)}
        hosts: dict[int, dict[str, int]] = {}
        for r in range(plan.world):
            h = r // 2
            rows = summaries[r]["exchange_rows_to"]
            got = hosts.setdefault(h, {"fetched_remote": 0, "fetched_remote_bytes": 0, "exchanged_rows": 0})
            got["fetched_remote"] += stats[r]["fetched_remote"]
            got["fetched_remote_bytes"] += stats[r]["fetched_remote_bytes"]
            got["exchanged_rows"] += sum(v for d, v in enumerate(rows) if d // 2 != h)
        sim = subprocess.run(
            [PY, "-m", "batchd", "simulate", "--workload", str(workload), "--world-size", str(plan.world),
             *spec, "--local-ranks", "2", "--json", "--quiet"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        predicted = json.loads(sim.stdout)
        keys = ("cross_node_fetched", "cross_node_moved", "exchanged_cross_node_rows_per_step", "steps")
        return {
            "samples": n,
            "steps": steps[0],
            "exchange_steps": [summaries[r]["exchange_steps"] for r in range(plan.world)],
            "wall_s": round(job.elapsed(), 1),
            "d_model": int(TINY[TINY.index("--d-model") + 1]),
            "hosts": hosts,
            "simulated": {k: predicted[k] for k in keys},
        }

    return _guarded(net, job, body)


def elastic_host_lost(net: NetCluster, work: Path) -> dict[str, Any]:
    """The torchrun elastic recipe across hosts (docs/restarts-and-elastic.md): on host1 and host2,
    `torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d` (the rendezvous store on
    host1, each torchrun advertising its own address) running `python -m batchd.train --elastic`, whose
    workers start the coordinator (rank 0) and each host's agent, journals and checkpoints in the shared
    work dir, lease 5 s. Both torchruns start at once; the rendezvous waits 20 s (`last_call_timeout`)
    for the second host once the first joined, so a slow start of either still forms world size 4. host2
    is lost (every process SIGKILLed) mid-epoch; torchrun restarts host1's workers at world size 2, which
    resize the job and resume from the furthest checkpoint. Returns host1's torchrun exit code and time
    after the loss, every ids-log line, the (restart, world size) pairs seen, the step the resized job
    resumed at, and how often each id was trained in the surviving lineage (the steps of world size 4
    before the resume step, then every step of world size 2)."""
    from batchd.demo import demo_lengths

    samples = 1200
    (work / "lengths.txt").write_text("\n".join(map(str, demo_lengths(samples, seed=3, longest=512))) + "\n")
    (work / "job.toml").write_text(
        "[job]\nworld_size = 4\ntoken_budget = 1024\nseed = 3\n[job.policy]\nwindow = 32\ndepth = 4\n"
        '[data]\nlengths = "lengths.txt"\n'
        "[coordinator]\nport = 7000\nlease_s = 5.0\n[rank]\nbase_port = 7100\n"
    )
    for host in ("host1", "host2"):
        addr = net.addr(host)
        argv = [
            PY, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
            "--max-restarts", "3",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{net.addr('host1')}:29400", "--rdzv-id", "elastic",
            "--rdzv-conf", "last_call_timeout=20,join_timeout=120", "--local-addr", addr,
            "-m", "batchd.train", "--elastic", "state", "--config", "job.toml", "--checkpoint", "ckpt",
            "--checkpoint-every", "1", "--ids-log", "ids-{rank}.jsonl", "--step-time", "0.1", *TINY,
            "--log-every", "0", "--timeout", "60", "--reconnect-timeout", "5",
        ]  # fmt: skip
        env = {
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "BATCHD_ADVERTISE": addr,
            "GLOO_SOCKET_IFNAME": "eth0",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        net.start(host, f"torchrun-{host}", argv, env, cwd=work)

    def lines() -> list[dict]:
        return [
            json.loads(ln)
            for f in work.glob("ids-*.jsonl")
            for ln in f.read_text().splitlines()
            if ln.endswith("}")
        ]

    def body() -> dict[str, Any]:
        alive = lambda: "torchrun-host1 exited" if net.get("torchrun-host1").poll() is not None else None  # noqa: E731
        until("24 steps", lambda: len(lines()) >= 24, 240, alive)
        lost = time.monotonic()
        net.kill_host("host2")
        code = net.get("torchrun-host1").wait(300)
        logged = lines()
        resized = [ln["step"] for ln in logged if ln["world"] == 2]
        resume = min(resized) if resized else None
        kept = [ln for ln in logged if ln["world"] == 2 or (resume is not None and ln["step"] < resume)]
        return {
            "samples": samples,
            "code": code,
            "done_s": round(time.monotonic() - lost, 1),
            "lines": logged,
            "worlds": sorted({(ln["restart"], ln["world"]) for ln in logged}),
            "resume_step": resume,
            "trained": collections.Counter(i for ln in kept for i in ln["ids"]),  # the surviving lineage
            "log": net.log("torchrun-host1", 10**6),
        }

    try:
        return body()
    except BaseException:
        print(net.all_logs())
        raise
