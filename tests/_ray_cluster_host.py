"""Hosts a real multi-node Ray cluster (`ray.cluster_utils.Cluster`) for a test, until told to stop.

    python tests/_ray_cluster_host.py INFO_FILE

Starts a head (no CPUs: no actor lands there) and two worker nodes on their own loopback IPs,
127.0.0.2 ("node_a") and 127.0.0.3 ("node_b"), 4 logical CPUs each, then writes
{"address": GCS address, "nodes": {"head"|"node_a"|"node_b": node id}, "ips": {name: ip}} to INFO_FILE
(atomically) and waits until its stdin closes (the test's end, or the test process dying) or SIGTERM,
then shuts the cluster down. A driver started with `ray.init(address, _node_ip_address=IP)` (a node
agent with $BATCHD_RAY_NODE_IP=IP) attaches to the node of that IP.

Run it with RAY_TMPDIR set to a private short directory: no other process on the host finds this
cluster, and Ray's socket paths stay short. A Cluster cannot share a process with another `ray.init`,
hence a process of its own (as tests/_ray_cluster_check.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

IPS = {"node_a": "127.0.0.2", "node_b": "127.0.0.3"}


def main(info_file: str) -> int:
    import ray
    from ray.cluster_utils import Cluster

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    cluster = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={"num_cpus": 0, "resources": {"head": 1}, "include_dashboard": False},
    )
    try:
        for name, ip in IPS.items():
            cluster.add_node(num_cpus=4, resources={name: 1}, node_ip_address=ip)
        cluster.wait_for_nodes()
        nodes = {
            name: n["NodeID"]
            for n in ray.nodes()
            if n["Alive"]
            for name in ("head", *IPS)
            if name in n["Resources"]
        }
        tmp = info_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"address": cluster.address, "nodes": nodes, "ips": IPS}, f)
        os.replace(tmp, info_file)
        print(f"cluster up at {cluster.address}: {nodes}", flush=True)
        stop.wait()
    finally:
        ray.shutdown()
        cluster.shutdown()
        print("cluster down", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
