"""batchd jobs across the hosts of a `NetCluster` (tests/_netcluster.py): parties, waits and checks.

A job: the head host runs `batchd coordinator` (and, with Ray, the Ray head: no CPUs, so no actor lands
there); every other host runs one `batchd node` agent with `LOCAL` ranks (node rank g for host g+1) and
its `LOCAL` gloo trainers (`python -m batchd.train --node-agent <its host>:AGENT_PORT`, torchrun's
variables set by hand, `MASTER_ADDR` = the first host, where global rank 0 hosts the store,
`GLOO_SOCKET_IFNAME=eth0`). With Ray each host also runs a Ray worker node (`ray start --address
<head>:6379 --node-ip-address <its address>`), and its agent's actors read the Parquet dataset on it.
Every party binds and advertises its own host's address; ports are fixed, as each host has its own.

Every wait is a deadline on an event (a file, a log line, an exit); on failure the test prints
`net.all_logs()`.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from _netcluster import NetCluster

PY = sys.executable
RAY = str(Path(PY).parent / "ray")
COORD_PORT, AGENT_PORT, MASTER_PORT, RAY_PORT = 7000, 7100, 29500, 6379
LOCAL = 2  # ranks per host
RAY_START_TRIES = 3  # `HostJob.start_ray`


@dataclass
class JobPlan:
    """What a job runs: `hosts` trainer hosts of LOCAL ranks, the job spec flags, the data and models."""

    hosts: int = 2
    spec: list[str] = field(default_factory=list)
    lease_s: float = 8.0
    ray: bool = False  # Parquet records read by Ray actors on each host (else --lengths)
    dataset: str = ""  # with ray: the Parquet file
    processor: str = ""  # with ray: the pipeline's processor (a tiny-vlm dir), else the demo tokenizer
    tokenizer: str = ""
    lengths: str = ""  # without ray: the lengths file
    trainer: list[str] = field(default_factory=list)  # extra batchd.train flags (model, step time)
    agent: list[str] = field(default_factory=list)  # extra batchd node flags
    coordinator: list[str] = field(default_factory=list)
    ray_env: dict[str, str] = field(default_factory=dict)  # extra environment of every Ray node and agent

    @property
    def world(self) -> int:
        return self.hosts * LOCAL

    def host_names(self) -> list[str]:
        return ["head", *(f"host{g + 1}" for g in range(self.hosts))]


def until(
    what: str, cond: Callable[[], object], timeout: float, dead: Callable[[], str | None] = lambda: None
):
    """Waits until `cond()` is true; raises after `timeout` s, or at once when `dead()` names a party."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        gone = dead()
        if gone:
            raise RuntimeError(f"{gone} while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g}s")
        time.sleep(0.1)


