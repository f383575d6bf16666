"""LMCache YAML files as the tests read them (tests/shared/test_lmcache_keys.py, tests/e2e/test_e2e_lmcache_yaml.py):
the keys a file sets that KVMesh names in a warning."""

from __future__ import annotations

from kvmesh.services.engine.config.lmcache_keys import IGNORED


def expected_warnings(data: dict[str, object]) -> list[str]:
    names = []
    for key, value in data.items():
        if key == "extra_config":  # valkey_mode is read (a valkey:// remote_url): no warning
            names += [f"extra_config.{sub}" for sub in value if sub != "valkey_mode"]  # type: ignore[union-attr]
        elif key in IGNORED:
            names.append(key)
    return names
