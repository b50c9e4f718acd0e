"""The server side of batchd's security policy: the bearer-token interceptor and binding a TLS port.

`Security` (what a process presents and trusts) and the client side (`channel`) live in
`batchd.proto` (see its `_transport` module's docstring for what each setting does and what a refused
caller sees).

    server = grpc.server(pool, interceptors=server_interceptors(sec))
    port = add_port(server, "0.0.0.0:7100", sec)        # secure port iff TLS

    server = grpc.aio.server(interceptors=aio_server_interceptors(sec))   # the same for grpc.aio
    port = add_port(server, "0.0.0.0:7100", sec)
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from batchd.proto import AUTH_HEADER, Security, check_token

log = logging.getLogger("batchd.security")
_SCHEME = "bearer"


# -- server side ---------------------------------------------------------------------------------------
def _abort_handler(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that refuses the call with UNAUTHENTICATED.

    No request deserializer: a refused caller's message is never parsed."""

    def refuse(request_or_iterator: Any, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    req = handler is not None and handler.request_streaming
    resp = handler is not None and handler.response_streaming
    if req and resp:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if req:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if resp:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class BearerTokenInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc has no stubs
    """Refuses every call that lacks `authorization: Bearer <token>` metadata with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        check_token(token)
        self._digest = hashlib.sha256(token.encode("ascii")).digest()

    def check(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """None when `metadata` carries the right token, else why not (without any token in it)."""
        values = [v for k, v in (metadata or ()) if k.lower() == AUTH_HEADER]
        if not values:
            return (
                f"missing '{AUTH_HEADER}: Bearer <token>' metadata: this batchd service requires the "
                f"shared bearer token"
            )
        if len(values) > 1:
            return f"{len(values)} '{AUTH_HEADER}' metadata entries; send exactly one"
        value = values[0].decode("latin-1") if isinstance(values[0], bytes) else values[0]
        scheme, _, presented = value.strip().partition(" ")
        if scheme.lower() != _SCHEME or not presented.strip():
            return f"'{AUTH_HEADER}' metadata is not of the form 'Bearer <token>'"
        got = hashlib.sha256(presented.strip().encode("utf-8", errors="replace")).digest()
        if not hmac.compare_digest(got, self._digest):
            return "wrong bearer token"
        return None

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        problem = self.check(handler_call_details.invocation_metadata)
        if problem is None:
            return continuation(handler_call_details)
        log.warning("refused %s: %s", handler_call_details.method, problem)
        return _abort_handler(continuation(handler_call_details), problem)


def _aio_abort_handler(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """`_abort_handler` for a grpc.aio server: an async handler of `handler`'s streaming kind that
    refuses the call with UNAUTHENTICATED, without parsing the caller's message."""

    async def refuse(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    req = handler is not None and handler.request_streaming
    resp = handler is not None and handler.response_streaming
    if req and resp:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if req:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if resp:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class AioBearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc: no stubs
    """`BearerTokenInterceptor` for a grpc.aio server (same check, same refusal)."""

    def __init__(self, token: str) -> None:
        self._check = BearerTokenInterceptor(token)

    async def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        problem = self._check.check(handler_call_details.invocation_metadata)
        if problem is None:
            return await continuation(handler_call_details)
        log.warning("refused %s: %s", handler_call_details.method, problem)
        return _aio_abort_handler(await continuation(handler_call_details), problem)


def server_interceptors(security: Security | None) -> list[grpc.ServerInterceptor]:
    """The interceptors a server built for `security` needs (pass to `grpc.server(..., interceptors=)`)."""
    if security is None or security.token is None:
        return []
    return [BearerTokenInterceptor(security.token)]


def aio_server_interceptors(security: Security | None) -> list[grpc.aio.ServerInterceptor]:
    """`server_interceptors` for a grpc.aio server (pass to `grpc.aio.server(interceptors=)`)."""
    if security is None or security.token is None:
        return []
    return [AioBearerTokenInterceptor(security.token)]


def add_port(server: grpc.Server | grpc.aio.Server, address: str, security: Security | None) -> int:
    """Binds `address` on `server` (sync or grpc.aio): a secure port when `security.tls`, else an
    insecure one.

    Returns:
        The bound port (0 means gRPC could not bind; callers raise; a grpc.aio server that cannot bind
        returns 0 too here, where grpc.aio itself would raise RuntimeError).

    Raises:
        ValueError: `security` has a CA but no certificate (see `Security.server_credentials`).
    """
    credentials = security.server_credentials() if security is not None and security.tls else None
    try:
        if credentials is None:
            return int(server.add_insecure_port(address))
        return int(server.add_secure_port(address, credentials))
    except RuntimeError as exc:  # grpc.aio: "Failed to bind to address ..."
        if isinstance(server, grpc.aio.Server):
            log.debug("%s", exc)
            return 0
        raise
