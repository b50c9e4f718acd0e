"""The transport every batchd gRPC party shares: channel options, TLS, mutual TLS, a shared bearer token,
and which call failures are worth retrying (`transient`).

The server side of the security policy (the token interceptor, binding a secure port) lives in
`batchd.service`; everything a client needs is here, so the trainer library needs nothing from the
service.

One `Security` object per process describes how that process talks and listens. The coordinator is
only a server; a rank service is a server (to its trainer and to peer rank services that `Fetch`
lent payloads) and a client (of the coordinator and of its peers) and uses the same object for both;
the trainer's `BatchClient` is only a client. `None` everywhere means what batchd always did:
plaintext, no token (the entry points bind 127.0.0.1 unless told otherwise).

    sec = Security.from_files(tls_cert="rank.pem", tls_key="rank.key", tls_ca="ca.pem",
                              client_auth=True, token_file="token")
    server = grpc.server(pool, interceptors=server_interceptors(sec))
    port = add_port(server, "0.0.0.0:7100", sec)        # secure port iff TLS
    ch = channel("coord:7000", sec)                      # secure channel iff TLS, token on every call

What each setting does:

- `tls_cert` + `tls_key`: a server serves TLS with this certificate; with `client_auth` a client
  presents it as its client certificate. A process that is both (a rank service) therefore needs a
  certificate valid for both uses: SANs naming the address its peers dial, and either no extended key
  usage or both serverAuth and clientAuth.
- `tls_ca`: the CA bundle a client verifies the server against (without it a TLS client uses gRPC's
  built-in public roots) and, with `client_auth`, the CA a server verifies client certificates against.
  TLS is on when either a certificate or a CA is given; a process whose `Security` has a CA but no
  certificate can be a TLS client but refuses to serve (`add_port` raises rather than listen in
  plaintext while its clients expect TLS).
- `client_auth`: mutual TLS. The server requires a client certificate that chains to `tls_ca`.
- `token`: a shared bearer token. Servers refuse any call without `authorization: Bearer <token>`
  metadata with UNAUTHENTICATED (the message says what was missing or wrong and never contains a
  token); clients attach it to every call's metadata (`BearerTokenChannel` wraps the channel's
  multi-callables), so it works over plaintext as well as TLS. The server hashes both tokens and
  compares the digests in constant time.

What a refused caller sees, measured with grpcio 1.85 and real certificates (tests/test_security.py):

- no token, malformed header, wrong token: UNAUTHENTICATED, from the server interceptor.
- plaintext caller of a TLS server: UNAVAILABLE ("... Socket closed"); the server logs
  WRONG_VERSION_NUMBER.
- TLS caller that does not trust the server's CA: UNAVAILABLE ("... Tls handshake failed
  (TSI_PROTOCOL_FAILURE) ... CERTIFICATE_VERIFY_FAILED ...").
- mutual TLS, caller without a certificate or with one from another CA: UNAVAILABLE ("... Socket
  closed"); the server logs PEER_DID_NOT_RETURN_A_CERTIFICATE or CERTIFICATE_VERIFY_FAILED. It cannot
  be UNAUTHENTICATED with grpcio's Python API: `ssl_server_credentials` and
  `dynamic_ssl_server_credentials` map `require_client_auth` to either
  GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY or GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
  (grpc/_cython/_cygrpc/credentials.pyx.pxi); the "request but do not require" modes that would let a
  certificate-less caller reach an interceptor, which could then answer UNAUTHENTICATED, are not
  exposed. Without the request the server never sees a client certificate at all, so checking
  `context.peer_identities()` would have nothing to check. The refusal therefore happens in the
  handshake, before any RPC exists, and batchd's own clients retry UNAVAILABLE until their connect /
  reconnect timeouts before they report the peer unreachable.

Trade-offs: the token is one shared secret (no per-party identity, no expiry, rotation means a
restart of every party); certificates and keys are read when credentials are built (at startup),
so rotating them also needs a restart; server names are checked against the address dialled (pass
`("grpc.ssl_target_name_override", name)` in `options` when they differ).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import ssl
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger("batchd.transport")

AUTH_HEADER = "authorization"
_SCHEME = "bearer"
_CERT_MARK = b"-----BEGIN CERTIFICATE-----"
_KEY_MARK = b"PRIVATE KEY-----"


def _read(field: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{field}={path!r} cannot be read: {exc.strerror or exc}") from None


def _check_pem(field: str, path: str, mark: bytes, what: str) -> None:
    if mark not in _read(field, path):
        raise ValueError(f"{field}={path!r} is not a PEM {what} (no '{mark.decode().strip('-')}' block)")


def _no_password() -> bytes:
    raise ValueError("encrypted private keys are not supported")


def check_token(token: str, field: str = "token") -> None:
    # The value itself never goes into a message: it is a secret.
    if not isinstance(token, str) or not token:
        raise ValueError(
            f"{field} must be a non-empty string, got a {type(token).__name__} of length "
            f"{len(token) if hasattr(token, '__len__') else 'n/a'}"
        )
    bad = sorted({i for i, ch in enumerate(token) if not 0x21 <= ord(ch) <= 0x7E})
    if bad:
        raise ValueError(
            f"{field} may only hold visible ASCII characters (no spaces or newlines); "
            f"character(s) at position(s) {bad[:5]} of {len(token)} are not"
        )


@dataclasses.dataclass(frozen=True)
class Security:
    """How one process secures its gRPC servers and channels (see module docstring).

    Args:
        tls_cert: PEM certificate (chain) of this process: served by its servers, presented as the client
            certificate by its channels when `client_auth`.
        tls_key: PEM private key of `tls_cert` (unencrypted).
        tls_ca: PEM CA bundle: verifies servers (clients) and, with `client_auth`, client certificates
            (servers).
        client_auth: Mutual TLS: servers require a client certificate chaining to `tls_ca`; clients
            present `tls_cert`.
        token: Shared bearer token required by servers and sent by clients (never shown in `repr`).

    Raises:
        ValueError: `tls_cert` without `tls_key` or the reverse, `client_auth` without `tls_ca` and a
            certificate, a file that cannot be read or is not the PEM it should be, a key that does not
            match its certificate, or a token that is empty or not visible ASCII.
    """

    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    client_auth: bool = False
    token: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("tls_cert", "tls_key", "tls_ca"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
            elif not (value is None or (isinstance(value, str) and value)):
                raise ValueError(f"{name} must be a file path or None, got {name}={value!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                f"tls_cert and tls_key go together, got tls_cert={self.tls_cert!r} tls_key={self.tls_key!r}"
            )
        if not isinstance(self.client_auth, bool):
            raise ValueError(f"client_auth must be a bool, got client_auth={self.client_auth!r}")
        if self.client_auth and (self.tls_ca is None or self.tls_cert is None):
            raise ValueError(
                f"client_auth (mutual TLS) needs tls_ca and tls_cert/tls_key, got "
                f"tls_ca={self.tls_ca!r} tls_cert={self.tls_cert!r}"
            )
        if self.token is not None:
            check_token(self.token)
        if self.tls_ca is not None:
            _check_pem("tls_ca", self.tls_ca, _CERT_MARK, "certificate bundle")
            try:
                ssl.create_default_context(cafile=self.tls_ca)
            except (ssl.SSLError, ValueError) as exc:
                raise ValueError(f"tls_ca={self.tls_ca!r} holds no usable CA certificate: {exc}") from None
        if self.tls_cert is not None:
            _check_pem("tls_cert", self.tls_cert, _CERT_MARK, "certificate")
            _check_pem("tls_key", self.tls_key, _KEY_MARK, "private key")
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(
                    self.tls_cert, self.tls_key, password=_no_password
                )
            except (ssl.SSLError, ValueError) as exc:
                raise ValueError(
                    f"tls_key={self.tls_key!r} is not a usable key for tls_cert={self.tls_cert!r}: {exc}"
                ) from None

    @classmethod
    def from_files(
        cls,
        tls_cert: str | os.PathLike | None = None,
        tls_key: str | os.PathLike | None = None,
        tls_ca: str | os.PathLike | None = None,
        client_auth: bool = False,
        token_file: str | os.PathLike | None = None,
    ) -> Security:
        """A `Security` whose token is read from `token_file` (surrounding whitespace stripped).

        Logs a warning when the token file is readable by group or others.

        Raises:
            ValueError: as the constructor, or `token_file` unreadable or empty.
        """
        token = None
        if token_file is not None:
            path = os.fspath(token_file)
            token = _read("token_file", path).decode("utf-8", errors="replace").strip()
            if not token:
                raise ValueError(f"token_file={path!r} is empty")
            check_token(token, field=f"the token in token_file={path!r}")
            if stat.S_IMODE(os.stat(path).st_mode) & 0o077:
                log.warning(
                    "token file %s is readable by group/others (mode %o); chmod 600 it",
                    path,
                    stat.S_IMODE(os.stat(path).st_mode),
                )
        return cls(tls_cert, tls_key, tls_ca, client_auth, token)

    # -- what it turns on ----------------------------------------------------------------------------
    @property
    def tls(self) -> bool:
        """True when this process speaks TLS (a certificate or a CA is configured)."""
        return self.tls_cert is not None or self.tls_ca is not None

    def describe(self) -> str:
        """A one-line summary for logs ("mutual TLS + bearer token", "plaintext", ...); no secrets."""
        parts = ["mutual TLS" if self.client_auth else ("TLS" if self.tls else "plaintext")]
        if self.token is not None:
            parts.append("bearer token")
        return " + ".join(parts)

    # -- credentials ---------------------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials:
        """TLS server credentials (client certificates required and verified when `client_auth`).

        Raises:
            ValueError: no `tls_cert`/`tls_key` (a server cannot serve TLS without them).
        """
        if self.tls_cert is None or self.tls_key is None:
            raise ValueError(
                f"serving TLS needs tls_cert and tls_key, got tls_cert={self.tls_cert!r} "
                f"tls_key={self.tls_key!r} (tls_ca={self.tls_ca!r} alone only makes a TLS "
                f"client)"
            )
        pair = (_read("tls_key", self.tls_key), _read("tls_cert", self.tls_cert))
        ca = _read("tls_ca", self.tls_ca) if self.client_auth else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=self.client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS channel credentials: trust `tls_ca` (gRPC's public roots when None), present `tls_cert`
        as the client certificate when `client_auth`."""
        ca = _read("tls_ca", self.tls_ca) if self.tls_ca is not None else None
        if self.client_auth:
            key, cert = _read("tls_key", self.tls_key), _read("tls_cert", self.tls_cert)
            return grpc.ssl_channel_credentials(ca, key, cert)
        return grpc.ssl_channel_credentials(ca)


