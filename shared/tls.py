"""TLS for the connections that can leave the host: a small CA, per-service certificates, and the ssl contexts.

`TlsMaterial(directory).ensure(services, hosts)` makes (once) a CA (`ca.pem`, `ca.key`) and a certificate per
service (`<service>.pem`, `<service>.key`) signed by it, for the given host names and addresses; keys are 0600 in
a 0700 directory. An operator may bring their own files instead: every context here is built from file paths.

`server_context` serves with a certificate and its key; `client_context` verifies the server against one CA file
(never the system's), its host name included, and may present a client certificate. Both speak TLS 1.2 or later.
A server context follows its files (certificate rotation, `_Rotation`): each new connection's handshake looks at
them (inode, size, modification time), and when they changed it serves the new pair from then on; connections
already up keep theirs. A changed pair that cannot serve (unreadable, not PEM, a key that is not the
certificate's or that others can read) leaves the last good one in service, logged with why once per change.
`describe_tls_error` says in words why a handshake failed (another CA, a plaintext peer, a wrong host name).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvmesh.shared.errors import ConfigError

log = logging.getLogger(__name__)

CA_VALID_DAYS = 3650
CERT_VALID_DAYS = 825  # the longest leaf lifetime common clients accept
# The services `kvmesh credentials --tls` and `kvmesh up` make certificates for ("redis": a Redis / Valkey remote
# tier's server, compose's cluster profile).
SERVICES = ("nats", "controller", "remote-store", "engine", "pd-proxy", "redis")
TLS_DIR = "tls"  # their folder in a credentials directory


@dataclass(frozen=True)
class TlsFiles:
    """Where one endpoint's TLS material lives: the CA its peers are checked against, and its own certificate and
    key (both None for a client that presents none)."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None


