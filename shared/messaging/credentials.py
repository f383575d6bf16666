"""A mesh's NATS credentials: one user per principal, in a private directory, and the server config they make.

Layout of a credentials directory (mode 0700, every file 0600, owned by the user who made it):
    <path>.json            one principal's credentials: {"user", "password", "inbox_prefix"} (`NatsAuth.from_file`);
                           an engine's also {"domain", "domain_secret"}: its sharing domain (`sharing_domain`)
    domains.json           engine principal (user) -> sharing domain, every engine made here ("default" too; an
                           older file lists only the others: absent means "default"). Not secret: stores read it
                           beside their own credentials file (`kvmesh credentials --domain`) and serve each engine
                           it lists on a NATS connection of its own (shared/store_kit/store_endpoint.py, StoreEndpoint)
    domain-<name>.secret   each domain's random 32-byte secret (hex), copied into its engines' files
    authorization.conf     the NATS server's users and permissions, generated from the JSON files
    nats-server.conf       the server config KVMesh's embedded NATS runs with (includes authorization.conf)
    nats-server.pid        that server's pid: adding a principal rewrites authorization.conf and reloads it

Where KVMesh starts NATS itself (`kvmesh up`, `lmcache_controller`, the engine's embedded mesh) the directory is
`<runtime dir>/nats-<port>` (`local_mesh_dir`), so a vLLM on the same host that names that NATS in its config
finds it and adds its own instance's user (`provision`): the quickstart YAML files work as written, with auth.
Anyone who can read the directory is the mesh's administrator; nothing else can connect.
Passwords are random (32 bytes); they travel in files or environment variables, never on a command line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import json
import logging
import os
import secrets
import signal
import socket
import stat
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from kvmesh.shared.errors import ConfigError, MeshUnavailable
from kvmesh.shared.messaging.bus import NatsAuth
from kvmesh.shared.messaging.nats_permissions import authorization_block, inbox_prefix, permissions, reload_probe
from kvmesh.shared.messaging.nats_url import DEFAULT_PORT
from kvmesh.shared.protocol import OPERATOR, Principal
from kvmesh.shared.tls import TLS_DIR, client_context
from kvmesh.shared.messaging.sharing_domains import (DEFAULT_DOMAIN, DOMAINS_FILE, DomainMap, check_domain_name,
                                           domains_file_beside, read_domains)

log = logging.getLogger(__name__)

AUTHORIZATION_FILE = "authorization.conf"
SERVER_CONFIG_FILE = "nats-server.conf"
PID_FILE = "nats-server.pid"


@dataclass(frozen=True)
class SharingDomain:
    """The sharing domain an engine belongs to (the administrator's choice, recorded in its credentials file):
    stores show an engine only its own domain's chunks, engines mix a non-default name into their chunk keys,
    and `secret` (32 bytes; None where the credentials carry none) authenticates what the domain writes to a
    shared external store (Redis)."""

    name: str = DEFAULT_DOMAIN
    secret: bytes | None = None


def sharing_domain(credentials: str | Path | None) -> SharingDomain:
    """The sharing domain recorded in a KVMesh credentials file (`"domain"`, `"domain_secret"` in hex): the
    default domain without a secret when `credentials` is None or the file records none (credentials made before
    domains existed, or not by KVMesh). ConfigError naming the file when it cannot be read or holds bad values."""
    if credentials is None:
        return SharingDomain()
    file = Path(credentials)
    try:
        entry = json.loads(file.read_text())
        name = check_domain_name(entry.get("domain", DEFAULT_DOMAIN))
        secret_hex = entry.get("domain_secret")
        secret = None if secret_hex is None else bytes.fromhex(secret_hex)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(f"sharing domain of credentials file {file}: {type(exc).__name__}: {exc}") from None
    if secret is not None and len(secret) < 16:
        raise ConfigError(f"sharing domain of credentials file {file}: domain_secret is {len(secret)} bytes, "
                          "expected 32")
    return SharingDomain(name, secret)


def runtime_dir() -> Path:
    """Where KVMesh keeps the credentials of the meshes it starts: $KVMESH_RUNTIME_DIR, else /tmp/kvmesh-<uid>."""
    return Path(os.environ.get("KVMESH_RUNTIME_DIR") or f"/tmp/kvmesh-{os.getuid()}")


def local_mesh_dir(port: int) -> Path:
    """The credentials directory of the KVMesh-started NATS on this host's `port`."""
    return runtime_dir() / f"nats-{port}"


def private_dir(path: Path) -> Path:
    """`path` as a directory only we can use: created 0700 if missing; ConfigError if it is a symlink, not ours,
    or open to others (someone else could then read or plant credentials). The runtime directory above a mesh's
    directory is held to the same rule (whoever owns it could swap what is inside)."""
    if path.parent == runtime_dir():
        private_dir(path.parent)
    else:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"credentials directory {path} is not a plain directory")
    if info.st_uid != os.getuid():
        raise ConfigError(f"credentials directory {path} belongs to uid {info.st_uid}, not to us ({os.getuid()})")
    if info.st_mode & 0o022:  # others could have planted files in it
        raise ConfigError(f"credentials directory {path} is writable by other users (mode {info.st_mode & 0o777:o})")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours, and nobody else could write in it: close it
    return path


