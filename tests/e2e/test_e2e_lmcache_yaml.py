"""vLLM starts and serves with each LMCache YAML of tests/data/lmcache/ (together they set every key of LMCache's
configuration reference): the keys KVMesh does not act on are named in one WARNING each per process, never a
failed start. Sizes and paths are made small and private to the test; every other value is the file's."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

from support.e2e import VLLMServer, clean_env, free_port, kv_transfer_config, start_vllm
from support.lmcache_yaml import expected_warnings

pytestmark = pytest.mark.vllm

DATA = Path(__file__).parent.parent / "data" / "lmcache"
WARNING = re.compile(r"LMCache key (?P<key>[\w.]+) \(")


@pytest.mark.parametrize("name", sorted(p.stem for p in DATA.glob("*.yaml")))
def test_vllm_starts_with_each_lmcache_yaml_and_names_each_ignored_key_once_per_process(
        name: str, tmp_path: Path, demo_model: Path) -> None:
    settings = yaml.safe_load((DATA / f"{name}.yaml").read_text())
    settings["max_local_cpu_size"] = 0.25  # every vLLM of the suite reserves its pool for real: keep it small
    if "local_disk" in settings:
        settings["local_disk"], settings["max_local_disk_size"] = str(tmp_path / "disk"), 0.1
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(settings))
    server = VLLMServer(f"vllm-{name}", demo_model, free_port(), tmp_path / "vllm.log",
                        kv_config=kv_transfer_config(), env=clean_env(LMCACHE_CONFIG_FILE=str(config)), cwd=tmp_path)
    try:
        start_vllm(server)
        completion = server.complete("The quick brown fox jumps over the lazy dog. " * 20, max_tokens=4)
        assert completion["choices"][0]["text"]
        log = server.log_text()
    finally:
        server.stop()
    warned = Counter(m["key"] for m in WARNING.finditer(log))
    assert set(warned) == set(expected_warnings(settings)), "each ignored key, and only those, is named"
    assert len(set(warned.values())) == 1, f"every key is named once per process that read the config: {warned}"