def default_hosts() -> list[str]:
    """Names a certificate of this host covers unless told otherwise: loopback and the host's own name."""
    return sorted({"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()})


class TlsMaterial:
    """A directory of TLS material made here: one CA and one certificate per service (see the module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self.root = Path(directory)

    @property
    def ca(self) -> Path:
        return self.root / "ca.pem"

    def files(self, service: str) -> TlsFiles:
        """The CA and `service`'s certificate and key (they may not exist yet: `ensure`)."""
        return TlsFiles(self.ca, self.root / f"{service}.pem", self.root / f"{service}.key")

    def ensure(self, services: Iterable[str] = SERVICES, hosts: Iterable[str] | None = None) -> dict[str, TlsFiles]:
        """Make the CA if missing, and a certificate for every service that has none, naming `hosts` (default:
        `default_hosts()`). Existing files are kept, so clients keep trusting the CA across runs."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        names = list(dict.fromkeys(hosts if hosts is not None else default_hosts()))  # each name once
        if not self.ca.exists():
            ca_key = ec.generate_private_key(ec.SECP256R1())
            _write(self.root / "ca.key", _key_pem(ca_key), private=True)
            _write(self.ca, _ca_certificate(ca_key).public_bytes(serialization.Encoding.PEM), private=False)
        ca_key = _load_key(self.root / "ca.key")
        ca_cert = x509.load_pem_x509_certificate(self.ca.read_bytes())
        made = {}
        for service in services:
            files = self.files(service)
            assert files.cert is not None and files.key is not None
            if not files.cert.exists() or not files.key.exists():
                key = ec.generate_private_key(ec.SECP256R1())
                _write(files.key, _key_pem(key), private=True)
                cert = _leaf_certificate(service, key, ca_key, ca_cert, names)
                _write(files.cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
            made[service] = files
        return made


def server_context(cert: str | Path, key: str | Path, ca: str | Path | None = None) -> ssl.SSLContext:
    """A server's context: it presents `cert` (with `key`), read again when they change (the module docstring);
    with `ca`, clients that present a certificate are checked against it (none is required). TLS 1.2+.
    ConfigError naming the file that cannot be used."""
    context = _fixed_server_context(cert, key, ca)
    context.sni_callback = _Rotation(Path(cert), Path(key), ca, context).pick
    return context


class _Rotation:
    """The certificate and key files behind a server context, looked at as each connection's handshake starts
    (OpenSSL's server-name callback, called with or without a name): when they changed, the connection and those
    after it are served from a context of the new pair; a pair that fails keeps the last good one."""

    def __init__(self, cert: Path, key: Path, ca: str | Path | None, context: ssl.SSLContext) -> None:
        self.cert, self.key, self.ca = cert, key, ca
        self.current = context
        self.seen = self._stamp()

    def _stamp(self) -> tuple[tuple[int, int, int] | None, ...]:
        stamps: list[tuple[int, int, int] | None] = []
        for path in (self.cert, self.key):
            try:
                st = path.stat()  # through a symbolic link: a link switched to new files counts as a change
                stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                stamps.append(None)
        return tuple(stamps)

    def pick(self, connection: ssl.SSLObject | ssl.SSLSocket, server_name: str | None,
             context: ssl.SSLContext) -> None:
        try:
            stamp = self._stamp()
            if stamp != self.seen:
                self.seen = stamp  # tried once per change: a bad pair is not read again at every connection
                try:
                    self.current = _fixed_server_context(self.cert, self.key, self.ca)
                    log.info("TLS certificate %s changed: new connections get it (those up keep theirs)", self.cert)
                except (ConfigError, OSError, ssl.SSLError) as exc:
                    log.warning("TLS certificate %s or its key %s changed but cannot serve (%s): new connections "
                                "keep getting the certificate loaded before", self.cert, self.key, exc)
            if self.current is not context:
                connection.context = self.current
        except Exception:  # never fail a handshake over this: it goes on with the context it has
            log.exception("TLS certificate %s: looking for a new one failed", self.cert)


def _fixed_server_context(cert: str | Path, key: str | Path, ca: str | Path | None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _check_key(Path(key))
    try:
        context.load_cert_chain(str(_readable(cert, "certificate")), str(key))
    except ssl.SSLError as exc:
        raise ConfigError(f"TLS certificate {cert} with key {key}: {exc}") from None
    if ca is not None:
        context.load_verify_locations(cafile=str(_readable(ca, "CA file")))
        context.verify_mode = ssl.CERT_OPTIONAL
    return context


def client_context(ca: str | Path, cert: str | Path | None = None, key: str | Path | None = None) -> ssl.SSLContext:
    """A client's context: it trusts only the CA in `ca` and checks the server's host name; with `cert` and `key`
    it presents that certificate. TLS 1.2+. ConfigError naming the file that cannot be used."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_verify_locations(cafile=str(_readable(ca, "CA file")))
    except ssl.SSLError as exc:
        raise ConfigError(f"TLS CA file {ca}: not a PEM certificate ({exc})") from None
    if cert is not None or key is not None:
        if cert is None or key is None:
            raise ConfigError("a TLS client certificate needs both its certificate and its key file")
        _check_key(Path(key))
        context.load_cert_chain(str(_readable(cert, "certificate")), str(key))
    return context


def client_context_of(ca: str | Path | None, option: str) -> ssl.SSLContext | None:
    """`client_context(ca)` for the option or key named `option` (None when it is unset); a ConfigError names it."""
    if not ca:
        return None
    try:
        return client_context(ca)
    except ConfigError as exc:
        raise ConfigError(f"{option}: {exc}") from None


def server_context_of(cert: str | Path | None, key: str | Path | None, cert_option: str,
                      key_option: str) -> ssl.SSLContext | None:
    """`server_context(cert, key)` for the options named (None when both are unset); a ConfigError names them."""
    if not cert and not key:
        return None
    if not cert or not key:
        raise ConfigError(f"{cert_option} and {key_option} go together")
    try:
        return server_context(cert, key)
    except ConfigError as exc:
        raise ConfigError(f"{cert_option}: {exc}") from None


def describe_tls_error(exc: BaseException) -> str:
    """Why a TLS handshake failed, in words an operator can act on."""
    text = str(exc)
    if isinstance(exc, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in text:
        if "hostname" in text.lower() or "IP address mismatch" in text:
            return f"the server's TLS certificate does not name the host connected to ({text})"
        return f"the server's TLS certificate is not signed by the trusted CA ({text})"
    if "WRONG_VERSION_NUMBER" in text or "record layer failure" in text.lower() or "HTTP_REQUEST" in text:
        return f"the peer does not speak TLS (a plaintext port, or a plaintext client on a TLS port) ({text})"
    return f"TLS handshake failed ({type(exc).__name__}: {text})"


def is_tls_error(exc: BaseException) -> bool:
    """Whether `exc` is a failed TLS handshake (retrying the same server cannot help)."""
    return isinstance(exc, ssl.SSLError) or "CERTIFICATE_VERIFY_FAILED" in str(exc)


# ---- making certificates ------------------------------------------------------------------------------------------
def _ca_certificate(key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"KVMesh CA {socket.gethostname()}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))


def _leaf_certificate(service: str, key: ec.EllipticCurvePrivateKey, ca_key: ec.EllipticCurvePrivateKey,
                      ca_cert: x509.Certificate, hosts: list[str]) -> x509.Certificate:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvmesh {service}")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CERT_VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            # one certificate serves a service's listeners and its own outgoing links (NATS routes)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"TLS CA key {path}: not the EC key KVMesh makes")
    return key


def _write(path: Path, data: bytes, private: bool) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(temporary, path)


def _readable(path: str | Path, what: str) -> Path:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"TLS {what} {file}: no such file")
    return file


def _check_key(path: Path) -> None:
    """A private key others can read is no longer private: refuse it, as credentials files are."""
    mode = _readable(path, "key").stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"TLS key {path} is readable by other users; chmod 600 it")
