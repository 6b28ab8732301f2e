"""Optional TLS for the ``socket`` transport between hosts: one certificate authority per job.

On a Ray cluster the servers listen on the node's address, so their traffic crosses the network. The HMAC
handshake (:mod:`scheduling.ps.transport.auth`) proves that both ends hold the job's secret, but the frames
that follow travel in clear. With ``[cluster] tls = true`` every connection is wrapped in TLS 1.3 with mutual
certificates:

- :func:`job_credentials` makes a fresh certificate authority for the job (an ECDSA P-256 key and a
  self-signed certificate), signs one leaf certificate with it, and throws the authority's key away: no later
  certificate can be signed, so the job's members are exactly the holders of :class:`TLSCredentials`
  (handed to them through Ray, like the job's secret);
- :func:`server_context` and :func:`client_context` build ``ssl.SSLContext`` objects that accept only a peer
  whose certificate that authority signed (``CERT_REQUIRED`` both ways). Host names are not checked: the job
  authority signs nothing else, and servers are reached by address.

The wire (:mod:`scheduling.ps.transport.socket_wire`) writes and reads a TLS socket without ``sendmsg`` or
``recvmsg_into``, which ``ssl.SSLSocket`` lacks; the cost is measured by ``benchmarks/tls.py``.

Source: Python ``ssl`` (``SSLContext``, ``load_verify_locations(cadata=...)``, ``TLSVersion``); the
``cryptography`` package's X.509 builder (``x509.CertificateBuilder``); RFC 8446 (TLS 1.3).
"""

from __future__ import annotations

import datetime
import os
import socket
import ssl
import tempfile
from dataclasses import dataclass

__all__ = ["TLSCredentials", "job_credentials", "server_context", "client_context", "wrap_server", "wrap_client",
           "set_job_tls", "job_tls"]

VALID_DAYS = 30
"""How long a job's certificates are valid (a job longer than this needs new credentials)."""


@dataclass(frozen=True)
class TLSCredentials:
    """What a job member needs for TLS: the job authority's certificate and the member certificate and key
    (PEM bytes). Picklable, so Ray hands it to server actors and trainers."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes


def job_credentials(common_name: str = "fxdist-job") -> TLSCredentials:
    """A new authority for one job and the one certificate it signs; the authority's key is dropped.

    Raises:
        ImportError: the ``cryptography`` package is missing (``pip install cryptography``).
    """
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as e:   # pragma: no cover - the lock file installs it
        raise ImportError("TLS for the socket transport needs the 'cryptography' package") from e
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{common_name} authority")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False, key_agreement=False,
                                            key_cert_sign=True, crl_sign=True, encipher_only=False,
                                            decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return TLSCredentials(
        ca_pem=ca_cert.public_bytes(pem), cert_pem=cert.public_bytes(pem),
        key_pem=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


_JOB_TLS: TLSCredentials | None = None
_CONTEXTS: dict[tuple[TLSCredentials, bool], ssl.SSLContext] = {}


def set_job_tls(creds: TLSCredentials | None) -> None:
    """Make ``creds`` this process's TLS credentials (None: no TLS): the socket servers it starts afterwards and
    its clients' new connections use them. A job's trainers get them from the launcher, through Ray."""
    global _JOB_TLS
    _JOB_TLS = creds


def job_tls() -> TLSCredentials | None:
    """This process's TLS credentials (:func:`set_job_tls`), or None when its connections are plain TCP."""
    return _JOB_TLS


def _cached(creds: TLSCredentials, server: bool) -> ssl.SSLContext:
    """One context per credentials and side (building one writes and reads its key: not per connection)."""
    key = (creds, server)   # by value: an id() could be reused by other credentials once these are gone
    ctx = _CONTEXTS.get(key)
    if ctx is None:
        ctx = _CONTEXTS[key] = server_context(creds) if server else client_context(creds)
    return ctx


def _context(purpose: ssl.Purpose, creds: TLSCredentials) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = False
    ctx.load_verify_locations(cadata=creds.ca_pem.decode())
    # load_cert_chain reads files only: a private folder, removed at once (the key never stays on disk)
    with tempfile.TemporaryDirectory(prefix="fxdist-tls-") as d:
        cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        for path, data in ((cert, creds.cert_pem), (key, creds.key_pem)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert, key)
    return ctx


def server_context(creds: TLSCredentials) -> ssl.SSLContext:
    """A server's context: TLS 1.3, its job certificate, clients must show one the job authority signed.

    Raises:
        ssl.SSLError: the credentials do not load (not PEM, or key and certificate do not match).
    """
    return _context(ssl.Purpose.CLIENT_AUTH, creds)


def client_context(creds: TLSCredentials) -> ssl.SSLContext:
    """A client's context: TLS 1.3, its job certificate, the server must show one the job authority signed.

    Raises:
        ssl.SSLError: the credentials do not load (not PEM, or key and certificate do not match).
    """
    return _context(ssl.Purpose.SERVER_AUTH, creds)


def wrap_server(sock: socket.socket, ctx: ssl.SSLContext | TLSCredentials, timeout_s: float) -> ssl.SSLSocket:
    """``sock`` (an accepted ``socket.socket``) wrapped with ``ctx`` (a context, or credentials whose server
    context is built once and kept) and its TLS handshake done within ``timeout_s``;
    the socket is left blocking, with no timeout, as the transport's reader threads expect.

    Raises:
        ssl.SSLError: the peer's certificate is not the job's, or the handshake failed;
        OSError: the connection failed or timed out (``TimeoutError``).
    """
    return _wrap(ctx if isinstance(ctx, ssl.SSLContext) else _cached(ctx, True), sock, timeout_s, server_side=True)


def wrap_client(sock: socket.socket, ctx: ssl.SSLContext | TLSCredentials, timeout_s: float) -> ssl.SSLSocket:
    """``sock`` (a connected ``socket.socket``) wrapped as a TLS client with ``ctx`` (a context, or credentials),
    handshake done within ``timeout_s``.

    Raises:
        ssl.SSLError: the server's certificate is not the job's, or the handshake failed;
        OSError: the connection failed or timed out (``TimeoutError``).
    """
    return _wrap(ctx if isinstance(ctx, ssl.SSLContext) else _cached(ctx, False), sock, timeout_s,
                 server_side=False)


def _wrap(ctx: ssl.SSLContext, sock: socket.socket, timeout_s: float, *, server_side: bool) -> ssl.SSLSocket:
    previous = sock.gettimeout()
    sock.settimeout(timeout_s)
    wrapped = ctx.wrap_socket(sock, server_side=server_side, do_handshake_on_connect=False)
    try:
        wrapped.do_handshake()
    except BaseException:
        wrapped.close()
        raise
    wrapped.settimeout(previous)
    return wrapped