MAX_MESSAGE_BYTES = 64 << 20
KEEPALIVE_MS = 10_000  # every connection between batchd parties is pinged when idle this long
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # A peer that vanished without closing its connection (a host gone, a partition) is found by keepalive
    # pings within ~2 x KEEPALIVE_MS, so a call waiting on it (a barrier, a batch stream) ends instead of
    # hanging; servers accept such pings (gRPC's default would answer them with GOAWAY too_many_pings).
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]
# Channels between batchd parties retry a refused connection at least every second. gRPC's default
# backoff (1 s, x1.6 per failure, up to 120 s) makes a party that starts 20 s before its peer connect
# ~6 s after the peer is up, and one that started earlier miss its whole connect timeout.
CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def transient(exc: grpc.RpcError) -> bool:
    """A call that failed because its peer is (for now) unreachable or stopping (its server cancelled the
    call: a restart): worth retrying. batchd's own calls between parties are never cancelled by the caller
    except when it closes, which ends the retries."""
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return True
    details = exc.details() or ""
    return code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and (
        "Stream removed" in details or "Socket closed" in details
    )


WAIT_LOG_S = 5.0  # how often a party that waits for an unreachable peer says so


class Unreachable(Exception):
    """`retry_while_unreachable` gave up: the peer stayed unreachable for `elapsed_s`.

    `error` is the last failure."""

    def __init__(self, error: grpc.RpcError, elapsed_s: float) -> None:
        super().__init__(error.details() or error.code().name)
        self.error, self.elapsed_s = error, elapsed_s


