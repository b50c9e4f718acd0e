"""Ray for the data plane: connecting to it (`ensure_ray`, `share_ray`) and fetching payloads (`resolve`).

Embedded default: `ensure_ray()` starts a local Ray when none is running and no address is given;
`ray_address` joins a running cluster (where batchd must be importable on every node). Rank services
use `share_ray()` instead: without an address they join a Ray already running on this host
(`running_ray_address`; one Ray per host, however many rank services), start the embedded one only when
there is none, and keep it up until the last rank service using it has exited (`SharedRay`: a shared
lock per Ray, held while the process uses it, released however the process ends). Look-and-start is
serialized across the host by a lock file.

Multi-node: one Ray cluster, each node agent joining it with `--ray-address` (`share_ray(address)`).
A driver attaches to the raylet of its own host (Ray matches the host's IP against the nodes' and,
when several nodes share one IP, prefers the head), so `ray.get_runtime_context().get_node_id()` in an
agent is its own node: the default node its `PreprocessPool`s pin their actors to. On one machine
(`ray.cluster_utils.Cluster`, several raylets on one IP) every driver attaches to the head unless
started with `ray.init(address=..., _node_ip_address=...)` naming a node's own IP, or the pools are
given `node_id` explicitly (tests/_ray_cluster_check.py does both). Ray reads no environment variable
for that IP, so `share_ray` passes `$BATCHD_RAY_NODE_IP` (when set) as `_node_ip_address` when it joins a
running Ray: a node agent started with it attaches to that node's raylet (tests/test_node_cluster.py).

`resolve(payload)` / `resolve_many(payloads)` turn a sample's payload reference into its dict, at
collate time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

log = logging.getLogger("batchd.preprocess")


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connects to Ray: no-op when initialized, joins `address` when given, else starts a local instance."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False)


def _gcs_reachable(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _ray_root() -> str:
    """Ray's temp root on this host (where `ray start` writes `ray_current_cluster`)."""
    base = os.environ.get("RAY_TMPDIR") or (os.environ.get("TMPDIR") if os.name == "posix" else None) or "/tmp"
    return os.path.join(base, "ray")


def running_ray_address() -> str | None:
    """The GCS address of a Ray already running on this host, or None.

    Looked for in order: `RAY_ADDRESS`; the cluster `ray start` last wrote to Ray's temp root; a Ray
    process of this user on this host whose session lives under the same temp root (the
    `--gcs-address=` of Ray's monitors and raylet). The temp root is Ray's: `$RAY_TMPDIR/ray`, else
    `$TMPDIR/ray`, else `/tmp/ray`, so processes with another `TMPDIR` do not see each other's Ray. An
    address counts only while its GCS accepts TCP connections (a stale address file, or a Ray being
    torn down, is skipped).
    """
    env = os.environ.get("RAY_ADDRESS")
    if env and env not in ("auto", "local"):
        return env
    candidates = []
    with contextlib.suppress(OSError):
        with open(os.path.join(_ray_root(), "ray_current_cluster"), encoding="utf-8") as f:
            candidates.append(f.read().strip())
    uid = os.getuid() if hasattr(os, "getuid") else None
    session = os.path.join(_ray_root(), "session_")
    with contextlib.suppress(OSError):
        for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
            try:
                if uid is not None and os.stat(f"/proc/{pid}").st_uid != uid:
                    continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
            except OSError:
                continue
            if session in cmd:
                candidates += [m for m in re.findall(r"--gcs-address=([^\x00\s]+)", cmd) if m not in candidates]
    return next((a for a in candidates if a and _gcs_reachable(a)), None)


