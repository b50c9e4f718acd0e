"""Serving the coordinator: the process's event loop, `CoordinatorServer`, `create_server`.

One asyncio event loop (a daemon thread per process, `_EventLoop`) runs every call of every coordinator
server of the process; a `Node` stream is an async generator, not a thread. `CoordinatorServer` gives
that grpc.aio server the blocking interface of a sync `grpc.Server` (`start`, `stop(grace)`,
`wait_for_termination`), which `run_coordinator` and the tests use.

Registration (`method_handlers`): the Align, Commit and Node handlers return a reply serialized once for
every rank of the round (bytes). The generated `add_CoordinatorServicer_to_server` cannot carry that: it
hard-codes each reply class's `SerializeToString` as the response serializer, which refuses bytes. So
the method table is taken from the generated function itself (run against a recorder, so names,
request deserializers and streaming kinds stay the generated ones), and each response serializer is
wrapped to pass bytes through; the table is registered as the generic handler, as gRPC's generated
code does (one type check per reply: no measured cost).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import grpc
import grpc.aio

from batchd.core import JobSpec
from batchd.proto import GRPC_OPTIONS, Security
from batchd.proto import batchd_pb2_grpc as pb_grpc

from .._metrics import CoordinatorMetrics
from .._security import add_port, aio_server_interceptors
from ._servicer import CoordinatorServicer
from ._state import CoordinatorState

SERVICE = "batchd.v1.Coordinator"
T = TypeVar("T")


def _passing_bytes(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """A response serializer that passes bytes (a reply serialized once for many callers) through."""

    def serializer(message: Any) -> bytes:
        return message if type(message) is bytes else serialize(message)

    return serializer


class _Recorder:
    """Stands in for a server to the generated `add_CoordinatorServicer_to_server`: keeps its table."""

    def __init__(self) -> None:
        self.tables: dict[str, Mapping[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same table comes again through add_registered_method_handlers

    def add_registered_method_handlers(
        self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]
    ) -> None:
        self.tables[service] = handlers


def _rebuilt(h: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`h` with a response serializer that passes bytes through (see module docstring)."""
    kw = {
        "request_deserializer": h.request_deserializer,
        "response_serializer": _passing_bytes(h.response_serializer),
    }
    if h.request_streaming and h.response_streaming:
        return grpc.stream_stream_rpc_method_handler(h.stream_stream, **kw)
    if h.request_streaming:
        return grpc.stream_unary_rpc_method_handler(h.stream_unary, **kw)
    if h.response_streaming:
        return grpc.unary_stream_rpc_method_handler(h.unary_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(h.unary_unary, **kw)


def method_handlers(servicer: CoordinatorServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The Coordinator service's method table: the generated one, replies possibly pre-serialized."""
    recorder = _Recorder()
    pb_grpc.add_CoordinatorServicer_to_server(servicer, recorder)
    if SERVICE not in recorder.tables:  # stubs of a grpcio-tools that predates registered methods
        raise RuntimeError(f"the generated stubs registered no method table for {SERVICE}: regenerate them")
    return {name: _rebuilt(h) for name, h in recorder.tables[SERVICE].items()}


class _EventLoop:
    """The process's event loop for coordinator servers: one daemon thread, started on first use (again
    in a forked child, whose copy has no thread running it)."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _pid: int | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._pid != os.getpid():
                loop = asyncio.new_event_loop()
                threading.Thread(target=cls._run, args=(loop,), name="batchd-coord-aio", daemon=True).start()
                cls._loop, cls._pid = loop, os.getpid()
            return cls._loop

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        loop.run_forever()


class CoordinatorServer:
    """A grpc.aio coordinator server on the process's coordinator event loop (`_EventLoop`), with the
    blocking interface of a sync `grpc.Server` that its callers use: `start()`, `stop(grace)` returning
    a `threading.Event` set once stopped, `wait_for_termination(timeout)`."""

    def __init__(self, servicer: CoordinatorServicer, security: Security | None) -> None:
        self._loop = _EventLoop.get()
        self.servicer = servicer

        async def build() -> grpc.aio.Server:
            server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=aio_server_interceptors(security))
            handler = grpc.method_handlers_generic_handler(SERVICE, method_handlers(servicer))
            server.add_generic_rpc_handlers((handler,))
            return server

        self._server: grpc.aio.Server | None = self._run(build())
        self._stopped: threading.Event | None = None
        self._stop_lock = threading.Lock()

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def bind(self, address: str, security: Security | None) -> int:
        """Binds `address` (`_security.add_port`); the bound port, 0 if it could not bind."""

        async def bind() -> int:
            return int(add_port(self._server, address, security))

        return self._run(bind())

    def start(self) -> None:
        assert self._server is not None, "a stopped server does not start again"
        self._run(self._server.start())

    def stop(self, grace: float | None) -> threading.Event:
        """Stops serving (idempotent): with `grace` falsy, aborts every call and returns once the port is
        released (a restart may bind it at once); else calls get up to `grace` seconds to end, and the
        returned event is set once the server stopped."""
        with self._stop_lock:
            if self._stopped is None:
                stopped = self._stopped = threading.Event()
                fut = asyncio.run_coroutine_threadsafe(self._stop_and_free(grace or None), self._loop)
                fut.add_done_callback(lambda _: stopped.set())
            stopped = self._stopped
        if not grace:
            stopped.wait(10.0)
        return stopped

    async def _stop_and_free(self, grace: float | None) -> None:
        """Stops the server, then frees it here, on the loop's own thread, before anyone is told it
        stopped. gRPC's asyncio module shuts down when its last server or channel is freed: it takes
        its poller's socket off the loop and closes it. Freed by another thread (the caller's
        `server` going out of scope as `run_coordinator` returns), that raced this loop running the
        socket's reader (`PollerCompletionQueue._handle_events`), which then printed an
        `OSError: [Errno 9] Bad file descriptor` traceback as the process ended. On this thread no
        reader runs meanwhile, and a reader already scheduled is cancelled."""
        server = self._server
        try:
            if server is not None:
                await server.stop(grace)
        finally:
            self._server = None
            del server

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Blocks until the server stopped; False if `timeout` (s) passed first."""
        with self._stop_lock:
            stopped = self._stopped
        if stopped is not None:
            return stopped.wait(timeout)
        assert self._server is not None
        return not self._run(self._server.wait_for_termination(timeout))


def create_server(
    address: str,
    spec: JobSpec,
    lease_s: float = 60.0,
    startup_timeout_s: float = 600.0,
    security: Security | None = None,
    metrics: CoordinatorMetrics | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    resize: bool = False,
) -> tuple[CoordinatorServer, int, CoordinatorState]:
    """Builds (not starts) a coordinator server bound to `address` ("127.0.0.1:0" picks a free port).

    Returns (server, port, state): `server` is a `CoordinatorServer` (grpc.aio on the process's
    coordinator event loop; `start()`, `stop(grace)`), `state` its `CoordinatorState`.
    `state_dir` journals the job there (`coordinator.journal`) and resumes it from a journal left by a
    coordinator that was killed; a journal of another job raises `JournalError`.
    `security` (TLS / mutual TLS / bearer token, see `_security`); None serves plaintext without a token.
    `metrics` (a `CoordinatorMetrics`) is updated once per round; serve it with `start_metrics_server`.

    Raises:
        ValueError: `security` cannot serve (see `Security.server_credentials`).
        OSError: `address` cannot be bound.
    """
    state = CoordinatorState(
        spec, lease_s, startup_timeout_s, metrics=metrics, state_dir=state_dir, resize=resize
    )
    try:
        server = CoordinatorServer(CoordinatorServicer(state), security)
        port = server.bind(address, security)
    except BaseException:
        state.close()
        raise
    if port == 0:
        state.close()
        server.stop(0)
        raise OSError(f"coordinator could not bind {address}")
    return server, port, state
