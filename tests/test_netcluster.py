"""A cluster in a box: batchd across hosts with their own addresses, networks and names, and its faults.

Each host is a network namespace with its own address and host name (tests/_netcluster.py); the head
runs the coordinator (and, for the Ray job, the Ray head), every other host one `batchd node` agent with
2 ranks and its 2 gloo trainers (tests/_netjobs.py). Faults are cut at the router between the hosts, so
a host sees silence, not an error. The outcomes asserted here are the table of docs/deployment.md,
"Network faults":

- a link down for less than the lease (a trainer host, the coordinator's host), or two node agents
  partitioned from each other while both reach the coordinator: the job rides through, every id once;
- a trainer host's link down past the lease: the coordinator fails the job naming that host's agent,
  every party exits 1 naming it, and the host's late return is refused with the same message;
- (the Ray job) Ray across hosts: each agent's actors read the Parquet records on its own host, the
  balanced plan moves samples across hosts (`Fetch` over the network) and the two-phase steps exchange
  image embeddings across hosts; an agent SIGKILLed and started again resumes with new actors on its own
  node; every id once, equal steps, every party exits 0.

Skipped with the reason where namespaces cannot be made (not root). Every wait is a deadline on an
event; on failure the logs of every party are printed. The measured figures print with `-s`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from _netcluster import NetCluster
from _netjobs import PY, HostJob, JobPlan, until, write_lengths

pytestmark = pytest.mark.slow

SPEC = ["--token-budget", "256", "--window", "16", "--depth", "2", "--seed", "5"]
TINY = ["--vocab-size", "512", "--d-model", "32", "--n-layers", "1", "--n-heads", "2"]
EVERY_EXIT_S = 180.0  # a deadline on the job's end; it only bounds a failing run


@pytest.fixture
def net(tmp_path):
    why = NetCluster.unavailable()
    if why:
        pytest.skip(why)
    with NetCluster(["head", "host1", "host2"], tmp_path) as cluster:
        yield cluster


def _synthetic(net: NetCluster, tmp_path: Path, n: int, lease_s: float) -> HostJob:
    plan = JobPlan(
        spec=SPEC,
        lease_s=lease_s,
        lengths=str(write_lengths(tmp_path / "lengths.txt", n, hi=250)),
        trainer=[*TINY, "--step-time", "0.3", "--reconnect-timeout", "120", "--timeout", "300"],
    )
    return HostJob(net, tmp_path, plan)


def _steps_after(job: HostJob, steps: int, what: str) -> float:
    """Waits until every rank logged `steps` more steps; returns the seconds it took."""
    t, start = time.monotonic(), job.steps_done()
    until(what, lambda: job.steps_done() >= start + steps, 120, job.dead())
    return time.monotonic() - t


def test_link_faults_shorter_than_the_lease_ride_through(net, tmp_path):
    """Lease 12 s. A trainer host's link down 5 s, then the two trainer hosts partitioned from each other
    for 5 s (both reach the coordinator: cross-node `Fetch`es wait), then the coordinator's host cut off
    5 s: the job goes on after each, no restart, every id once, every party exits 0."""
    n = 360
    job = _synthetic(net, tmp_path, n, lease_s=12.0)
    faults = {
        "trainer host cut": (lambda: net.cut("host2"), lambda: net.heal("host2")),
        "agents partitioned": (lambda: net.partition("host1", "host2"), lambda: net.join("host1", "host2")),
        "coordinator host cut": (lambda: net.cut("head"), lambda: net.heal("head")),
    }
    figures = {}
    try:
        job.start_all()
        everyone = list(net.procs)
        _steps_after(job, 3, "the first steps")
        for name, (fault, heal) in faults.items():
            t = time.monotonic()
            fault()
            time.sleep(5.0)  # the outage itself, not a wait for an event
            heal()
            figures[name] = {
                "trains_again_after_heal_s": round(_steps_after(job, 2, f"steps after {name}"), 1)
            }
            figures[name]["fault_to_training_s"] = round(time.monotonic() - t, 1)
        codes = job.wait_exit(everyone, EVERY_EXIT_S)
        assert all(c == 0 for c in codes.values()), codes
        counts = job.check_every_id_once(n)
        stats = job.stats()
        remote = {r: s["fetched_remote"] for r, s in stats.items()}
        assert sum(remote.values()) > 0, remote  # the plan moved samples across hosts
        # the outages were real: the agents lost the coordinator during its host's cut
        for host in ("host1", "host2"):
            assert "the coordinator at 10.77.0.2:7000 is unreachable" in net.log(f"agent-{host}", 10**6), host
        print(f"ride-through figures: {json.dumps(figures)}; steps per rank {counts[0]}; fetched {remote}")
    except BaseException:
        print(net.all_logs())
        raise
    finally:
        job.close()


def test_a_host_cut_past_the_lease_fails_the_job_naming_it_and_its_return_is_refused(net, tmp_path):
    """Lease 8 s; host2's link down for 12 s. The coordinator fails the job naming host2's agent once it
    missed its lease; host1's agent and trainers exit 1 with that message; when host2 comes back (within
    its agent's patience of two leases) its agent is refused with the same message, and its trainers exit
    1 with it. Nothing hangs: every party has exited within a bound set by the lease."""
    job = _synthetic(net, tmp_path, 360, lease_s=8.0)
    try:
        job.start_all()
        everyone = list(net.procs)
        _steps_after(job, 3, "the first steps")
        cut = time.monotonic()
        net.cut("host2")
        exits: dict[str, float] = {}

        def record() -> bool:
            for name in everyone:
                if name not in exits and net.get(name).poll() is not None:
                    exits[name] = round(time.monotonic() - cut, 1)
            return len(exits) == len(everyone)

        until("host1's agent exits", lambda: record() or "agent-host1" in exits, 60)
        until("12 s of outage", lambda: record() or time.monotonic() - cut >= 12.0, 60)
        net.heal("host2")
        # patience (16 s) + the failed coordinator's stay + STUCK_EXIT_S (20 s) of a trainer blocked in gloo
        until("every party exits", record, 90)
        codes = {n: net.get(n).returncode for n in everyone}
        assert all(c == 1 for c in codes.values()), (codes, exits)
        named = re.compile(r"rank 2 \(node agent 'host2' at 10\.77\.2\.2:7100, ranks 2-3\) missed its lease")
        for name in everyone:
            assert named.search(net.log(name, 10**6)), f"{name} does not name host2's agent"
        failed_at = re.search(
            r"^(\S+ \S+) ERROR batchd.coordinator\[\d+\]: job failed", net.log("coordinator", 10**6), re.M
        )
        assert failed_at, net.log("coordinator")
        print(f"exits after the cut (s): {exits}")
    except BaseException:
        print(net.all_logs())
        raise
    finally:
        job.close()


def test_a_ray_job_across_hosts_with_images_two_phase_steps_and_an_agent_restart(net, tmp_path):
    """Ray across hosts (the head: Ray head, no CPUs, and the coordinator; each trainer host: a Ray worker
    node, its agent and trainers), a Parquet dataset with images read by each agent's actors on its own
    host's node, the stock tiny Qwen2-VL trained two-phase (its vision tower's embeddings exchanged across
    hosts by gloo), balanced plans moving samples across hosts (`Fetch` over the network). host2's agent
    is SIGKILLed mid-epoch and started again with the same command: its trainers reconnect, its new
    actors start on its node. Every id once, equal steps, every step two-phase, every party exits 0."""
    from batchd.preprocess import make_demo_dataset

    n = 64
    subprocess.run(
        [str(Path(PY).parent / "batchd"), "tiny-vlm", str(tmp_path / "vlm")], check=True, capture_output=True
    )
    data = make_demo_dataset(
        tmp_path / "data",
        num_samples=n,
        seed=7,
        image_fraction=0.5,
        bad_fraction=0.0,
        format="parquet",
        max_image_side=112,
    )
    plan = JobPlan(
        spec=["--token-budget", "768", "--phases", "2", "--window", "16", "--depth", "2", "--seed", "5"],
        lease_s=60.0,
        ray=True,
        dataset=str(data.path),
        processor=str(tmp_path / "vlm"),
        trainer=["--hf-model", str(tmp_path / "vlm"), "--step-time", "0.5", "--credits", "1",
                 "--reconnect-timeout", "180", "--timeout", "600"],
    )  # fmt: skip
    job = HostJob(net, tmp_path, plan)
    try:
        job.start_all()
        everyone = [name for name in net.procs if not name.startswith("ray-")]
        _steps_after(job, 2, "the first steps")
        victim = net.get("agent-host2")
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(30)
        killed_at = job.steps_done()
        job.start_agent(1, "agent-host2-restarted")
        last = [name for name in everyone if name != "agent-host2"] + ["agent-host2-restarted"]
        codes = job.wait_exit(last, 600)
        assert all(c == 0 for c in codes.values()), codes
        counts = job.check_every_id_once(n)
        assert counts[0] > killed_at + 2, (killed_at, counts)  # the restarted agent served steps
        summaries = [json.loads((tmp_path / f"summary-{r}.json").read_text()) for r in range(4)]
        assert all(s["exchange_steps"] == s["steps"] > 0 for s in summaries), summaries  # two-phase steps
        stats = job.stats()
        nodes = {r: s["actor_nodes"] for r, s in stats.items()}
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2], (
            nodes
        )  # own host's node
        assert all(s["ray_address"] == f"{job.head}:6379" for s in stats.values()), stats
        # every incarnation's driver attached to its own host's node (the killed one wrote no stats)
        for name, rank in (("agent-host1", 0), ("agent-host2", 2), ("agent-host2-restarted", 2)):
            joined = re.findall(
                r"rank (\d+): joined the Ray cluster at \S+ \(gcs \S+\) on node (\w+)", net.log(name, 10**6)
            )
            assert joined == [(str(rank), nodes[rank][0])], (name, joined, nodes)
        remote = {r: (s["fetched_remote"], s["fetched_remote_bytes"]) for r, s in stats.items()}
        assert sum(f for f, _ in remote.values()) > 0, remote  # the plan moved samples across hosts
        print(
            f"ray job: {counts[0]} steps per rank, killed at {killed_at}; fetched (samples, bytes) {remote}"
        )
    except BaseException:
        print(net.all_logs())
        raise
    finally:
        job.close()


def test_the_developer_script_runs_the_job_across_hosts(tmp_path):
    """`sudo deploy/smoke/cluster.sh --keep DIR` (docs/deployment.md#network-faults) as written: a synthetic
    balanced job over two trainer hosts; it exits 0, every id once, and leaves none of its namespaces."""
    why = NetCluster.unavailable()
    if why:
        pytest.skip(why)
    script = Path(__file__).resolve().parents[1] / "deploy" / "smoke" / "cluster.sh"
    proc = subprocess.Popen(
        [str(script), "--keep", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHON": PY},
    )
    out, err = proc.communicate(timeout=600)  # a backstop: every party has its own liveness limits
    assert proc.returncode == 0, out[-3000:] + err[-6000:]
    assert re.search(r"every id once; steps per rank \{0: (\d+), 1: \1, 2: \1, 3: \1\}", out), out
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"bdc{proc.pid}-" not in listed, listed  # the script execs python: its namespaces carry this pid


def test_the_ray_heads_host_lost_ends_the_job_naming_it(net, tmp_path):
    """The head (the Ray head and the coordinator, as in deploy/ray) is lost mid-job: every process on it
    SIGKILLed. Each agent finds its Ray's GCS gone (`SharedRay.watch`) or the coordinator unreachable and
    fails the job naming it; its trainers exit 1 with that line; every batchd party has exited 1 within
    two leases and the trainers' grace, without a traceback; the Ray worker nodes stop by themselves once
    Ray's `gcs_rpc_server_reconnect_timeout_s` (here 15 s, Ray's default 60 s) has passed."""
    from batchd.preprocess import demo_tokenizer, make_demo_dataset

    n = 160
    data = make_demo_dataset(
        tmp_path / "data", num_samples=n, seed=7, image_fraction=0.0, bad_fraction=0.0, format="parquet"
    )
    tok = str(demo_tokenizer(tmp_path / "tok.json"))
    plan = JobPlan(
        spec=SPEC,
        lease_s=8.0,
        ray=True,
        dataset=str(data.path),
        tokenizer=tok,
        trainer=["--tokenizer", tok, *TINY[2:], "--step-time", "0.3", "--timeout", "300"],
        ray_env={"RAY_gcs_rpc_server_reconnect_timeout_s": "15"},
    )
    job = HostJob(net, tmp_path, plan)
    try:
        job.start_all()
        _steps_after(job, 3, "the first steps")
        lost = time.monotonic()
        net.kill_host("head")
        batchd = [
            name for name, (host, _) in net.procs.items() if host != "head" and not name.startswith("ray-")
        ]
        exits: dict[str, float] = {}

        def record() -> bool:
            for name, (host, p) in net.procs.items():
                if host != "head" and name not in exits and p.poll() is not None:
                    exits[name] = round(time.monotonic() - lost, 1)
            return all(name in exits for name in batchd)

        until("every batchd party exits", record, 2 * plan.lease_s + 40)
        assert all(net.get(name).returncode == 1 for name in batchd), {
            n: net.get(n).returncode for n in batchd
        }
        for name in batchd:
            log = net.log(name, 10**6)
            assert "Traceback" not in log, f"{name}:\n{log[-3000:]}"
            assert re.search(
                r"(its Ray at 10\.77\.0\.2:6379 went away|coordinator at 10\.77\.0\.2:7000 unreachable)", log
            ), name
        until("the Ray worker nodes stop", lambda: record() and len(exits) == len(net.procs) - 2, 90)
        print(f"exits after the head was lost (s): {exits}")
    except BaseException:
        print(net.all_logs())
        raise
    finally:
        job.close()
