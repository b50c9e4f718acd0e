"""Node affinity on a real multi-node Ray cluster (`ray.cluster_utils.Cluster`), run as a script.

    python tests/_ray_cluster_check.py WORK_DIR  ->  one JSON object on the last stdout line

A Cluster cannot share a process with the pytest session's `ray.init`, so tests/test_ray_nodes.py runs
this in a subprocess (with RAY_TMPDIR set to a private dir, so no other process on the host finds this
cluster through `running_ray_address`) and asserts on the facts it prints.

The nodes all live on this host; nodes A and B get their own loopback IPs (127.0.0.2, 127.0.0.3), so a
driver started with `_node_ip_address` attaches to that node's raylet, as a node agent on host A would
(a driver attaches to the raylet of its own IP; on one IP with several raylets, Ray prefers the head).

Scenario:
1. Two RaySources pinned to A and B (explicit node ids), two actors each: where every actor runs, and
   each sample's `nbytes` against its payload and its re-materialized payload.
2. Defaults: this driver attached to the head, so a RaySource without node_id runs on the head; an
   "agent" subprocess attached to B (`_node_ip_address`) gets B's id as its node and runs there; one
   that only calls `share_ray(address)` attaches to the head (same IP) and runs there.
3. Borrowing: two 1-CPU actors pinned to A (1 CPU): one runs on A, the other on another node.
4. Opting out: node_id="" leaves placement to Ray (no target in `stats()`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

AGENT = r"""
import json, sys, time
import ray
from batchd.preprocess import EXHAUSTED, PoolOptions, RaySource, default_stages, share_ray
address, ip, data, tok = sys.argv[1:5]
if ip:
    ray.init(address=address, _node_ip_address=ip)  # what a driver on host `ip` does by itself
shared = share_ray(address)  # `batchd node --ray-address`: joins (or keeps the connection above)
pool = PoolOptions(stages=default_stages(tok, cutoff=512), num_actors=1, actor_num_cpus=0.25)
src = RaySource(data, 0, 4, seed=0, pool=pool)
deadline, got = time.monotonic() + 60, 0
while got < 2 and time.monotonic() < deadline:
    item = src.poll(0.5)
    if item is EXHAUSTED:
        break
    got += item is not None
print(json.dumps({"node": ray.get_runtime_context().get_node_id(), "target": src.stats()["node_id"],
                  "actors": src.actor_nodes(), "samples": got}))
src.close()
shared.close()
"""


def drain(src, deadline_s: float = 60.0):
    """[(Sample, payload ref)] until EXHAUSTED; raises on a stall (nothing for `deadline_s`)."""
    from batchd.preprocess import EXHAUSTED

    out, deadline = [], time.monotonic() + deadline_s
    while True:
        item = src.poll(0.5)
        if item is EXHAUSTED:
            return out
        if item is not None:
            out.append(item)
            deadline = time.monotonic() + deadline_s
        if time.monotonic() > deadline:
            raise TimeoutError(f"source stalled after {len(out)} samples")


def wait_all_cpus_free(total: float, deadline_s: float = 30.0) -> None:
    """Waits until every CPU of the cluster is free again (closed pools' actors have released theirs)."""
    import ray

    deadline = time.monotonic() + deadline_s
    while ray.available_resources().get("CPU", 0.0) < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"CPUs still held: {ray.available_resources()}")
        time.sleep(0.1)


