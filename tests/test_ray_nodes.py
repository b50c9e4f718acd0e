"""Node placement of the preprocessing actors and the payload bytes every sample carries.

The multi-node test runs a real `ray.cluster_utils.Cluster` (three raylets on this host) in a subprocess,
tests/_ray_cluster_check.py: a Cluster cannot share a process with the session's `ray.init`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from batchd.core import Sample
from batchd.preprocess import EXHAUSTED, IngestSource, SyntheticSource
from batchd.testing import payload_nbytes

HERE = Path(__file__).resolve().parent


def test_payload_nbytes_sums_the_arrays_and_skips_scalars():
    payload = {
        "input_ids": np.zeros(7, np.int32),
        "labels": np.zeros(7, np.int32),
        "pixel_values": np.zeros((4, 1176), np.float32),
        "image_grid_thw": np.array([[1, 2, 2]], np.int64),
        "weight": 0.5,
        "count": 3,
    }
    assert payload_nbytes(payload) == 28 + 28 + 4 * 1176 * 4 + 24
    assert payload_nbytes({}) == 0
    assert payload_nbytes({"ids": [1, 2, 3]}) == np.asarray([1, 2, 3]).nbytes  # a list counts as its array


def test_synthetic_samples_carry_their_payload_bytes_and_rematerialize_alike():
    src = SyntheticSource([5, 9, 30, 2, 17, 1], rank=1, world_size=2, seed=3)
    items = []
    while (item := src.poll()) is not EXHAUSTED:
        items.append(item)
    assert len(items) == 3
    for sample, payload in items:
        assert sample.nbytes == payload_nbytes(payload) == 2 * 4 * sample.length  # int32 ids + labels
        assert sample.nbytes == payload_nbytes(src.materialize(sample.id))
        assert Sample.from_json(sample.to_json()) == sample  # survives the journal


def test_ingest_source_takes_the_bytes_from_the_ingested_tensors():
    src = IngestSource(4)
    payload = {"input_ids": np.arange(6, dtype=np.int64), "labels": np.arange(6, dtype=np.int64)}
    src.put(Sample(3, 6, 5, 0), payload)  # the producer said nothing about bytes
    src.put(Sample(4, 6, 5, 0, nbytes=1), payload)  # or something wrong
    src.end()
    got = [src.poll(), src.poll()]
    assert [s.nbytes for s, _ in got] == [96, 96]
    assert src.poll() is EXHAUSTED


@pytest.mark.slow
def test_sources_pinned_to_nodes_of_a_real_cluster(tmp_path):
    """Two RaySources pinned to two nodes of a 3-node Ray cluster: every actor runs on its source's node;
    a driver's default is the node it attached to (the head here, share_ray(address) included; B for an
    agent started with B's IP);
    a pool too big for its node borrows another; node_id="" leaves placement to Ray; samples carry their
    payload bytes, the same when re-materialized."""
    for ip in ("127.0.0.2", "127.0.0.3"):  # the nodes' own IPs (all of 127/8 is loopback on Linux, not macOS)
        with socket.socket() as probe:
            try:
                probe.bind((ip, 0))
            except OSError:
                pytest.skip(f"{ip} is not a local address here")
    work = tempfile.mkdtemp(prefix="bd-")  # short: Ray's socket paths live under RAY_TMPDIR
    env = {**os.environ, "RAY_TMPDIR": work}  # a private Ray root: no other process on the host finds it
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_ray_cluster_check.py"), str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the cluster scenario passed its deadline:\n{out[-2000:]}\n{err[-4000:]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out[-2000:]}\n{err[-6000:]}"
    facts = json.loads(out.strip().splitlines()[-1])
    nodes = facts["nodes"]
    assert len(set(nodes.values())) == 3, nodes

    for name in ("node_a", "node_b"):
        p = facts["pinned"][name]
        assert p["target"] == nodes[name]
        assert p["actors"] == p["stats_nodes"] == [nodes[name]] * 2, (name, p, nodes)
        assert p["samples"] > 0 and p["vision_samples"] > 0, p  # images: pixel_values cross the network too
        assert p["nbytes"] == p["payload_nbytes"] == p["materialized_nbytes"] == p["array_nbytes"], p
        assert all(n > 0 for n in p["nbytes"])
    assert facts["pinned"]["node_a"]["samples"] + facts["pinned"]["node_b"]["samples"] <= 24

    assert facts["driver_node"] == nodes["head"]  # one host: a driver attaches to the head's raylet
    default = facts["default"]
    assert (
        default["target"] == nodes["head"] and default["actors"] == [nodes["head"]] and default["samples"] > 0
    )
    agent = facts["agent"]
    assert "error" not in agent, agent.get("error", "")
    assert agent["node"] == agent["target"] == nodes["node_b"] and agent["actors"] == [nodes["node_b"]], agent
    assert agent["samples"] == 2
    plain = facts["agent_plain"]  # share_ray(address) alone, on the head's IP
    assert "error" not in plain, plain.get("error", "")
    assert plain["node"] == plain["target"] == nodes["head"] and plain["actors"] == [nodes["head"]], plain

    borrow = facts["borrow"]
    assert nodes["node_a"] in borrow["actors"] and len(set(borrow["actors"])) == 2, (borrow, nodes)
    assert borrow["samples"] > 0
    assert facts["unpinned"]["target"] == "" and facts["unpinned"]["pool_node_id"] is None
    assert facts["unpinned"]["samples"] > 0