def domains_map(domains_file: Path | None, url: str, principal_path: str) -> DomainMap:
    """The DomainMap of a store or the controller (the principal at `principal_path`): `domains_file`, else
    domains.json beside the credentials a KVMesh-started NATS at `url` gave it (`provision`), else none (every
    engine in the default domain). ConfigError naming the file when it is malformed."""
    if domains_file is None:
        domains_file = domains_file_beside(local_credentials_file(url, principal_path))
    return DomainMap(domains_file)


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, readable by us alone."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(temporary, path)


CONTROLLER_TOKEN_FILE = "controller-token"


def controller_token_file(directory: Path) -> Path:
    """The controller's REST token in the credentials directory `directory` (`kvmesh up` beyond loopback): made
    0600 with a random token when missing, kept when present (clients keep theirs across restarts)."""
    path = private_dir(directory) / CONTROLLER_TOKEN_FILE
    if not path.is_file() or not path.read_text().strip():
        _write_private(path, secrets.token_urlsafe(32) + "\n")
    return path


class MeshCredentials:
    """The credentials directory of one mesh (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = private_dir(Path(root))

    def file(self, path: str) -> Path:
        """The credentials file of the principal at `path` (it may not exist yet)."""
        permissions(path)  # a principal path, nothing that could name another file
        return self.root / f"{path}.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # several processes add principals (the ranks of a vLLM)
            yield
        finally:
            os.close(fd)

    def ensure(self, *paths: str, domain: str | None = None) -> bool:
        """Create credentials for every principal in `paths` that has none; True when any was added or an engine
        changed domain (the authorization file is then rewritten: a running server needs `reload_server()`).

        An engine's file also records its sharing domain and that domain's secret: `domain` when given (the
        engines in `paths` are then moved to it), else the one domains.json gives it, else the default domain;
        domains.json lists every engine (`_record_domains`). A store's or the controller's file records none."""
        if domain is not None:
            check_domain_name(domain)
        with self._locked():
            missing = [path for path in paths if not self.file(path).exists()]
            for path in missing:
                _write_private(self.file(path), json.dumps({
                    "user": path, "password": secrets.token_urlsafe(32), "inbox_prefix": inbox_prefix(path)}))
            # every call, so that adding any principal also completes an older domains.json
            self._record_domains([path for path in paths if path.startswith("engine.")], domain)
            # an engine's NATS permissions follow its domain (P2P streams): a move rewrites them too
            authorization = authorization_block(self._users())
            file = self.root / AUTHORIZATION_FILE
            rewritten = not file.exists() or file.read_text() != authorization
            if rewritten:
                _write_private(file, authorization)
        return bool(missing) or rewritten

    @property
    def domains_file(self) -> Path:
        return self.root / DOMAINS_FILE

    def domain_secret(self, domain: str) -> bytes:
        """The secret of `domain`, made (32 random bytes, 0600) the first time it is asked for.

        The meshes KVMesh starts on this host (directories in the runtime directory) share one secret per domain,
        kept in the runtime directory: their user's engines trust each other anyway (each can add principals to
        any of them), and two vLLMs that each embed a mesh then still share a Redis tier's values."""
        folder = self.root.parent if self.root.parent == runtime_dir() else self.root
        file = folder / f"domain-{check_domain_name(domain)}.secret"
        try:
            return bytes.fromhex(file.read_text().strip())
        except FileNotFoundError:
            pass
        made = folder / f".domain-{domain}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(made, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_bytes(32).hex() + "\n")
        try:
            os.link(made, file)  # the first of two meshes making it at once wins; the other reads the winner's
        except FileExistsError:
            pass
        finally:
            made.unlink()
        return bytes.fromhex(file.read_text().strip())

    def _record_domains(self, engines: list[str], domain: str | None) -> None:
        """Write each engine's domain (and the domain's secret) into its file and into domains.json: `domain`
        when given, else the one it has (new ones: the default domain). domains.json lists every engine that has a
        file here, default ones as "default" (stores serve each listed engine on a connection of its own, and an
        engine a listing map leaves out on none); engines of an older file, which left default ones out, are
        added. Called under the lock."""
        domains = read_domains(self.domains_file)
        made = [file.name.removesuffix(".json") for file in self.root.glob("engine.*.json")]
        changed = bool(made) and not self.domains_file.exists()  # one once an engine exists: compose copies it
        for path in (*made, *engines):
            wanted = domain if domain is not None and path in engines else domains.get(path, DEFAULT_DOMAIN)
            if domains.get(path) != wanted:
                changed = True
                domains[path] = wanted
        if changed:  # not secret (stores read it beside their own file), yet written the same atomic way
            _write_private(self.domains_file, json.dumps(domains, indent=2, sort_keys=True) + "\n")
        for path in engines:
            name = domains.get(path, DEFAULT_DOMAIN)
            file = self.file(path)
            entry = json.loads(file.read_text())
            secret = self.domain_secret(name).hex()
            if entry.get("domain") != name or entry.get("domain_secret") != secret:
                entry.update(domain=name, domain_secret=secret)
                _write_private(file, json.dumps(entry))

    def _users(self) -> list[tuple[str, str, str]]:
        users = []
        for file in sorted(self.root.glob("*.json")):
            if file.name == DOMAINS_FILE:
                continue
            entry = json.loads(file.read_text())
            users.append((entry["user"], entry["password"], entry.get("domain", DEFAULT_DOMAIN)))
        return users

    def server_config(self, listen: str, settings: str = "") -> Path:
        """Write the NATS server config (listen address, `settings`, our users); its path."""
        self.ensure(OPERATOR.path)  # never an empty user list: NATS would then let anyone in
        config = self.root / SERVER_CONFIG_FILE
        _write_private(config, f"listen: {listen}\npid_file: {json.dumps(str(self.root / PID_FILE))}\n"
                               f"{settings}include ./{AUTHORIZATION_FILE}\n")
        return config

    def admit(self, path: str, timeout: float = 10.0) -> NatsAuth:
        """The credentials of `path`, added if missing and then loaded into the running server (`reload_server`;
        one that has not confirmed the reload within `timeout` s is logged, and the credentials returned anyway:
        the client's connect keeps retrying a rejection for `nats_auth_retry_secs`)."""
        if self.ensure(path):
            try:
                self.reload_server(timeout)
            except MeshUnavailable as exc:
                log.warning("%s; connecting as %s anyway", exc, path)
        return NatsAuth.from_file(self.file(path))

    def server_pid(self) -> int | None:
        """The pid of the NATS server running with this directory's config, or None: a stale pid file, or a pid
        now used by another program or by another nats-server (which may listen on our old port) is not it."""
        try:
            pid = int((self.root / PID_FILE).read_text().strip())
            executable = os.readlink(f"/proc/{pid}/exe")
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        if "nats-server" not in Path(executable).name or os.fsencode(self.root / SERVER_CONFIG_FILE) not in argv:
            return None
        return pid

    def reload_server(self, timeout: float = 10.0) -> bool:
        """Make the NATS server running with this directory's config read its users again (SIGHUP) and wait until
        it runs them: nats-server reloads in the background, so a signal sent is not a user added. Confirmed
        when the server accepts the reload probe of the authorization file as it is now (its password is a
        digest of the users: shared/messaging/nats_permissions.py), on the address the config listens on. False when no
        such server runs; MeshUnavailable when it has not loaded them within `timeout` s."""
        pid = self.server_pid()
        if pid is None:
            return False
        os.kill(pid, signal.SIGHUP)
        address = self._listen_address()
        deadline = time.monotonic() + timeout
        while address is not None:
            # read again each time: another process may have added a principal (and signalled) since
            probe = reload_probe((self.root / AUTHORIZATION_FILE).read_text())
            if probe is None:  # an authorization file from before the probe: nothing to confirm it by
                break
            if server_accepts(*address, NatsAuth(user=probe[0], password=probe[1]), self.tls_ca):
                break
            if time.monotonic() >= deadline:
                raise MeshUnavailable(f"the NATS server of {self.root} (pid {pid}) did not load its new users "
                                      f"within {timeout:g}s of a reload")
            time.sleep(0.02)
        return True

    @property
    def tls_ca(self) -> Path | None:
        """The CA of this directory's TLS material (`kvmesh credentials --tls`), if it has some."""
        ca = self.root / TLS_DIR / "ca.pem"
        return ca if ca.is_file() else None

    def _listen_address(self) -> tuple[str, int] | None:
        """Where a client on this host reaches the server of this directory's config (its `listen` line; a
        wildcard address through loopback); None when the config names none."""
        try:
            lines = (self.root / SERVER_CONFIG_FILE).read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            if line.startswith("listen:"):
                host, _, port = line.removeprefix("listen:").strip().strip('"').rpartition(":")
                host = host.strip("[]")
                wildcard = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}
                try:
                    return wildcard.get(host, host), int(port)
                except ValueError:
                    return None
        return None


