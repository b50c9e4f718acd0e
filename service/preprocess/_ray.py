"""Ray for the data plane: connecting to it (`ensure_ray`, `share_ray`) and fetching payloads (`resolve`).

Embedded default: `ensure_ray()` starts a local Ray when none is running and no address is given;
`ray_address` joins a running cluster (where batchd must be importable on every node). Rank services
and node agents use `share_ray()` instead. Without an address they never join a Ray another job
started: they join the Ray of their own job on this host (`job_ray_address`: the Ray whose processes
carry `$BATCHD_RAY_JOB` = the job's key, `job_key(coordinator, spec)`), else start an embedded one
carrying that key, so the `batchd rank` processes of one job share one Ray and a second job on the same
host (a `batchd demo`, another recipe) gets its own. Joining a Ray already running on this host is
only done when asked: `ray_address = "auto"` (`running_ray_address`), or an address. The embedded Ray
is kept up until the last process of the job using it has exited (`SharedRay`: a shared lock per Ray,
held while the process uses it, released however the process ends). Look-and-start is serialized
across the host by a lock file.

A Ray that goes away under a running service (its GCS or raylet killed, or the Ray it joined shut down
by its owner) is noticed by `SharedRay.watch` (a thread that checks every few seconds that the GCS and
the raylet of its node accept connections) and, when an actor call raises, by `ray_lost` / `RayLost`:
the service fails the job naming the Ray instead of waiting for actors that never come back (Ray
itself ends a driver whose GCS stays unreachable for 60 s, with no word to the job).

Multi-node: one Ray cluster, each node agent joining it with `--ray-address` (`share_ray(address)`).
A driver attaches to the raylet of its own host (Ray matches the host's IP against the nodes' and,
when several nodes share one IP, prefers the head), so `ray.get_runtime_context().get_node_id()` in an
agent is its own node: the default node its `PreprocessPool`s pin their actors to. On one machine
(`ray.cluster_utils.Cluster`, several raylets on one IP) every driver attaches to the head unless
started with `ray.init(address=..., _node_ip_address=...)` naming a node's own IP, or the pools are
given `node_id` explicitly (tests/_ray_cluster_check.py does both). Ray reads no environment variable
for that IP, so `share_ray` passes `$BATCHD_RAY_NODE_IP` (when set) as `_node_ip_address` when it joins a
running Ray: a node agent started with it attaches to that node's raylet (tests/test_netcluster.py, hosts
with their own addresses, sets it too).

`resolve(payload)` / `resolve_many(payloads)` turn a sample's payload reference into its dict, at
collate time.

Seam: reading and signalling this host's processes (which are a Ray's, which a killed raylet left
behind) is `_ray_procs`; this module decides what they mean.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import ray
else:
    from ._lazy_ray import ray  # imported on first use

from ._lazy_ray import loaded
from ._ray_procs import JOB_ENV, descendants, end_leftovers, has_env, ray_processes, start_time

log = logging.getLogger("batchd.preprocess")


GCS_START_WAIT_S = 120  # per start: how long its GCS may take to come up (Ray's default: 30 s)
START_ATTEMPTS = 3  # starts of a local Ray before its failure is the caller's
# What ray.init raises when a part of the node did not come up in time (GCS port file, raylet registration)
START_TIMEOUTS = ("Timed out waiting for file", "timed out during startup")


def start_local_ray(**kwargs: Any) -> None:
    """`ray.init(**kwargs)` starting a local Ray, whose GCS may take up to `GCS_START_WAIT_S` to come up
    (unless $RAY_gcs_server_port_wait_time_s says otherwise), started up to `START_ATTEMPTS` times.

    Ray's own start timeouts judge speed, not liveness: on a busy host, or the first start of a fresh
    install (a cold binary of a few hundred MB), its GCS has been seen to take over its 30 s to write its
    port file ("Timed out waiting for file .../gcs_server_port_..."), its raylet over the hard-coded 30 s
    to register ("The current node timed out during startup", no knob), and once, beside two CPU burners,
    a GCS never to write a log line in 300 s. So a start that times out is abandoned (the half-started
    node's processes killed) and Ray is started again; other errors, and the last attempt's, raise."""
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(GCS_START_WAIT_S))
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as e:
            if attempt == START_ATTEMPTS or not any(t in str(e) for t in START_TIMEOUTS):
                raise
            log.warning("starting Ray timed out (%s; a busy host?): starting it again", e)
            _kill_half_started_node(e)
            ray.shutdown()


def _kill_half_started_node(error: BaseException) -> None:
    """Kills the processes of the `ray._private.node.Node` whose constructor raised `error` (the object is
    lost with the exception; its frame still holds it)."""
    from ray._private.node import Node

    tb = error.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            with contextlib.suppress(Exception):
                node.kill_all_processes(check_alive=False, allow_graceful=False)
            return
        tb = tb.tb_next


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connects to Ray: no-op when initialized, joins `address` when given, else starts a local instance."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
    else:
        start_local_ray(num_cpus=num_cpus, include_dashboard=False)


def _gcs_reachable(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _ray_root() -> str:
    """Ray's temp root on this host (where `ray start` writes `ray_current_cluster`)."""
    base = (
        os.environ.get("RAY_TMPDIR") or (os.environ.get("TMPDIR") if os.name == "posix" else None) or "/tmp"
    )
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
    session = os.path.join(_ray_root(), "session_")
    for _, cmd in ray_processes():
        if session in cmd:
            candidates += [m for m in re.findall(r"--gcs-address=([^\x00\s]+)", cmd) if m not in candidates]
    return next((a for a in candidates if a and _gcs_reachable(a)), None)


FAMILY_EVERY = 5  # `SharedRay.check`s between two looks at the processes of a Ray started here


def job_key(coordinator: str, spec: Any) -> str:
    """The identity of a job on a host: its coordinator's address and its spec (a dataclass, `JobSpec`).

    The processes of one job (its `batchd rank`s, its node agents) agree on it; another job (another
    coordinator, or another spec) gets another key, so it never shares their Ray."""
    fields = (
        spec
        if isinstance(spec, dict)
        else {k: getattr(spec, k) for k in getattr(spec, "__dataclass_fields__", {})}
    )
    blob = json.dumps({"coordinator": coordinator, "spec": fields}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def job_ray_address(key: str) -> str | None:
    """The GCS address of the Ray job `key` started on this host (`share_ray`), or None.

    Found by its processes: Ray's raylet and monitors name their GCS (`--gcs-address=`) and inherit the
    environment of the process that started Ray, `$BATCHD_RAY_JOB` included. Any temp root: two jobs
    with the same `TMPDIR` still tell their Rays apart. Counts only while its GCS accepts connections."""
    tag = f"{JOB_ENV}={key}".encode()
    candidates: list[str] = []
    for pid, cmd in ray_processes():
        if has_env(pid, tag):
            candidates += [m for m in re.findall(r"--gcs-address=([^\x00\s]+)", cmd) if m not in candidates]
    return next((a for a in candidates if a and _gcs_reachable(a)), None)


class RayLost(RuntimeError):
    """The Ray a service runs on went away (its GCS or its node's raylet is unreachable): the job fails."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(f"its Ray at {address} went away ({why})")
        self.address, self.why = address, why


def _raylet_address() -> str | None:
    """host:port of the raylet this process is attached to (None when unknown)."""
    with contextlib.suppress(Exception):
        node: Any = ray._private.worker.global_worker.node  # Ray's private node object
        return f"{node.node_ip_address}:{int(node.node_manager_port)}"
    return None


def ray_lost(address: str | None = None, raylet: str | None = None, timeout: float = 2.0) -> RayLost | None:
    """A `RayLost` when the Ray at `address` (default: this process's) is gone, else None.

    Gone: its GCS, or the raylet of this process's node (`raylet`, default: found from the connection),
    refuses connections, twice in a row (a second look after a moment, so a busy host is not judged by a
    single slow connect). Cheap: two TCP connects."""
    if address is None:
        if not ray.is_initialized():
            return None
        address = ray.get_runtime_context().gcs_address
        raylet = raylet or _raylet_address()
    why = "unreachable"
    for attempt in range(2):
        why_now = None
        if not _gcs_reachable(address, timeout):
            why_now = f"its GCS at {address} is unreachable"
        elif raylet and not _gcs_reachable(raylet, timeout):
            why_now = f"the raylet of this node at {raylet} is unreachable"
        if why_now is None:
            return None
        why = why_now
        if attempt == 0:
            time.sleep(0.5)
    return RayLost(address, why)


class SharedRay:
    """This process's use of a Ray (`share_ray`): `address` (GCS), `started` (this process started it).

    While it is held, the process holds a shared lock on a per-Ray "users" file in the temp dir; the
    lock dies with the process, however it ends (kill -9 included). `close()`: a Ray only joined is
    never stopped; a process that connected to it for this use (`connected`) disconnects (`ray.shutdown()`)
    *before* it releases the lock, so the Ray's owner never stops it under a live connection (a process
    still connected when its GCS goes away waits 60 s in Ray's client at exit, then exits 1); a process
    that was connected already keeps its connection. A Ray started here is stopped (`ray.shutdown()`) only
    once no other process holds the lock, since the rank services that joined it keep their payloads in its
    object store. Waiting for them is logged.
    """

    WATCH_S = 2.0  # how often `watch` looks at the Ray

    def __init__(self, address: str, started: bool, job: str | None = None, connected: bool = False) -> None:
        self.address, self.started, self.job = address, started, job
        self.connected = connected or started  # this process connected to the Ray for this use
        self.raylet = _raylet_address() if ray.is_initialized() else None
        self.lost: RayLost | None = None  # set by `watch` once the Ray went away
        name = re.sub(r"[^0-9A-Za-z.]+", "_", address)
        self.users_file = os.path.join(tempfile.gettempdir(), f"batchd-ray-{name}.users")
        self._fd: int | None = os.open(self.users_file, os.O_RDWR | os.O_CREAT, 0o600)
        _flock(self._fd, shared=True, wait=True)
        self._unwatch = threading.Event()
        self._watcher: threading.Thread | None = None
        self._raylet_pid = _started_raylet_pid() if started else None
        self._raylet_start = start_time(self._raylet_pid) if self._raylet_pid is not None else None
        self._family: dict[int, str] = {}  # the raylet's descendants seen alive: {pid: start time}
        self._checks = 0

    def check(self) -> RayLost | None:
        """`ray_lost` for this Ray (its GCS and this node's raylet); remembered in `lost`. While a Ray
        started here is alive, the processes its raylet started are noted (`end_leftovers` ends them
        once it is gone)."""
        if self.lost is None:
            self.lost = ray_lost(self.address, self.raylet)
            # A /proc scan: at every check while the raylet is still starting its agents (a look taken
            # before they existed missed them, and they outlived a killed raylet), then every fifth. Every
            # process seen is kept ({pid: start time}: a reused pid is spared).
            if (
                self.lost is None
                and self._raylet_pid is not None
                and (self._checks < 3 * FAMILY_EVERY or self._checks % FAMILY_EVERY == 0)
            ):
                self._family.update(descendants(self._raylet_pid))
            self._checks += 1
        return self.lost

    def watch(self, on_lost: Callable[[RayLost], None], every_s: float | None = None) -> None:
        """Checks every `every_s` (default WATCH_S) in a daemon thread that the Ray is still there (`check`);
        calls `on_lost(RayLost)` once when it is not, so an idle service notices too. Stops at `close`."""
        every = self.WATCH_S if every_s is None else every_s

        def run() -> None:
            while not self._unwatch.wait(every):
                lost = self.check()
                if lost is not None and not self._unwatch.is_set():
                    on_lost(lost)
                    return

        self._watcher = threading.Thread(target=run, name="batchd-ray-watch", daemon=True)
        self._watcher.start()

    def close(self, poll_s: float = 0.5) -> None:
        """Releases this process's use; stops a Ray started here once nobody else uses it (see class)."""
        self._unwatch.set()
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self.started:
                if not _flock(fd, shared=False, wait=False):
                    log.info(
                        "waiting for the other rank services that joined the Ray at %s to exit before "
                        "stopping it",
                        self.address,
                    )
                    while not _flock(fd, shared=False, wait=False):
                        time.sleep(poll_s)
                ray.shutdown()
                if self.lost is not None:
                    end_leftovers(self.job, self._family, self._raylet_start)
                log.info("stopped the embedded Ray at %s", self.address)
            elif self.connected and self.lost is None and ray.is_initialized():
                ray.shutdown()  # disconnect before the lock goes: the owner may stop the Ray right after
        finally:
            os.close(fd)


def _started_raylet_pid() -> int | None:
    """The pid of the raylet this process started (`ray.init` without an address), or None."""
    with contextlib.suppress(Exception):
        node: Any = ray._private.worker._global_node  # Ray's private node object
        return int(node.all_processes["raylet"][0].process.pid)
    return None


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
        from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]  # newer Ray only
    except ImportError:  # a Ray without token auth
        return
    if os.environ.get("RAY_AUTH_MODE") is None and AuthenticationTokenLoader.instance().has_token(
        ignore_auth_mode=True
    ):
        quiet_token_auth()  # what Ray's discovery does, without its warning at every start


@contextlib.contextmanager
def _host_lock() -> Iterator[None]:
    """Serializes `share_ray`'s look-or-start across the processes of this host (a lock file in the
    temp dir)."""
    fd = os.open(os.path.join(tempfile.gettempdir(), "batchd-ray-start.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _flock(fd, shared=False, wait=True)
        yield
    finally:
        os.close(fd)  # releases the lock


NODE_IP_ENV = "BATCHD_RAY_NODE_IP"


def _join(address: str) -> None:
    """`ray.init(address)`, attached to the raylet of `$BATCHD_RAY_NODE_IP` when it is set (module
    docstring)."""
    ip = os.environ.get(NODE_IP_ENV, "").strip()
    if ip:
        ray.init(address=address, _node_ip_address=ip)
    else:
        ray.init(address=address)


def quiet_token_auth() -> None:
    """Token auth on, said once by batchd instead of Ray's warning at every start: Ray warns "Token
    authentication is enabled for this Ray cluster" whenever it turns token auth on by itself (a new local
    Ray, or a local one found with a token in ~/.ray/auth_token); an explicit `RAY_AUTH_MODE` is respected
    without a warning. So when it is unset, batchd sets it to `token` (what Ray would do) before it starts
    or joins its job's own Ray. A user's `RAY_AUTH_MODE` is left alone."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    with contextlib.suppress(Exception):  # refresh Ray's cached config, as Ray's own switch does
        from ray._raylet import Config  # type: ignore[attr-defined]  # not in Ray's stub

        Config.initialize("")


def share_ray(
    address: str | None = None, num_cpus: int | None = None, who: str = "batchd", job: str | None = None
) -> SharedRay:
    """Connects this process to Ray the way a rank service does; returns the `SharedRay` to close at exit.

    `address` given: joins it ("auto": the Ray already running on this host, `running_ray_address`, an
    error when there is none; `$RAY_ADDRESS` counts as given). None: joins the Ray job `job` (`job_key`)
    started on this host (`job_ray_address`), else starts an embedded one marked with `job`; a Ray some
    other job started is never joined. Without `job` it always starts its own. Look-and-start is
    serialized across the host, so the rank services of one job started together share one Ray rather
    than each starting their own. Which it did is logged.

    A process already connected to Ray keeps that connection, as joined (not its to stop). The node it
    attached to (its host's, or `$BATCHD_RAY_NODE_IP`'s: see the module docstring) is logged: it is where
    its pools' actors go.
    """
    if ray.is_initialized():
        return SharedRay(ray.get_runtime_context().gcs_address, started=False)
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if not address and env and env != "local":
        address = env
    if address == "auto":
        with _host_lock():
            found = running_ray_address()
        if not found:
            raise RuntimeError(
                f"{who}: ray_address is 'auto' but no Ray is running on this host: start one "
                f"(`ray start --head`), give its address, or leave ray_address unset for an "
                f"embedded Ray of this job"
            )
        _local_auth()
        _join(found)
        gcs = ray.get_runtime_context().gcs_address
        log.info("%s: joined the Ray already running on this host (ray_address 'auto'; gcs %s)", who, gcs)
        return SharedRay(gcs, started=False, connected=True)
    if address:
        _join(address)
        gcs = ray.get_runtime_context().gcs_address
        log.info(
            "%s: joined the Ray cluster at %s (gcs %s) on node %s",
            who,
            address,
            gcs,
            ray.get_runtime_context().get_node_id(),
        )
        return SharedRay(gcs, started=False, connected=True)
    with _host_lock():
        found = job_ray_address(job) if job else None
        if found:
            quiet_token_auth()
            _join(found)
            gcs = ray.get_runtime_context().gcs_address
            log.info("%s: joined this job's Ray on this host (gcs %s)", who, gcs)
            return SharedRay(gcs, started=False, connected=True)
        quiet_token_auth()
        if job:
            os.environ[JOB_ENV] = (
                job  # inherited by the Ray processes started here: how the job's others find it
            )
        start_local_ray(num_cpus=num_cpus, include_dashboard=False)
        gcs = ray.get_runtime_context().gcs_address
        shared = SharedRay(gcs, started=True, job=job)  # holds its lock before the next process may look
    log.info(
        "%s: started an embedded Ray for this job (gcs %s)%s",
        who,
        gcs,
        "; this job's other rank services on this host join it" if job else "",
    )
    return shared


def resolve(payload: Any) -> dict[str, np.ndarray]:
    """The payload dict of a sample: `ray.get` when it is an ObjectRef, the value itself otherwise."""
    if not loaded():  # no ObjectRef exists before Ray was imported
        plain: dict[str, np.ndarray] = payload
        return plain
    got: dict[str, np.ndarray] = ray.get(payload) if isinstance(payload, ray.ObjectRef) else payload
    return got


def resolve_many(payloads: Sequence[Any]) -> list[dict[str, np.ndarray]]:
    """`resolve` for a list, with one `ray.get` round trip for all the references in it."""
    if not loaded():
        return list(payloads)
    idx = [k for k, p in enumerate(payloads) if isinstance(p, ray.ObjectRef)]
    out = list(payloads)
    if idx:
        for k, value in zip(idx, ray.get([payloads[k] for k in idx]), strict=False):
            out[k] = value
    return out