def retry_while_unreachable(
    call: Callable[[], Any],
    retry_s: float,
    waiting_for: str,
    stop: Any = None,
    on_retry: Callable[[], None] | None = None,
    logger: logging.Logger = log,
    period_s: float = 0.2,
) -> Any:
    """Returns `call()`, retrying it while it fails `transient`ly, for up to `retry_s` seconds.

    Every `WAIT_LOG_S` the wait is logged as "waiting for <waiting_for> (Ns of Ms): <details>";
    `on_retry` runs before each retry (e.g. to ask for a restarted peer's new address); `stop` (a
    threading.Event) ends the retries early. Raises `Unreachable` when the time is up (or `stop` is
    set) and the last failure was transient; a non-transient `grpc.RpcError` propagates at once.
    Liveness, not speed: the time bound is how long a peer may be *gone*, never how long a call takes.
    """
    start = last_log = time.monotonic()
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            if not transient(exc):
                raise
            now = time.monotonic()
            if now - start >= retry_s or (stop is not None and stop.is_set()):
                raise Unreachable(exc, now - start) from None
            if now - last_log >= WAIT_LOG_S:
                logger.info(
                    "waiting for %s (%.0fs of %gs): %s", waiting_for, now - start, retry_s, exc.details()
                )
                last_log = now
            if on_retry is not None:
                on_retry()
            if stop is not None:
                stop.wait(period_s)
            else:
                time.sleep(period_s)