def credentials_for(url: str, principal: Principal, given: NatsAuth | None) -> NatsAuth | None:
    """The credentials a client acting as `principal` connects to `url` with: `given` ones where they name any,
    else its own from a KVMesh-started NATS on this host (`provision`, with `given`'s auth_retry_secs), else
    `given` (no credentials). `given`'s TLS files are kept either way."""
    if given is not None and given.or_none() is not None:
        return given
    provisioned = provision(url, principal.path)
    if provisioned is None or given is None:
        return provisioned or given
    return dataclasses.replace(provisioned, auth_retry_secs=given.auth_retry_secs, tls_ca=given.tls_ca,
                               tls_cert=given.tls_cert, tls_key=given.tls_key)


def local_credentials_file(url: str, path: str) -> Path | None:
    """The credentials file `provision` gives the principal at `path` for a KVMesh-started NATS at `url` on this
    host, if there is one: never one a mesh that ran on this port before left behind (its users, its domains map
    and its domain secrets are not the NATS now on the port)."""
    address = _loopback_address(url)
    if address is None:
        return None
    file = local_mesh_dir(address[1]) / f"{path}.json"
    if not file.is_file():
        return None
    try:
        live = MeshCredentials(local_mesh_dir(address[1])).server_pid() is not None
    except (ConfigError, OSError) as exc:
        log.warning("cannot use the credentials of the local NATS %s (%s); connecting without", url, exc)
        return None
    return file if live else None


