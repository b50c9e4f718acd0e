"""TLS, mutual TLS and the shared bearer token on real gRPC servers with real certificates.

A module fixture writes a CA, a server certificate for 127.0.0.1/localhost (serverAuth + clientAuth: the
coordinator's and the rank services' identity), a trainer client certificate (clientAuth), and a rogue
CA with a certificate of its own, all made with `cryptography`. Every test talks to an in-process
coordinator (`create_server("127.0.0.1:0", ..., security=...)`) or a whole job over loopback.
"""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from _jobs import InProcessJob
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from batchd.client import BatchClient, BatchdError, ClientOptions
from batchd.core import CoordinatorError, JobSpec, PolicySpec
from batchd.proto import Security, channel
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc
from batchd.service import CoordinatorClient, create_server

TOKEN = "s3cret-batchd-token-0123456789"
SPEC = JobSpec(world_size=1, token_budget=1024, policy=PolicySpec(name="local", window=512, depth=8))


# -- a small PKI -------------------------------------------------------------------------------------
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: str, issuer: x509.Name, key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _make_ca(cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(cn, _name(cn), key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _make_leaf(ca, cn: str, server: bool):
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    usages = (
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        if server
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    builder = (
        _builder(cn, ca_cert.subject, key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return key, builder.sign(ca_key, hashes.SHA256())


def _write(d: Path, name: str, key, cert, password: bytes | None = None) -> tuple[str, str]:
    enc = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)
    (d / f"{name}.key").write_bytes(pem)
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(d / f"{name}.pem"), str(d / f"{name}.key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = _make_ca("batchd test CA"), _make_ca("rogue CA")
    paths = {"ca": _write(d, "ca", *ca)[0], "rogue_ca": _write(d, "rogue-ca", *rogue)[0]}
    paths["server"], paths["server_key"] = _write(d, "server", *_make_leaf(ca, "batchd-server", server=True))
    paths["client"], paths["client_key"] = _write(d, "client", *_make_leaf(ca, "trainer-0", server=False))
    paths["rogue"], paths["rogue_key"] = _write(d, "rogue", *_make_leaf(rogue, "intruder", server=True))
    leaf = _make_leaf(ca, "locked", server=False)
    paths["locked"], paths["locked_key"] = _write(d, "locked", *leaf, password=b"pw")
    token_file = d / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    paths["token_file"] = str(token_file)
    return paths


# -- helpers -----------------------------------------------------------------------------------------
@pytest.fixture
def coordinator():
    """coordinator(security) -> "127.0.0.1:port" of a started coordinator; stopped after the test."""
    started = []

    def start(security: Security | None) -> str:
        server, port, state = create_server("127.0.0.1:0", SPEC, security=security)
        server.start()
        started.append((server, state))
        return f"127.0.0.1:{port}"

    yield start
    for server, state in started:
        state.close()
        server.stop(0)


def _status(address: str, security: Security | None, metadata=None) -> tuple[grpc.StatusCode, str]:
    """One real Status RPC; (OK, state) or (code, details)."""
    with channel(address, security) as ch:
        try:
            reply = pb_grpc.CoordinatorStub(ch).Status(pb.StatusRequest(), timeout=5, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, reply.state


def _first_batch(client: BatchClient):
    """The client's first (batch, info); the iterator is closed here, not left to the garbage collector."""
    it = iter(client)
    try:
        return next(it)
    finally:
        it.close()


def _server(pki, **kw) -> Security:
    return Security(tls_cert=pki["server"], tls_key=pki["server_key"], **kw)


# -- validation --------------------------------------------------------------------------------------
def test_security_rejects_bad_arguments_naming_field_and_path(pki, tmp_path):
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        Security(tls_cert=pki["server"])
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        Security(tls_key=pki["server_key"])
    with pytest.raises(ValueError, match=r"client_auth .* needs tls_ca"):
        _server(pki, client_auth=True)
    with pytest.raises(ValueError, match=r"client_auth .* needs tls_ca"):
        Security(tls_ca=pki["ca"], client_auth=True)
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ValueError, match=rf"tls_ca='{missing}' cannot be read"):
        Security(tls_ca=missing)
    junk = tmp_path / "junk.pem"
    junk.write_text("hello\n")
    with pytest.raises(ValueError, match=rf"tls_cert='{junk}' is not a PEM certificate"):
        Security(tls_cert=str(junk), tls_key=pki["server_key"])
    with pytest.raises(ValueError, match=rf"tls_key='{pki['server']}' is not a PEM private key"):
        Security(tls_cert=pki["server"], tls_key=pki["server"])
    with pytest.raises(ValueError, match=rf"tls_key='{pki['client_key']}' is not a usable key for"):
        Security(tls_cert=pki["server"], tls_key=pki["client_key"])  # the key of another certificate
    with pytest.raises(ValueError, match=rf"tls_key='{pki['locked_key']}' is not a usable key"):
        Security(tls_cert=pki["locked"], tls_key=pki["locked_key"])  # encrypted
    with pytest.raises(ValueError, match=rf"tls_ca='{pki['server_key']}' is not a PEM certificate bundle"):
        Security(tls_ca=pki["server_key"])
    with pytest.raises(ValueError, match="client_auth must be a bool"):
        Security(tls_ca=pki["ca"], client_auth="yes")
    for bad in ("", "two words", "tab\there", "ünïcode"):
        with pytest.raises(ValueError, match="token") as info:
            Security(token=bad)
        assert bad == "" or bad not in str(info.value)  # the secret is never echoed
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=rf"token_file='{empty}' is empty"):
        Security.from_files(token_file=empty)
    with pytest.raises(ValueError, match="token_file=.* cannot be read"):
        Security.from_files(token_file=tmp_path / "absent")
    with pytest.raises(ValueError, match="options must be a ClientOptions"):
        BatchClient("127.0.0.1:1", 0, 1, security=Security(token=TOKEN), options=TOKEN)
    for bad, named in [(dict(credits=0), "credits=0"), (dict(startup_timeout_s=0), "startup_timeout_s=0")]:
        with pytest.raises(ValueError, match=named):
            ClientOptions(**bad)
    with pytest.raises(ValueError, match="serving TLS needs tls_cert and tls_key.* alone only makes a TLS"):
        create_server("127.0.0.1:0", SPEC, security=Security(tls_ca=pki["ca"]))


def test_from_files_reads_the_token_and_repr_hides_it(pki):
    sec = Security.from_files(
        pki["server"], pki["server_key"], pki["ca"], client_auth=True, token_file=pki["token_file"]
    )
    assert sec.token == TOKEN and sec.tls and sec.client_auth
    assert TOKEN not in repr(sec) and pki["server"] in repr(sec)
    assert sec.describe() == "mutual TLS + bearer token"
    assert Security().describe() == "plaintext" and not Security().tls
    assert Security(tls_ca=pki["ca"]).describe() == "TLS"


# -- bearer token ------------------------------------------------------------------------------------
def test_token_required_missing_or_wrong_is_unauthenticated(coordinator):
    address = coordinator(Security(token=TOKEN))
    code, details = _status(address, None)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "missing 'authorization: Bearer <token>'" in details
    code, details = _status(address, Security(token=TOKEN[:-1]))
    assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, "wrong bearer token")
    code, details = _status(address, None, metadata=[("authorization", f"Basic {TOKEN}")])
    assert code == grpc.StatusCode.UNAUTHENTICATED and "not of the form 'Bearer <token>'" in details
    assert TOKEN not in details
    twice = [("authorization", f"Bearer {TOKEN}")] * 2
    assert _status(address, None, metadata=twice)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert _status(address, Security(token=TOKEN)) == (grpc.StatusCode.OK, "running")
    # the case of the scheme does not matter, the token does
    assert _status(address, None, metadata=[("authorization", f"bearer {TOKEN}")])[0] == grpc.StatusCode.OK
    # a rank's coordinator client is refused at once (UNAUTHENTICATED is not retried like UNAVAILABLE)
    client = CoordinatorClient(address, 0, SPEC, startup_timeout_s=30, security=Security(token="not-it"))
    t0 = time.monotonic()
    with pytest.raises(CoordinatorError, match="Register from rank 0 failed: UNAUTHENTICATED") as info:
        client.register("127.0.0.1:1")
    client.close()
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() - t0 < 5


def test_call_on_a_closed_token_channel_raises_instead_of_crashing():
    """A rank service may report a failure on its coordinator channel while it shuts down. With
    `grpc.intercept_channel` (grpcio 1.85) that call segfaults the process; `BearerTokenChannel` must
    raise like a plain channel. Run in a child process so a regression cannot take pytest down."""
    code = (
        "from batchd.proto import batchd_pb2 as pb, batchd_pb2_grpc as pb_grpc\n"
        "from batchd.proto import Security, channel\n"
        "ch = channel('127.0.0.1:1', Security(token='abc'))\n"
        "stub = pb_grpc.CoordinatorStub(ch)\n"
        "ch.close()\n"
        "try:\n"
        "    stub.Fail(pb.FailRequest(rank=0, reason='x'), timeout=1)\n"
        "except ValueError as exc:\n"
        "    print('ValueError:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "ValueError: Cannot invoke RPC on closed channel" in out.stdout


def test_without_security_nothing_changes(coordinator):
    address = coordinator(None)
    assert _status(address, None) == (grpc.StatusCode.OK, "running")
    # a client's token is extra metadata that a server without one ignores
    assert _status(address, Security(token=TOKEN)) == (grpc.StatusCode.OK, "running")


# -- TLS ---------------------------------------------------------------------------------------------
def test_tls_plaintext_and_untrusting_clients_fail(coordinator, pki):
    address = coordinator(_server(pki))
    assert _status(address, Security(tls_ca=pki["ca"])) == (grpc.StatusCode.OK, "running")
    by_name = address.replace("127.0.0.1", "localhost")  # the DNS SAN works too
    assert _status(by_name, Security(tls_ca=pki["ca"])) == (grpc.StatusCode.OK, "running")
    code, _ = _status(address, None)  # plaintext HTTP/2 against a TLS port: the handshake never happens
    assert code == grpc.StatusCode.UNAVAILABLE
    code, details = _status(address, Security(tls_ca=pki["rogue_ca"]))
    assert code == grpc.StatusCode.UNAVAILABLE and "CERTIFICATE_VERIFY_FAILED" in details
    # a TLS client of a plaintext server fails too
    assert _status(coordinator(None), Security(tls_ca=pki["ca"]))[0] == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_certificate_from_the_ca(coordinator, pki):
    address = coordinator(_server(pki, tls_ca=pki["ca"], client_auth=True))
    good = Security(tls_cert=pki["client"], tls_key=pki["client_key"], tls_ca=pki["ca"], client_auth=True)
    assert _status(address, good) == (grpc.StatusCode.OK, "running")
    # No client certificate: grpcio's Python API can only require the certificate in the handshake
    # (see batchd.service._security), so the server closes the connection and the caller sees
    # UNAVAILABLE, not UNAUTHENTICATED; the RPC never reaches the service.
    code, details = _status(address, Security(tls_ca=pki["ca"]))
    assert code == grpc.StatusCode.UNAVAILABLE, details
    rogue = Security(tls_cert=pki["rogue"], tls_key=pki["rogue_key"], tls_ca=pki["ca"], client_auth=True)
    code, details = _status(address, rogue)  # a certificate that does not chain to the CA
    assert code == grpc.StatusCode.UNAVAILABLE, details
    # batchd's own clients retry UNAVAILABLE until their connect timeout, then name the coordinator
    client = CoordinatorClient(address, 0, SPEC, startup_timeout_s=1.0, security=rogue)
    with pytest.raises(CoordinatorError, match=f"coordinator at {address} unreachable for") as info:
        client.register("127.0.0.1:1")
    client.close()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_tls_and_token_together(coordinator, pki):
    address = coordinator(_server(pki, tls_ca=pki["ca"], client_auth=True, token=TOKEN))
    cert = dict(tls_cert=pki["client"], tls_key=pki["client_key"], tls_ca=pki["ca"], client_auth=True)
    code, details = _status(address, Security(**cert))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "missing" in details
    assert _status(address, Security(**cert, token="x" + TOKEN))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert _status(address, Security(**cert, token=TOKEN)) == (grpc.StatusCode.OK, "running")
    assert _status(address, Security(tls_ca=pki["ca"], token=TOKEN))[0] == grpc.StatusCode.UNAVAILABLE


# -- a whole job under mutual TLS + token ------------------------------------------------------------
def test_job_end_to_end_under_mutual_tls_and_token(pki):
    """Coordinator + 2 rank services (balanced: payloads move between ranks through peer `Fetch`) + 2
    trainers, every channel under mutual TLS + token: trainer->rank, rank->coordinator, rank->rank."""
    lengths = np.clip(np.random.default_rng(5).lognormal(4.0, 0.9, 120), 2, 900).astype(int).tolist()
    spec = JobSpec(
        world_size=2,
        token_budget=1024,
        seed=3,
        shuffle=False,
        policy=PolicySpec(name="balanced", window=16, depth=4),
    )  # unshuffled views: sample i's home rank is i % 2
    service = Security.from_files(
        pki["server"], pki["server_key"], pki["ca"], client_auth=True, token_file=pki["token_file"]
    )
    trainer = Security(
        tls_cert=pki["client"], tls_key=pki["client_key"], tls_ca=pki["ca"], client_auth=True, token=TOKEN
    )
    with InProcessJob(spec, lengths, security=service) as job:  # every service, channel and server
        # a trainer without the token, and one without a certificate, get nothing
        no_token = Security(
            tls_cert=pki["client"], tls_key=pki["client_key"], tls_ca=pki["ca"], client_auth=True
        )
        with (
            BatchClient(job.rank_address(0), 0, 2, security=no_token) as c,
            pytest.raises(BatchdError, match="UNAUTHENTICATED: missing 'authorization"),
        ):
            _first_batch(c)
        no_cert = Security(tls_ca=pki["ca"], token=TOKEN)
        with (
            BatchClient(
                job.rank_address(0), 0, 2, security=no_cert, options=ClientOptions(startup_timeout_s=0.5)
            ) as c,
            pytest.raises(BatchdError, match="unreachable for 0.5s: UNAVAILABLE"),
        ):
            _first_batch(c)

        results = job.drain(60, lambda b, info: (b["sample_ids"].tolist(), info), security=trainer)
        assert len(results[0]) == len(results[1]) > 0
        ids = sorted(i for res in results for step_ids, _ in res for i in step_ids)
        assert ids == list(range(len(lengths)))
        moved = [i for r, res in enumerate(results) for step_ids, _ in res for i in step_ids if i % 2 != r]
        assert moved, "balanced moved nothing, so the rank-to-rank Fetch path was not exercised"
        job.wait_state("done")