class HostJob:
    """The parties of one job on `net`; `work` holds its files."""

    def __init__(self, net: NetCluster, work: Path, plan: JobPlan) -> None:
        self.net, self.work, self.plan = net, work, plan
        self.ray_tmp: dict[str, str] = {}
        self.t0 = time.monotonic()
        self.env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS"):
            os.environ.pop(var, None)

    # -- names ------------------------------------------------------------------------------------------
    def host(self, g: int) -> str:
        """The host of node rank g."""
        return f"host{g + 1}"

    @property
    def head(self) -> str:
        return self.net.addr("head")

    def agent_addr(self, g: int) -> str:
        return f"{self.net.addr(self.host(g))}:{AGENT_PORT}"

    # -- parties ----------------------------------------------------------------------------------------
    def _ray_env(self, host: str) -> dict[str, str]:
        """A host's Ray environment: its own temp dir (Ray's sockets live there: short, one per host) and
        token auth on, which `ray start --head` turns on by itself (Ray >= 2.5x) and every node and
        driver joining it by address must turn on too; the token is ~/.ray/auth_token, which these hosts
        share (real hosts need a copy of the head's: docs/deployment.md)."""
        if host not in self.ray_tmp:
            self.ray_tmp[host] = tempfile.mkdtemp(prefix=f"bdr{host[-1]}-", dir="/tmp")
        tmp = self.ray_tmp[host]
        return {**self.env, "RAY_TMPDIR": tmp, "TMPDIR": tmp, "RAY_AUTH_MODE": "token", **self.plan.ray_env}

    def start_ray(self) -> None:
        """The Ray head on the head host, then a worker node on each trainer host, one after another
        (foreground: --block); returns once each said it started (a node joins a head that is up; an
        agent needs its node).

        `ray start` gives its raylet a fixed 30 s to register with the GCS (ray/_private/node.py,
        `raylet_start_wait_time_s`, not configurable), which a 2-core machine running the test suite
        beside other work can miss; a node whose start timed out so is started again (its host's
        processes killed first: only Ray runs there yet), up to RAY_START_TRIES times."""
        head = self.head
        argv = [RAY, "start", "--head", "--block", f"--node-ip-address={head}", f"--port={RAY_PORT}",
                "--num-cpus=0", "--include-dashboard=false", "--disable-usage-stats"]  # fmt: skip
        self._start_ray_node("head", argv)
        for g in range(self.plan.hosts):
            host = self.host(g)
            ip = self.net.addr(host)
            argv = [RAY, "start", "--block", f"--address={head}:{RAY_PORT}", f"--node-ip-address={ip}",
                    "--num-cpus=2", "--disable-usage-stats"]  # fmt: skip
            self._start_ray_node(host, argv)

    def _start_ray_node(self, host: str, argv: list[str]) -> None:
        for attempt in range(RAY_START_TRIES):
            name = f"ray-{host}" if attempt == 0 else f"ray-{host}-try{attempt + 1}"
            self.net.start(host, name, argv, self._ray_env(host))
            try:
                until(
                    f"{name} to start",
                    lambda n=name: "Ray runtime started" in self.net.log(n, 10**6),
                    180,
                    self.dead([name]),
                )
                return
            except RuntimeError:
                if "The current node timed out during startup" not in self.net.log(name, 10**6):
                    raise
                print(
                    f"{name}: Ray's 30 s raylet registration window missed; starting the node again",
                    flush=True,
                )
                self.net.kill_host(host)
                self.net.procs.pop(name)[1].wait(30)  # its log stays; it is no party of the job
        raise RuntimeError(f"the Ray node of {host} did not start in {RAY_START_TRIES} tries")

    def start_coordinator(self, name: str = "coordinator", extra: list[str] | None = None):
        argv = [
            PY, "-m", "batchd", "coordinator", "--world-size", str(self.plan.world), *self.plan.spec,
            "--host", self.head, "--port", str(COORD_PORT), "--lease", str(self.plan.lease_s),
            "--state-dir", str(self.work / "coord-state"), *self.plan.coordinator, *(extra or []),
        ]  # fmt: skip
        return self.net.start("head", name, argv, self.env)

    def agent_argv(self, g: int) -> list[str]:
        p, host = self.plan, self.host(g)
        argv = [
            PY, "-m", "batchd", "node", "--world-size", str(p.world), *p.spec,
            "--coordinator", f"{self.head}:{COORD_PORT}", "--host", self.net.addr(host),
            "--advertise", self.net.addr(host),
            "--port", str(AGENT_PORT), "--local-ranks", str(LOCAL), "--node-rank", str(g),
            "--state-dir", str(self.work / f"state-{host}"),
            "--stats-file", str(self.work / "stats-{rank}.json"),
        ]  # fmt: skip
        if p.ray:
            argv += ["--dataset", p.dataset, "--num-actors", "1", "--ray-address", f"{self.head}:{RAY_PORT}"]
            argv += ["--processor", p.processor] if p.processor else ["--tokenizer", p.tokenizer]
        else:
            argv += ["--lengths", p.lengths]
        return argv + p.agent

    def start_agent(self, g: int, name: str | None = None):
        host = self.host(g)
        env = self._ray_env(host) if self.plan.ray else self.env
        env = {**env, "BATCHD_RAY_NODE_IP": self.net.addr(host)}
        return self.net.start(host, name or f"agent-{host}", self.agent_argv(g), env)

    def start_trainers(self, g: int, suffix: str = "") -> None:
        p, host = self.plan, self.host(g)
        for local in range(LOCAL):
            r = g * LOCAL + local
            env = {
                **self.env,
                "RANK": str(r),
                "WORLD_SIZE": str(p.world),
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(LOCAL),
                "GROUP_RANK": str(g),
                "MASTER_ADDR": self.net.addr(self.host(0)),
                "MASTER_PORT": str(MASTER_PORT),
                "GLOO_SOCKET_IFNAME": "eth0",
            }
            argv = [
                PY, "-m", "batchd.train", "--node-agent", self.agent_addr(g), "--backend", "gloo",
                "--log-every", "0", "--ids-log", str(self.work / "ids-{rank}.jsonl"),
                "--summary", str(self.work / "summary-{rank}.json"), *p.trainer,
            ]  # fmt: skip
            self.net.start(host, f"trainer-{r}{suffix}", argv, env)

    def start_all(self) -> None:
        if self.plan.ray:
            self.start_ray()
        self.start_coordinator()
        for g in range(self.plan.hosts):
            self.start_agent(g)
            self.start_trainers(g)

    # -- what the job did ----------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def dead(self, names: list[str] | None = None) -> Callable[[], str | None]:
        """A `dead()` for `until`: names the first of `names` (default: all) that exited non-zero."""

        def check() -> str | None:
            for name, (_, p) in self.net.procs.items():
                if (names is None or name in names) and p.poll() not in (None, 0):
                    return f"{name} exited with status {p.returncode}"
            return None

        return check

    def ids_logs(self) -> dict[int, list[dict]]:
        out = {}
        for r in range(self.plan.world):
            f = self.work / f"ids-{r}.jsonl"
            lines = f.read_text().splitlines() if f.exists() else []
            out[r] = [json.loads(ln) for ln in lines if ln.endswith("}")]
        return out

    def steps_done(self) -> int:
        """Distinct steps every rank has logged."""
        return min(len({(e["epoch"], e["step"]) for e in es}) for es in self.ids_logs().values())

    def wait_exit(self, names: list[str], timeout: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        for n in names:
            p = self.net.get(n)
            try:
                p.wait(max(deadline - time.monotonic(), 1))
            except Exception:
                raise TimeoutError(f"{n} still running after {timeout:g}s") from None
        return {n: self.net.get(n).returncode for n in names}

    def check_every_id_once(self, num_samples: int) -> dict[int, int]:
        """Every rank ran the same contiguous steps (a step logged twice, by a restarted trainer, held the
        same ids), and every id of the dataset was trained exactly once; returns steps per rank."""
        steps: dict[int, dict[tuple[int, int], list[int]]] = {}
        for r, entries in self.ids_logs().items():
            seen = steps.setdefault(r, {})
            for e in entries:
                key = (e["epoch"], e["step"])
                assert seen.get(key, e["ids"]) == e["ids"], f"rank {r} step {key} replayed differently"
                seen[key] = e["ids"]
        counts = {r: len(s) for r, s in steps.items()}
        assert len(set(counts.values())) == 1, counts
        ids = collections.Counter(i for s in steps.values() for batch in s.values() for i in batch)
        assert sorted(ids) == list(range(num_samples)) and set(ids.values()) == {1}, {
            "missing": sorted(set(range(num_samples)) - set(ids)),
            "twice": sorted(i for i, c in ids.items() if c > 1),
        }
        return counts

    def stats(self) -> dict[int, dict]:
        return {r: json.loads((self.work / f"stats-{r}.json").read_text()) for r in range(self.plan.world)}

    def close(self) -> None:
        import shutil

        for d in self.ray_tmp.values():
            shutil.rmtree(d, ignore_errors=True)


def write_lengths(path: Path, n: int, seed: int = 3, lo: int = 16, hi: int = 400) -> Path:
    """n synthetic realized lengths (heavy-ish tail), one per line."""
    import random

    rng = random.Random(seed)
    path.write_text("\n".join(str(min(hi, lo + int(rng.paretovariate(1.6) * 20))) for _ in range(n)) + "\n")
    return path


def run_cli_job(keep: str | None) -> int:
    """`tests/_netcluster.py job`: a synthetic balanced job over 2 hosts, printed as it goes."""
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="bdnet-"))
    work.mkdir(parents=True, exist_ok=True)
    n = 120
    plan = JobPlan(
        spec=["--token-budget", "512", "--window", "16", "--depth", "2", "--seed", "5"],
        lengths=str(write_lengths(work / "lengths.txt", n)),
        trainer=["--vocab-size", "512", "--d-model", "32", "--n-layers", "1", "--n-heads", "2"],
    )
    with NetCluster(plan.host_names(), work) as net:
        job = HostJob(net, work, plan)
        try:
            job.start_all()
            everyone = list(net.procs)
            codes = job.wait_exit(everyone, 300)
            print(f"exit codes: {codes}")
            counts = job.check_every_id_once(n)
            print(f"every id once; steps per rank {counts}; {job.elapsed():.1f}s; logs in {work}/logs")
            return 0 if all(c == 0 for c in codes.values()) else 1
        except BaseException:
            print(net.all_logs(), file=sys.stderr)
            raise
        finally:
            job.close()