def provision(url: str, path: str, timeout: float = 10.0) -> NatsAuth | None:
    """Credentials of the principal at `path` for the NATS at `url` when KVMesh started that NATS on this host
    (its directory `local_mesh_dir(port)` is here and ours): added and loaded into the server if missing.
    None when `url` is not such a NATS, or we may not use its directory (logged)."""
    address = _loopback_address(url)
    if address is None or not local_mesh_dir(address[1]).is_dir():
        return None
    try:
        credentials = MeshCredentials(local_mesh_dir(address[1]))
        if credentials.server_pid() is None:  # the directory of a mesh that ran on this port before: not this NATS
            return None
        return credentials.admit(path, timeout)
    except (ConfigError, OSError) as exc:
        log.warning("cannot use the credentials of the local NATS %s (%s); connecting without", url, exc)
        return None


def _loopback_address(url: str) -> tuple[str, int] | None:
    """(host, port) of a single NATS URL on this host's loopback, else None."""
    if "," in url:
        return None
    parsed = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
    host = parsed.hostname or ""
    if host != "localhost" and not (_is_ip(host) and ipaddress.ip_address(host).is_loopback):
        return None
    return host, parsed.port or DEFAULT_PORT


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def server_accepts(host: str, port: int, auth: NatsAuth, tls_ca: Path | None = None) -> bool:
    """Whether the NATS server at host:port accepts `auth`'s user/password now (one bare protocol handshake). A
    server that requires TLS is asked over TLS, verified against `tls_ca`; without one it is not asked (False)."""
    connect = json.dumps({"user": auth.user, "pass": auth.password, "verbose": False, "pedantic": False})
    try:
        with socket.create_connection((host, port), timeout=2.0) as raw:
            info = raw.makefile("rb").readline()  # INFO, always in clear
            sock: socket.socket = raw
            if b'"tls_required":true' in info.replace(b" ", b""):
                if tls_ca is None:
                    return False
                sock = client_context(tls_ca).wrap_socket(raw, server_hostname=host)
            sock.sendall(f"CONNECT {connect}\r\nPING\r\n".encode())
            return sock.makefile("rb").readline().startswith(b"PONG")
    except (OSError, ConfigError):
        return False