def main(work: str) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from batchd.preprocess import (
        PoolOptions,
        RaySource,
        StreamOptions,
        TokenizerRef,
        default_stages,
        demo_tokenizer,
        make_demo_dataset,
        resolve_many,
    )
    from batchd.testing import PreprocessPool, payload_nbytes

    t0 = time.monotonic()
    facts: dict = {}
    data = make_demo_dataset(
        os.path.join(work, "data"),
        num_samples=24,
        seed=2,
        format="arrow",
        image_fraction=0.5,
        max_image_side=96,
        bad_fraction=0.0,
    )  # placement, not bad data
    tok_path = str(demo_tokenizer(os.path.join(work, "tokenizer.json")))
    stages = default_stages(TokenizerRef(tok_path), cutoff=512)
    cluster = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={"num_cpus": 1, "resources": {"head": 1}, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=1, resources={"node_a": 1}, node_ip_address="127.0.0.2")
        cluster.add_node(num_cpus=1, resources={"node_b": 1}, node_ip_address="127.0.0.3")
        cluster.wait_for_nodes()
        nodes = {
            name: n["NodeID"]
            for n in ray.nodes()
            if n["Alive"]
            for name in ("head", "node_a", "node_b")
            if name in n["Resources"]
        }
        facts["nodes"] = nodes
        facts["driver_node"] = ray.get_runtime_context().get_node_id()
        facts["t_cluster_s"] = time.monotonic() - t0

        # 1. pinned sources: where their actors run, and the bytes their samples carry
        pinned = {}
        for rank, name in enumerate(("node_a", "node_b")):
            src = RaySource(
                data.path,
                rank,
                2,
                seed=1,
                pool=PoolOptions(stages=stages, num_actors=2, actor_num_cpus=0.5, node_id=nodes[name]),
                options=StreamOptions(chunk_size=2),
            )
            items = drain(src)
            samples = [s for s, _ in items]
            payloads = resolve_many([p for _, p in items])
            again = src.materialize_many([s.id for s in samples])
            pinned[name] = {
                "target": src.stats()["node_id"],
                "actors": src.actor_nodes(),
                "stats_nodes": [a["node_id"] for a in src.pool.stats()],
                "samples": len(samples),
                "vision_samples": sum(dict(s.modality_tokens)["vision"] > 0 for s in samples),
                "nbytes": [s.nbytes for s in samples],
                "payload_nbytes": [payload_nbytes(p) for p in payloads],
                "materialized_nbytes": [payload_nbytes(p) for p in again],
                "array_nbytes": [sum(v.nbytes for v in p.values()) for p in payloads],
            }
            src.close()
        facts["pinned"] = pinned
        facts["t_pinned_s"] = time.monotonic() - t0

        # 2. defaults: this driver's node (the head), and an agent's driver attached to B
        with RaySource(
            data.path, 0, 4, seed=0, pool=PoolOptions(stages=stages, num_actors=1, actor_num_cpus=0.25)
        ) as src:
            facts["default"] = {
                "target": src.stats()["node_id"],
                "actors": src.actor_nodes(),
                "samples": len(drain(src)),
            }
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        for key, ip in (("agent", "127.0.0.3"), ("agent_plain", "")):
            agent = subprocess.run(
                [sys.executable, "-c", AGENT, cluster.address, ip, data.path, tok_path],
                check=False,
                capture_output=True,
                text=True,
                timeout=90,
                env=env,
            )
            try:
                facts[key] = json.loads(agent.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                facts[key] = {
                    "error": f"rc={agent.returncode}: {agent.stdout[-1000:]} {agent.stderr[-3000:]}"
                }
        facts["t_default_s"] = time.monotonic() - t0

        # 3. borrowing: A has 1 CPU, the pool wants 2 one-CPU actors
        wait_all_cpus_free(3.0)
        with PreprocessPool(
            data.path, stages, num_actors=2, actor_num_cpus=1.0, node_id=nodes["node_a"], start_timeout_s=60
        ) as pool:
            src = RaySource(None, 0, 2, seed=1, pool=pool)
            facts["borrow"] = {"actors": src.actor_nodes(), "samples": len(drain(src))}

        # 4. opting out
        with RaySource(
            data.path,
            0,
            4,
            seed=0,
            pool=PoolOptions(stages=stages, num_actors=1, actor_num_cpus=0.25, node_id=""),
        ) as src:
            facts["unpinned"] = {
                "target": src.stats()["node_id"],
                "pool_node_id": src.pool.node_id,
                "samples": len(drain(src)),
            }
        facts["t_total_s"] = time.monotonic() - t0
    finally:
        ray.shutdown()
        cluster.shutdown()
    return facts


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
