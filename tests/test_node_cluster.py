"""Node agents on a real multi-node Ray cluster, end to end, on this one machine.

A `ray.cluster_utils.Cluster` (tests/_ray_cluster_host.py: a CPU-less head and two worker nodes on their
own loopback IPs, 127.0.0.2 and 127.0.0.3), a `batchd coordinator`, two `batchd node` agents (2 local
ranks each, world size 4), each joined to the cluster with `--ray-address` and attached to its own worker
node ($BATCHD_RAY_NODE_IP, service/preprocess/_ray.py), each reading its ranks' views of a small demo
dataset (Parquet, with images) with `--dataset`, and 4 gloo DDP trainers (`python -m batchd.train
--node-agent`, torchrun's environment variables set by hand), 2 per agent, with `--ids-log`.

Policy `local`: a rank trains only samples of its own view, so no plan moves a sample anywhere and
`fetched_remote` (and `fetched_local`) stay 0 on every rank; the agents write them, and the Ray node
of each of their actors, to their `--stats-file` as they exit.

The job runs with a step time of its trainers (`--step-time`) so that it is still mid-epoch when agent 1
is SIGKILLed (once every rank has logged a few steps) and restarted with the same command (same port,
same `--state-dir`): its trainers reconnect (BatchClient's reconnect window), its Ray actors died with
its driver and the new agent starts new ones, on its node again. Asserted: every party exits 0, every
rank ran the same contiguous steps, every id of the dataset was trained exactly once, each agent's
actors ran on its agent's node, `fetched_remote == 0` on every rank, and the kill fell mid-epoch.

One job covers both (one cluster start, the slow part on 2 cores). Every wait is a deadline on an
event (a file appearing, a log line count, an exit); on failure the logs of every party are printed.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _procs import descendants, still_alive

from batchd.launch import Processes, free_port, wait_port

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
PY = sys.executable
NUM_SAMPLES = 80  # about 10 steps per rank
WORLD, LOCAL = 4, 2
SPEC = [
    "--world-size",
    str(WORLD),
    "--token-budget",
    "512",
    "--policy",
    "local",
    "--window",
    "16",
    "--depth",
    "2",
    "--seed",
    "5",
    "--epochs",
    "1",
]
MODEL = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2"]
STEP_TIME = 0.3  # seconds per trainer step: the job is still running when the agent is killed
KILL_AT_STEP = 2  # SIGKILL agent 1 once every rank logged this many steps
CREDITS = 2  # batches a trainer's client may hold beyond the one it trains
JOB_S = 240.0  # deadline of each half of the job (start to the kill, restart to every exit); generous:
# the host may be shared, and a deadline only bounds a failing run


def _loopback_ips_or_skip() -> None:
    for ip in ("127.0.0.2", "127.0.0.3"):  # all of 127/8 is loopback on Linux, not on macOS
        with socket.socket() as probe:
            try:
                probe.bind((ip, 0))
            except OSError:
                pytest.skip(f"{ip} is not a local address here")


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def _until(what: str, cond, timeout: float, alive=None) -> None:
    """Waits until `cond()` holds; raises after `timeout` s, or at once when `alive()` says a party died."""
    deadline = time.monotonic() + timeout
    while not cond():
        if alive is not None:
            dead = alive()
            if dead:
                raise RuntimeError(f"{dead} exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g}s")
        time.sleep(0.1)


class NodeJob:
    """The cluster host, coordinator, agents and trainers of one job; `close()` ends them all."""

    def __init__(self, tmp_path: Path) -> None:
        self.work = tmp_path
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        self.short = tempfile.mkdtemp(prefix="bd-")  # Ray's socket paths live under RAY_TMPDIR: keep it short
        # a private Ray root and temp dir: no other process on the host finds this cluster or its locks
        self.env = {"RAY_TMPDIR": self.short, "TMPDIR": self.short, "PYTHONWARNINGS": "ignore"}
        self.procs = Processes(self.logs, self.env)
        self.cluster: subprocess.Popen | None = None
        self.cluster_tree: dict[int, str] = {}
        self.agent_argv: dict[int, list[str]] = {}
        self.agent_env: dict[int, dict[str, str]] = {}

    # parties
    def start_cluster(self) -> dict:
        info = self.work / "cluster.json"
        with open(self.logs / "cluster.log", "w") as log:
            self.cluster = subprocess.Popen(
                [PY, str(HERE / "_ray_cluster_host.py"), str(info)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        _until(
            "the Ray cluster",
            info.exists,
            120,
            lambda: "the cluster host" if self.cluster.poll() is not None else None,
        )
        self.cluster_tree = descendants(self.cluster.pid)  # raylets, GCS, workers: for the cleanup
        return json.loads(info.read_text())

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        self.procs.env = {**self.env, **(env or {})}
        return self.procs.start(name, argv)

    def start_agent(self, g: int, name: str) -> subprocess.Popen:
        return self.start(name, self.agent_argv[g], self.agent_env[g])

    def alive_check(self, names: list[str]):
        def dead() -> str | None:
            for n, p in self.procs.procs:
                if n in names and p.poll() is not None and p.returncode != 0:
                    return f"{n} (status {p.returncode})"
            return None

        return dead

    def all_logs(self) -> str:
        names = ["cluster", *(n for n, _ in self.procs.procs)]
        return "\n".join(f"===== {n} =====\n{_tail(self.logs / f'{n}.log')}" for n in names)

    def close(self) -> None:
        try:
            self.procs.stop()
            for _, p in self.procs.procs:  # each party leads its own session: take its whole group
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
        finally:
            if self.cluster is not None:
                self.cluster_tree.update(descendants(self.cluster.pid))
                try:
                    self.cluster.stdin.close()  # EOF: the host shuts the cluster down
                    self.cluster.wait(30)
                except (OSError, subprocess.TimeoutExpired):
                    pass
                for pid in [
                    *(int(s.split(":")[0]) for s in still_alive(self.cluster_tree)),
                    self.cluster.pid,
                ]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                try:
                    os.killpg(self.cluster.pid, signal.SIGKILL)
                except OSError:
                    pass
                self.cluster.wait()
            shutil.rmtree(self.short, ignore_errors=True)


def _ids_logs(work: Path) -> dict[int, list[dict]]:
    out = {}
    for r in range(WORLD):
        f = work / f"ids-{r}.jsonl"
        lines = f.read_text().splitlines() if f.exists() else []
        out[r] = [json.loads(ln) for ln in lines if ln.endswith("}")]  # a kill leaves whole lines only
    return out


def _progress(work: Path) -> int:
    """Distinct steps every rank has logged."""
    return min(len({(e["epoch"], e["step"]) for e in entries}) for entries in _ids_logs(work).values())


def test_node_agents_on_a_multi_node_ray_cluster_survive_an_agent_kill(tmp_path):
    _loopback_ips_or_skip()
    from batchd.service.preprocess import demo_tokenizer, make_demo_dataset

    t0 = time.monotonic()
    data = make_demo_dataset(
        tmp_path / "data",
        num_samples=NUM_SAMPLES,
        seed=7,
        image_fraction=0.3,
        bad_fraction=0.0,
        format="parquet",
        max_image_side=64,
    )
    tok = str(demo_tokenizer(tmp_path / "tokenizer.json"))
    job = NodeJob(tmp_path)
    timings: dict[str, float] = {}
    try:
        job.start(
            "coordinator",
            [
                PY,
                "-m",
                "batchd",
                "coordinator",
                *SPEC,
                "--port",
                "0",
                "--port-file",
                str(tmp_path / "coord.port"),
                "--lease",
                "180",
            ],
        )
        cluster = job.start_cluster()  # the coordinator starts meanwhile
        nodes, ips = cluster["nodes"], cluster["ips"]
        assert len(set(nodes.values())) == 3, nodes
        timings["cluster_s"] = time.monotonic() - t0
        cport = wait_port(tmp_path / "coord.port", job.procs.get("coordinator"), "coordinator", 60)

        node_of = {0: "node_a", 1: "node_b"}
        ports = {g: free_port() for g in node_of}
        for g, node in node_of.items():
            job.agent_argv[g] = [
                PY,
                "-m",
                "batchd",
                "node",
                *SPEC,
                "--coordinator",
                f"127.0.0.1:{cport}",
                "--local-ranks",
                str(LOCAL),
                "--node-rank",
                str(g),
                "--name",
                f"agent-{g}",
                "--dataset",
                str(data.path),
                "--tokenizer",
                tok,
                "--num-actors",
                "1",
                "--ray-address",
                cluster["address"],
                "--state-dir",
                str(tmp_path / f"state-{g}"),
                "--stats-file",
                str(tmp_path / "stats-{rank}.json"),
                "--port",
                str(ports[g]),
                "--port-file",
                str(tmp_path / f"agent-{g}.port"),
            ]
            job.agent_env[g] = {"BATCHD_RAY_NODE_IP": ips[node]}  # its driver attaches to its node
            job.start_agent(g, f"agent-{g}")

        master = free_port()
        for r in range(WORLD):
            g, local = divmod(r, LOCAL)
            torchrun = {
                "RANK": str(r),
                "WORLD_SIZE": str(WORLD),
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(LOCAL),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master),
            }
            job.start(
                f"trainer-{r}",
                [
                    PY,
                    "-m",
                    "batchd.train",
                    "--node-agent",
                    f"127.0.0.1:{ports[g]}",
                    "--backend",
                    "gloo",
                    "--tokenizer",
                    tok,
                    *MODEL,
                    "--step-time",
                    str(STEP_TIME),
                    "--credits",
                    str(CREDITS),
                    "--reconnect-timeout",
                    "180",
                    "--timeout",
                    "300",
                    "--log-every",
                    "0",
                    "--ids-log",
                    str(tmp_path / "ids-{rank}.jsonl"),
                    "--summary",
                    str(tmp_path / "summary-{rank}.json"),
                ],
                torchrun,
            )
        everyone = [n for n, _ in job.procs.procs]

        # agent 1 is SIGKILLed mid-epoch, once every rank has trained a few steps, and restarted
        _until(
            f"{KILL_AT_STEP} steps on every rank",
            lambda: _progress(tmp_path) >= KILL_AT_STEP,
            JOB_S,
            job.alive_check(everyone),
        )
        timings["first_steps_s"] = time.monotonic() - t0
        victim = job.procs.get("agent-1")
        assert victim.poll() is None, "agent 1 exited before the kill: the job ended too early"
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(30)
        steps_at_kill = {r: len(e) for r, e in _ids_logs(tmp_path).items()}
        (tmp_path / "agent-1.port").unlink()
        job.start_agent(1, "agent-1-restarted")
        wait_port(tmp_path / "agent-1.port", job.procs.get("agent-1-restarted"), "restarted agent 1", 120)
        timings["restarted_s"] = time.monotonic() - t0

        # the job completes: every party of the last incarnation exits, with status 0
        last = [n for n in everyone if n != "agent-1"] + ["agent-1-restarted"]
        deadline = time.monotonic() + JOB_S
        for n in last:
            try:
                job.procs.get(n).wait(max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{n} still running {JOB_S:g}s after the restart") from None
        timings["done_s"] = time.monotonic() - t0
        codes = {n: job.procs.get(n).returncode for n in last}
        assert all(c == 0 for c in codes.values()), codes

        # equal steps, every id exactly once
        summaries = {r: json.loads((tmp_path / f"summary-{r}.json").read_text()) for r in range(WORLD)}
        steps: dict[int, dict[int, list[int]]] = {}
        for r, entries in _ids_logs(tmp_path).items():
            for e in entries:
                assert e["epoch"] == 0, e
                seen = steps.setdefault(r, {})
                assert seen.get(e["step"], e["ids"]) == e["ids"], (
                    f"rank {r} step {e['step']} replayed differently"
                )
                seen[e["step"]] = e["ids"]
        counts = {r: len(s) for r, s in steps.items()}
        assert len(set(counts.values())) == 1 and all(
            sorted(steps[r]) == list(range(counts[r])) for r in steps
        ), counts
        assert {s["steps"] for s in summaries.values()} == {counts[0]}, summaries
        # killed mid-epoch: every rank trained batches that only the restarted agent can have made (the
        # killed one had made at most the steps logged, the one in hand and CREDITS more)
        assert all(counts[r] > steps_at_kill[r] + 1 + CREDITS for r in counts), (steps_at_kill, counts)
        ids = collections.Counter(i for s in steps.values() for batch in s.values() for i in batch)
        assert sorted(ids) == list(range(NUM_SAMPLES)) and set(ids.values()) == {1}, {
            "missing": sorted(set(range(NUM_SAMPLES)) - set(ids)),
            "twice": [i for i, c in ids.items() if c > 1],
        }

        # each agent's actors ran on its node; nothing crossed the network
        for r in range(WORLD):
            stats = json.loads((tmp_path / f"stats-{r}.json").read_text())
            want = nodes[node_of[r // LOCAL]]
            assert stats["node_id"] == want and stats["actor_nodes"] == [want], (r, stats, nodes)
            assert stats["fetched_remote"] == 0 and stats["fetched_local"] == 0, (r, stats)
            assert stats["ray_address"] == cluster["address"] or stats["ray_address"].endswith(
                cluster["address"].rpartition(":")[2]
            ), (stats["ray_address"], cluster["address"])
        # every incarnation's driver attached to its node (the killed one wrote no stats: its log says)
        for name, g in (("agent-0", 0), ("agent-1", 1), ("agent-1-restarted", 1)):
            joined = re.findall(
                r"rank (\d+): joined the Ray cluster at \S+ \(gcs \S+\) on node (\w+)",
                _tail(job.logs / f"{name}.log", 10**6),
            )
            assert joined == [(str(g * LOCAL), nodes[node_of[g]])], (
                name,
                joined,
                nodes,
            )  # its first rank joins
        print(f"timings: {timings}, steps per rank {counts[0]}, killed at {steps_at_kill}")
    except BaseException:
        print(job.all_logs())
        raise
    finally:
        job.close()