class SharedRay:
    """This process's use of a Ray (`share_ray`): `address` (GCS), `started` (this process started it).

    While it is held, the process holds a shared lock on a per-Ray "users" file in the temp dir; the
    lock dies with the process, however it ends (kill -9 included). `close()`: a Ray only joined is
    left alone (never stopped, not even `ray.shutdown()`: the process's exit disconnects it); a Ray
    started here is stopped (`ray.shutdown()`) only once no other process holds the lock, since the
    rank services that joined it keep their payloads in its object store. Waiting for them is logged.
    """

    def __init__(self, address: str, started: bool) -> None:
        self.address, self.started = address, started
        name = re.sub(r"[^0-9A-Za-z.]+", "_", address)
        self.users_file = os.path.join(tempfile.gettempdir(), f"batchd-ray-{name}.users")
        self._fd: int | None = os.open(self.users_file, os.O_RDWR | os.O_CREAT, 0o600)
        _flock(self._fd, shared=True, wait=True)

    def close(self, poll_s: float = 0.5) -> None:
        """Releases this process's use; stops a Ray started here once nobody else uses it (see class)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self.started:
                if not _flock(fd, shared=False, wait=False):
                    log.info("waiting for the other rank services that joined the Ray at %s to exit before "
                             "stopping it", self.address)
                    while not _flock(fd, shared=False, wait=False):
                        time.sleep(poll_s)
                ray.shutdown()
                log.info("stopped the embedded Ray at %s", self.address)
        finally:
            os.close(fd)


def _flock(fd: int, shared: bool, wait: bool) -> bool:
    try:
        import fcntl
    except ImportError:  # not POSIX: no sharing protocol, every process acts alone
        return True
    flags = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB)
    try:
        fcntl.flock(fd, flags)
    except BlockingIOError:
        return False
    return True


def _local_auth() -> None:
    """Enables Ray's token auth the way Ray's own discovery of a local cluster does (`ray.init()` without
    an address): a Ray started on this host by `ray.init` (Ray >= 2.5x) requires the token in
    ~/.ray/auth_token, and an explicit address does not turn token auth on by itself."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token auth
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


@contextlib.contextmanager
def _host_lock():
    """Serializes `share_ray`'s look-or-start across the processes of this host (a lock file in the temp dir)."""
    fd = os.open(os.path.join(tempfile.gettempdir(), "batchd-ray-start.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _flock(fd, shared=False, wait=True)
        yield
    finally:
        os.close(fd)  # releases the lock


NODE_IP_ENV = "BATCHD_RAY_NODE_IP"


def _join(address: str) -> None:
    """`ray.init(address)`, attached to the raylet of `$BATCHD_RAY_NODE_IP` when it is set (module docstring)."""
    ip = os.environ.get(NODE_IP_ENV, "").strip()
    if ip:
        ray.init(address=address, _node_ip_address=ip)
    else:
        ray.init(address=address)


def share_ray(address: str | None = None, num_cpus: int | None = None, who: str = "batchd") -> SharedRay:
    """Connects this process to Ray the way a rank service does; returns the `SharedRay` to close at exit.

    `address` given: joins it. None: joins a Ray already running on this host (`running_ray_address`),
    else starts the embedded one (logged). Look-and-start is serialized across the host, so rank
    services started together share one Ray rather than each starting their own.

    A process already connected to Ray keeps that connection, as joined (not its to stop). The node it
    attached to (its host's, or `$BATCHD_RAY_NODE_IP`'s: see the module docstring) is logged: it is where
    its pools' actors go.
    """
    if ray.is_initialized():
        return SharedRay(ray.get_runtime_context().gcs_address, started=False)
    if address:
        _join(address)
        gcs = ray.get_runtime_context().gcs_address
        log.info("%s: joined the Ray cluster at %s (gcs %s) on node %s", who, address, gcs,
                 ray.get_runtime_context().get_node_id())
        return SharedRay(gcs, started=False)
    with _host_lock():
        found = running_ray_address()
        if found:
            _local_auth()
            _join(found)
            gcs = ray.get_runtime_context().gcs_address
            log.info("%s: joined the Ray already running on this host (gcs %s)", who, gcs)
            return SharedRay(gcs, started=False)
        ray.init(num_cpus=num_cpus, include_dashboard=False)
        gcs = ray.get_runtime_context().gcs_address
        shared = SharedRay(gcs, started=True)  # holds its lock before the next process may look
    log.info("%s: no Ray running on this host: started an embedded Ray (gcs %s); rank services started later "
             "on this host join it", who, gcs)
    return shared


def resolve(payload: Any) -> dict[str, np.ndarray]:
    """The payload dict of a sample: `ray.get` when it is an ObjectRef, the value itself otherwise."""
    if isinstance(payload, ray.ObjectRef):
        return ray.get(payload)
    return payload


def resolve_many(payloads: Sequence[Any]) -> list[dict[str, np.ndarray]]:
    """`resolve` for a list, with one `ray.get` round trip for all the references in it."""
    idx = [k for k, p in enumerate(payloads) if isinstance(p, ray.ObjectRef)]
    out = list(payloads)
    if idx:
        for k, value in zip(idx, ray.get([payloads[k] for k in idx])):
            out[k] = value
    return out
