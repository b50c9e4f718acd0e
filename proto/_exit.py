"""Before a process finalizes: gRPC's own threads have ended (`wait_grpc_threads`).

grpcio runs a channel's calls on threads of its own (a thread polling the channel's events, one feeding
each streaming call's request iterator). Under CPython 3.11 a thread that takes the GIL while the
interpreter finalizes is ended where it stands; one of these ended holding a call's lock leaves the
call's finalizer (`_Rendezvous.__del__`, run by the final garbage collection) waiting on that lock
forever: a node agent that never exited after its job, in CI. Closing every channel ends their calls,
and these threads then end by themselves; a process's main waits for that before it returns."""

from __future__ import annotations

import threading
import time

GRPC_THREADS_S = 10.0  # how long `wait_grpc_threads` waits at most (they end in milliseconds)


def grpc_threads() -> list[threading.Thread]:
    """The live threads grpcio started (their target is one of grpc's Cython functions)."""
    return [
        t
        for t in threading.enumerate()
        if t.is_alive() and getattr(getattr(t, "_target", None), "__module__", "").startswith("grpc")
    ]


def wait_grpc_threads(timeout_s: float = GRPC_THREADS_S) -> list[threading.Thread]:
    """Waits up to `timeout_s` in all for grpcio's threads to end (call it once every channel and server
    of the process is closed); returns those still running."""
    deadline = time.monotonic() + timeout_s
    for t in grpc_threads():
        t.join(max(deadline - time.monotonic(), 0.0))
    return grpc_threads()
