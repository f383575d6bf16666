"""Sharing domains in a credentials directory (shared/messaging/credentials.py): `kvmesh credentials --domain` records
engines in a domain (domains.json, each engine's file), every domain has its own secret, locally provisioned
engines are in the default domain, domains.json lists every engine (default ones too: stores serve each listed
engine on a lane of its own), and a store's DomainMap follows the file as it changes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.shared.errors import ConfigError
from kvmesh.shared.messaging.credentials import MeshCredentials, SharingDomain, sharing_domain
from kvmesh.shared.messaging.sharing_domains import DEFAULT_DOMAIN, DomainMap, check_domain_name, domains_file_beside


def kvmesh_credentials(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`kvmesh credentials --dir directory args...`, as its own process."""
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", "credentials", "--dir", str(directory), *args],
                          capture_output=True, text=True, timeout=60)


def test_engines_get_their_domain_and_its_secret(tmp_path: Path) -> None:
    directory = tmp_path / "creds"
    result = kvmesh_credentials(directory, "--domain", "tenant-a", "engine.a1", "engine.a2")
    assert result.returncode == 0, result.stderr
    result = kvmesh_credentials(directory, "--domain", "tenant-b", "engine.b1", "store.disk-1")
    assert result.returncode == 0, result.stderr
    assert kvmesh_credentials(directory, "engine.c1").returncode == 0

    assert json.loads((directory / "domains.json").read_text()) == {
        "engine.a1": "tenant-a", "engine.a2": "tenant-a", "engine.b1": "tenant-b", "engine.c1": DEFAULT_DOMAIN}
    a1, a2, b1, c1 = (sharing_domain(directory / f"engine.{name}.json") for name in ("a1", "a2", "b1", "c1"))
    assert (a1.name, b1.name, c1.name) == ("tenant-a", "tenant-b", DEFAULT_DOMAIN)
    assert a1 == a2 and a1.secret is not None and len(a1.secret) == 32
    assert len({a1.secret, b1.secret, c1.secret}) == 3
    secret_file = directory / "domain-tenant-a.secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert bytes.fromhex(secret_file.read_text().strip()) == a1.secret
    # a store's file records no domain; the NATS users are the principals, never the domains file
    assert sharing_domain(directory / "store.disk-1.json") == SharingDomain(DEFAULT_DOMAIN, None)
    users = (directory / "authorization.conf").read_text()
    assert "engine.b1" in users and "domains" not in users


def test_moving_an_engine_to_another_domain(tmp_path: Path) -> None:
    mesh = MeshCredentials(tmp_path / "creds")
    mesh.ensure("engine.a1", domain="tenant-a")
    first = sharing_domain(mesh.file("engine.a1"))
    mesh.ensure("engine.a1", domain=DEFAULT_DOMAIN)
    assert json.loads(mesh.domains_file.read_text()) == {"engine.a1": DEFAULT_DOMAIN}
    moved = sharing_domain(mesh.file("engine.a1"))
    assert moved.name == DEFAULT_DOMAIN and moved.secret != first.secret
    mesh.ensure("engine.a1")  # no --domain: stays where it is (a provisioning engine adding itself again)
    assert sharing_domain(mesh.file("engine.a1")) == moved


def test_a_provisioned_engine_is_in_the_default_domain(tmp_path: Path) -> None:
    mesh = MeshCredentials(tmp_path / "creds")
    mesh.ensure("engine.other", domain="tenant-a")
    mesh.ensure("engine.local")  # what `provision` / `admit` do for a vLLM on the host
    assert sharing_domain(mesh.file("engine.local")) == SharingDomain(DEFAULT_DOMAIN,
                                                                       mesh.domain_secret(DEFAULT_DOMAIN))
    assert json.loads(mesh.domains_file.read_text()) == {"engine.other": "tenant-a", "engine.local": DEFAULT_DOMAIN}
    assert DomainMap(mesh.domains_file).engines() == ["engine.local", "engine.other"]


def test_an_older_domains_file_gets_its_default_engines_listed(tmp_path: Path) -> None:
    """A domains.json of before every engine was listed names only the non-default ones; any principal added
    then (a store provisioning itself included) lists the others as "default", so a store serves them too."""
    mesh = MeshCredentials(tmp_path / "creds")
    mesh.ensure("engine.a1", "engine.old", domain="tenant-a")
    mesh.ensure("engine.old", domain=DEFAULT_DOMAIN)
    mesh.domains_file.write_text(json.dumps({"engine.a1": "tenant-a"}))  # as the older code left it
    assert DomainMap(mesh.domains_file).domain_of("engine.old.w0") == DEFAULT_DOMAIN  # absent: default, as before
    mesh.ensure("store.s")
    assert json.loads(mesh.domains_file.read_text()) == {"engine.a1": "tenant-a", "engine.old": DEFAULT_DOMAIN}
    assert sharing_domain(mesh.file("engine.old")).name == DEFAULT_DOMAIN


@pytest.mark.parametrize("name", ["", "a.b", "x" * 65, "a/b", "ü"])
def test_bad_domain_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="sharing domain"):
        check_domain_name(name)
    result = kvmesh_credentials(tmp_path / "creds", "--domain", name, "engine.a")
    assert result.returncode != 0 and "sharing domain" in result.stderr


def test_sharing_domain_of_old_and_bad_files(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"user": "engine.x", "password": "p"}))
    assert sharing_domain(old) == SharingDomain() and sharing_domain(None) == SharingDomain()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"user": "engine.x", "domain": "a", "domain_secret": "zz"}))
    with pytest.raises(ConfigError, match="bad.json"):
        sharing_domain(bad)


def test_a_domain_map_follows_its_file(tmp_path: Path) -> None:
    mesh = MeshCredentials(tmp_path / "creds")
    domains = DomainMap(domains_file_beside(mesh.file("store.s")))
    assert domains.domain_of("engine.a1.w0") == DEFAULT_DOMAIN  # no file yet: everyone is in the default domain
    mesh.ensure("engine.a1", domain="tenant-a")
    assert domains.domain_of("engine.a1.w0@1") == "tenant-a" and domains.domain_of("engine.a1") == "tenant-a"
    assert domains.domain_of("engine.a10.w0") == DEFAULT_DOMAIN and domains.domain_of("operator") == DEFAULT_DOMAIN
    mesh.ensure("engine.a1", domain="tenant-b")
    os.utime(mesh.domains_file, ns=(1, 1))  # a rewrite within the clock's granularity still counts (the size differs)
    assert domains.domain_of("engine.a1.w0") == "tenant-b"
    mesh.domains_file.write_text("[")  # a bad rewrite keeps the last good map
    assert domains.domain_of("engine.a1.w0") == "tenant-b"
    with pytest.raises(ConfigError, match="domains file"):
        DomainMap(mesh.domains_file)