# -- client side ---------------------------------------------------------------------------------------
class _WithToken:
    """A multi-callable that adds the bearer token to the call's metadata, then calls the wrapped one.

    Wraps a multi-callable that the stub created from the real channel when it was built, so a call
    after `close()` fails like one on a plain channel (ValueError). `grpc.intercept_channel` is not used:
    its multi-callables create the real one on every call, and with grpcio 1.85 doing that on a closed
    channel crashes the process (SIGSEGV in `_get_registered_call_handle`): a rank service whose loop
    reports a failure while it shuts down would take the process with it.
    """

    def __init__(self, inner: Any, entry: tuple[str, str]) -> None:
        self._inner, self._entry = inner, entry

    def _metadata(self, metadata: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
        return [(k, v) for k, v in (metadata or ()) if k.lower() != AUTH_HEADER] + [self._entry]

    def _invoke(
        self,
        fn: Callable,
        request: Any,
        timeout: float | None,
        metadata,
        credentials,
        wait_for_ready,
        compression,
    ) -> Any:
        return fn(
            request,
            timeout=timeout,
            metadata=self._metadata(metadata),
            credentials=credentials,
            wait_for_ready=wait_for_ready,
            compression=compression,
        )

    def __call__(
        self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None, compression=None
    ):
        return self._invoke(self._inner, request, timeout, metadata, credentials, wait_for_ready, compression)

    def with_call(
        self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None, compression=None
    ):
        return self._invoke(
            self._inner.with_call, request, timeout, metadata, credentials, wait_for_ready, compression
        )

    def future(
        self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None, compression=None
    ):
        return self._invoke(
            self._inner.future, request, timeout, metadata, credentials, wait_for_ready, compression
        )


class BearerTokenChannel(grpc.Channel):
    """A channel that sends `authorization: Bearer <token>` with every call (all four call kinds)."""

    def __init__(self, channel: grpc.Channel, token: str) -> None:
        check_token(token)
        self._channel = channel
        self._entry = (AUTH_HEADER, f"Bearer {token}")

    def subscribe(self, callback, try_to_connect=False):
        self._channel.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback):
        self._channel.unsubscribe(callback)

    def unary_unary(self, method, request_serializer=None, response_deserializer=None, **kwargs):
        inner = self._channel.unary_unary(method, request_serializer, response_deserializer, **kwargs)
        return _WithToken(inner, self._entry)

    def unary_stream(self, method, request_serializer=None, response_deserializer=None, **kwargs):
        inner = self._channel.unary_stream(method, request_serializer, response_deserializer, **kwargs)
        return _WithToken(inner, self._entry)

    def stream_unary(self, method, request_serializer=None, response_deserializer=None, **kwargs):
        inner = self._channel.stream_unary(method, request_serializer, response_deserializer, **kwargs)
        return _WithToken(inner, self._entry)

    def stream_stream(self, method, request_serializer=None, response_deserializer=None, **kwargs):
        inner = self._channel.stream_stream(method, request_serializer, response_deserializer, **kwargs)
        return _WithToken(inner, self._entry)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> BearerTokenChannel:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False


def channel(
    address: str,
    security: Security | None,
    options: Sequence[tuple[str, Any]] | None = None,
) -> grpc.Channel:
    """A channel to `address` as `security` says: TLS iff `security.tls` (client certificate iff
    `client_auth`), the bearer token on every call iff `security.token`; plaintext when None."""
    opts = list(options or ())
    if security is None or not security.tls:
        base = grpc.insecure_channel(address, options=opts)
    else:
        base = grpc.secure_channel(address, security.channel_credentials(), options=opts)
    if security is None or security.token is None:
        return base
    return BearerTokenChannel(base, security.token)
