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
from pathlib import Path

import pytest
from _netcluster import NetCluster
from _netfaults import elastic_host_lost, head_lost, past_the_lease, ride_through, steps_after
from _netjobs import PY, HostJob, JobPlan

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.fixture
def net(tmp_path):
    why = NetCluster.unavailable()
    if why:
        pytest.skip(why)
    with NetCluster(["head", "host1", "host2"], tmp_path) as cluster:
        yield cluster


def test_link_faults_shorter_than_the_lease_ride_through(net, tmp_path):
    """Lease 12 s. A trainer host's link down 5 s, then the two trainer hosts partitioned from each other
    for 5 s (both reach the coordinator: cross-node `Fetch`es wait), then the coordinator's host cut off
    5 s: the job goes on after each, no restart, every id once, every party exits 0."""
    got = ride_through(net, tmp_path)  # checks every id once and equal steps itself
    assert all(c == 0 for c in got["codes"].values()), got["codes"]
    assert set(got["faults"]) == {"trainer host cut", "agents partitioned", "coordinator host cut"}, got[
        "faults"
    ]
    assert sum(got["fetched_remote"].values()) > 0, got[
        "fetched_remote"
    ]  # the plan moved samples across hosts
    # the outages were real: during each, exactly the paths it leaves open took a new connection. (Whether
    # an agent logs the coordinator's absence depends on where its heartbeats fell: one sent late in a
    # 5 s cut is carried by TCP's retransmission within its deadline, unnoticed.)
    open_paths = {name: f["open_paths"] for name, f in got["faults"].items()}
    assert open_paths == {
        "trainer host cut": ["host1->coordinator"],
        "agents partitioned": ["host1->coordinator", "host2->coordinator"],
        "coordinator host cut": ["host1->agent-host2"],
    }, open_paths
    print(f"ride-through: {json.dumps(got['faults'])}; steps per rank {got['steps'][0]}")


def test_a_host_cut_past_the_lease_fails_the_job_naming_it_and_its_return_is_refused(net, tmp_path):
    """Lease 8 s; host2's link down for 12 s. The coordinator fails the job naming host2's agent once it
    missed its lease; host1's agent and trainers exit 1 with that message; when host2 comes back (within
    its agent's patience of two leases) its agent is refused with the same message, and its trainers exit
    1 with it. Nothing hangs: every party has exited within a bound set by the lease."""
    got = past_the_lease(net, tmp_path)
    assert all(c == 1 for c in got["codes"].values()), (got["codes"], got["exits_s"])
    named = re.compile(r"rank 2 \(node agent 'host2' at 10\.77\.2\.2:7100, ranks 2-3\) missed its lease")
    for name, log in got["logs"].items():
        assert named.search(log), f"{name} does not name host2's agent:\n{log[-2000:]}"
        assert "Traceback" not in log, f"{name}:\n{log[-3000:]}"
    # silent for a lease since its last heartbeat, which came at most min(lease/3, 2 s) before the cut
    assert got["noticed_s"] is not None and got["lease_s"] - 2.0 <= got["noticed_s"], got["noticed_s"]
    print(
        f"exits after the cut (s): {got['exits_s']}; the coordinator failed the job at {got['noticed_s']} s"
    )


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
        steps_after(job, 2, "the first steps")
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
    got = head_lost(net, tmp_path)
    assert all(got["codes"][name] == 1 for name in got["batchd"]), got["codes"]
    for name, log in got["logs"].items():
        assert "Traceback" not in log, f"{name}:\n{log[-3000:]}"
        gone = r"(its Ray at 10\.77\.0\.2:6379 went away|coordinator at 10\.77\.0\.2:7000 unreachable)"
        assert re.search(gone, log), f"{name}:\n{log[-2000:]}"
    print(f"exits after the head was lost (s): {got['exits_s']}")


def test_a_host_lost_under_the_elastic_recipe_resizes_the_job(net, tmp_path):
    """torchrun elastic across two hosts (each its own address; the rendezvous store on host1): host2 is
    lost mid-epoch; host1's torchrun restarts its workers at world size 2, the coordinator resizes the job,
    and they resume from the furthest checkpoint: every sample of the epoch trained exactly once (the
    steps of world size 4 before the resume step, then every step of world size 2), both new ranks make
    every step, host1's torchrun exits 0."""
    import collections

    got = elastic_host_lost(net, tmp_path)
    assert got["code"] == 0, got["log"][-4000:]
    lines, worlds, resume, seen = got["lines"], got["worlds"], got["resume_step"], got["trained"]
    assert (0, 4) in worlds and any(r > 0 and w == 2 for r, w in worlds), worlds
    assert resume is not None and resume > 0  # resized, and resumed mid-epoch
    assert set(seen) == set(range(got["samples"])) and max(seen.values()) == 1, len(seen)
    per_rank = collections.Counter(
        (ln["world"], ln["restart"], ln["step"]) for ln in lines if ln["world"] == 2
    )
    assert set(per_rank.values()) == {2}
    assert "saved at world size 4: the job was resized" in got["log"], got["log"][-3000:]
    print(f"elastic: host1's torchrun done {got['done_s']} s after host2 was lost; resumed at step {resume}")
