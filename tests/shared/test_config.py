"""Tests of services/engine/config/engine_config.py: the LMCache-compatible engine configuration (defaults, LMCache's YAML, env, errors)."""

import os
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from kvmesh.services.engine.config.engine_config import EngineConfig, load_engine_config
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.options_cli import GB

# The YAML files of the seeds, verbatim.
SEED_000_YAML = """\
chunk_size: 256
local_cpu: True
max_local_cpu_size: 5
# cache controller configurations
enable_controller: True
lmcache_instance_id: "lmcache_default_instance"
controller_url: "localhost:9001"
lmcache_worker_port: 8001
distributed_url: "localhost:8002"
"""
SEED_001_YAML = """\
chunk_size: 256
local_cpu: True
max_local_cpu_size: 5
# cache controller configurations
enable_controller: True
lmcache_instance_id: "lmcache_default_instance"
controller_url: "localhost:9001"
distributed_url: "localhost:8002"
lmcache_worker_port: 8001
"""
SEED_002_YAML = """\
# 256 Tokens per KV Chunk
chunk_size: 256
# Enable Disk backend
local_disk: "file://local/disk_test/local_disk/"
# 5GB of Disk memory
max_local_disk_size: 5.0
"""
SEED_002_DISK_OFFLOAD_YAML = """\
chunk_size: 256
local_cpu: false
max_local_cpu_size: 5.0
local_disk: "file://local/disk_test/local_disk/"
max_local_disk_size: 5.0
"""


def write(tmp_path: Path, text: str, name: str = "example.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def assert_names(exc: pytest.ExceptionInfo[ConfigError], *parts: str) -> None:
    message = str(exc.value)
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


# ---- defaults and derived values ----------------------------------------------------------------------------------
def test_defaults() -> None:
    config = EngineConfig()
    assert config == EngineConfig.from_defaults() == EngineConfig.from_env({})
    assert config.chunk_size == 256
    assert config.local_cpu is True
    assert config.max_local_cpu_size == 5.0
    assert config.local_disk is None and config.local_disk_path is None
    assert config.max_local_disk_size == 0.0
    assert config.remote_url is None
    assert config.remote_serde == "naive"
    assert config.save_unfull_chunk is True  # the pin quickstart: a 12-token prompt is stored
    assert config.enable_controller is False
    assert config.lmcache_instance_id == "lmcache_default_instance"
    assert config.cache_policy == "LRU"
    assert config.nats_url is None
    assert config.remote_partitions == 1
    assert config.store_queue_size == 256
    assert config.write_behind_defer_secs == 2.0
    assert config.write_behind_idle_secs == 0.1
    assert config.max_local_cpu_bytes == 5 * GB == 5 * 1024**3
    assert config.max_local_disk_bytes == 0
    assert config.remote_size_bytes == 4 * 1024**3


def test_frozen_and_to_dict() -> None:
    config = EngineConfig.from_defaults(chunk_size=16, extra_config={"a": 1})
    with pytest.raises(FrozenInstanceError):
        config.chunk_size = 1  # type: ignore[misc]
    data = config.to_dict()
    assert data["chunk_size"] == 16 and data["extra_config"] == {"a": 1}
    assert set(data) >= {"chunk_size", "local_disk", "nats_url", "heartbeat_interval_secs"}
    assert EngineConfig(**data) == config


def test_secrets_stay_out_of_repr() -> None:
    config = EngineConfig.from_defaults(nats_password="hunter2", nats_token="t0ken")
    assert "hunter2" not in repr(config) and "t0ken" not in repr(config)
    assert config.nats_password == "hunter2"


def test_direct_construction_is_checked() -> None:
    with pytest.raises(ConfigError) as exc:
        EngineConfig(chunk_size=0)
    assert_names(exc, "chunk_size")
    assert EngineConfig(cache_policy="lru").cache_policy == "LRU"
    for name in ("retained_cpu_share", "retained_redis_share"):  # what leases may keep of the CPU tier, of Redis
        for share in (-0.1, 1.5, float("nan")):
            with pytest.raises(ConfigError) as exc:
                EngineConfig(**{name: share})
            assert_names(exc, name)
        assert getattr(EngineConfig(**{name: 0.0}), name) == 0.0


@pytest.mark.parametrize("name", ["LRU", "lfu", "Fifo", "mru"])
def test_cache_policy_takes_the_four_lmcache_names(tmp_path: Path, name: str) -> None:
    assert EngineConfig(cache_policy=name).cache_policy == name.upper()
    assert EngineConfig.from_env({"LMCACHE_CACHE_POLICY": name}).cache_policy == name.upper()
    assert EngineConfig.from_file(write(tmp_path, f"cache_policy: {name}\n")).cache_policy == name.upper()


def test_cpu_load_pipeline_takes_auto_always_never(tmp_path: Path) -> None:
    assert EngineConfig().cpu_load_pipeline == "auto"
    assert EngineConfig.from_env({"LMCACHE_CPU_LOAD_PIPELINE": "Never"}).cpu_load_pipeline == "never"
    assert EngineConfig.from_file(write(tmp_path, "cpu_load_pipeline: always\n")).cpu_load_pipeline == "always"
    for wrong in ("sometimes", "off"):  # YAML reads a bare off as false: a string of the three is asked for
        with pytest.raises(ConfigError) as exc:
            EngineConfig.from_file(write(tmp_path, f"cpu_load_pipeline: {wrong}\n"))
        assert_names(exc, "cpu_load_pipeline")


def test_from_defaults_converts_and_normalises() -> None:
    config = EngineConfig.from_defaults(
        chunk_size="512", max_local_cpu_size=2, cache_policy="lru", remote_serde="CacheGen"
    )
    assert config.chunk_size == 512
    assert config.max_local_cpu_size == 2.0 and isinstance(config.max_local_cpu_size, float)
    assert config.cache_policy == "LRU"
    assert config.remote_serde == "cachegen"
    assert EngineConfig.from_defaults(remote_serde="kivi").remote_serde == "kivi"


def test_remote_url_is_kept_as_is() -> None:
    for url in ("nats://host:4222", "kvmesh://mesh/remote", "lm://localhost:65432"):
        assert EngineConfig.from_defaults(remote_url=url).remote_url == url
    # schemes KVMesh does not serve: tests/shared/test_lmcache_keys.py


# ---- LMCache's YAML ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [SEED_000_YAML, SEED_001_YAML], ids=["seed000", "seed001"])
def test_seed_controller_yaml(tmp_path: Path, text: str) -> None:
    config = EngineConfig.from_file(write(tmp_path, text))
    assert config == EngineConfig.from_defaults(
        chunk_size=256,
        local_cpu=True,
        max_local_cpu_size=5.0,
        enable_controller=True,
        lmcache_instance_id="lmcache_default_instance",
        controller_url="localhost:9001",
        lmcache_worker_port=8001,
        distributed_url="localhost:8002",
    )
    assert isinstance(config.max_local_cpu_size, float)
    assert config.save_unfull_chunk is True


def test_seed_002_yaml(tmp_path: Path) -> None:
    config = EngineConfig.from_file(write(tmp_path, SEED_002_YAML))
    assert config.chunk_size == 256
    assert config.local_disk == "file://local/disk_test/local_disk/"
    assert config.local_disk_path == Path("local/disk_test/local_disk")
    assert not config.local_disk_path.is_absolute()
    assert config.max_local_disk_size == 5.0 and config.max_local_disk_bytes == 5 * 1024**3
    assert config.local_cpu is True  # untouched default

    offload = EngineConfig.from_file(write(tmp_path, SEED_002_DISK_OFFLOAD_YAML, "disk-offload.yaml"))
    assert offload.local_cpu is False
    assert offload.max_local_cpu_size == 5.0
    assert offload.local_disk_path == Path("local/disk_test/local_disk")


def test_seed_002_env_form_equals_file_form(tmp_path: Path) -> None:
    env = {
        "LMCACHE_CHUNK_SIZE": "256",
        "LMCACHE_LOCAL_CPU": "False",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "5.0",
        "LMCACHE_LOCAL_DISK": "file://local/disk_test/local_disk/",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "5.0",
        "LMCACHE_USE_EXPERIMENTAL": "True",
    }
    from_file = EngineConfig.from_file(write(tmp_path, SEED_002_DISK_OFFLOAD_YAML))
    assert EngineConfig.from_env(env) == from_file


def test_empty_file_is_all_defaults(tmp_path: Path) -> None:
    assert EngineConfig.from_file(write(tmp_path, "")) == EngineConfig()
    assert EngineConfig.from_file(write(tmp_path, "# only a comment\n")) == EngineConfig()


# ---- local_disk ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("local_disk", "expected"),
    [
        ("file://local/disk_test/local_disk/", Path("local/disk_test/local_disk")),
        ("local/disk_test/local_disk/", Path("local/disk_test/local_disk")),
        ("file:///var/cache/kvmesh", Path("/var/cache/kvmesh")),
        ("/var/cache/kvmesh", Path("/var/cache/kvmesh")),
    ],
)
def test_local_disk_path(local_disk: str, expected: Path) -> None:
    config = EngineConfig.from_defaults(local_disk=local_disk)
    assert config.local_disk == local_disk
    assert config.local_disk_path == expected


@pytest.mark.parametrize("text", ["None", "none", "null", ""])
def test_local_disk_none_forms(text: str) -> None:
    assert EngineConfig.from_env({"LMCACHE_LOCAL_DISK": text}).local_disk is None


def test_local_disk_none_in_yaml(tmp_path: Path) -> None:
    # LMCache's docs write "None if disabled"; unquoted None is a string in YAML
    assert EngineConfig.from_file(write(tmp_path, "local_disk: None\n")).local_disk is None
    assert EngineConfig.from_file(write(tmp_path, "local_disk: null\n")).local_disk is None


# ---- environment --------------------------------------------------------------------------------------------------
def test_env_overrides_file(tmp_path: Path) -> None:
    path = write(tmp_path, SEED_000_YAML)
    config = EngineConfig.from_env(
        {"LMCACHE_CONFIG_FILE": str(path), "LMCACHE_CHUNK_SIZE": "128", "LMCACHE_LOCAL_CPU": "false"}
    )
    assert config.chunk_size == 128
    assert config.local_cpu is False
    assert config.controller_url == "localhost:9001"  # from the file
    assert config.lmcache_worker_port == 8001


def test_config_file_var_is_quoted_and_relative(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, SEED_002_YAML)
    monkeypatch.chdir(tmp_path)
    config = EngineConfig.from_env({"LMCACHE_CONFIG_FILE": '"example.yaml"'})
    assert config.max_local_disk_size == 5.0


def test_from_env_reads_os_environ_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("LMCACHE_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "64")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(write(tmp_path, SEED_000_YAML)))
    config = EngineConfig.from_env()
    assert config.chunk_size == 64 and config.enable_controller is True


@pytest.mark.parametrize("raw", ['"file://x/y/"', "'file://x/y/'", "  file://x/y/  ", " 'file://x/y/' "])
def test_env_quotes_and_whitespace_stripped(raw: str) -> None:
    assert EngineConfig.from_env({"LMCACHE_LOCAL_DISK": raw}).local_disk == "file://x/y/"


def test_env_quoted_number_and_id() -> None:
    config = EngineConfig.from_env({"LMCACHE_CHUNK_SIZE": '"512"', "LMCACHE_LMCACHE_INSTANCE_ID": "'inst-1'"})
    assert config.chunk_size == 512
    assert config.lmcache_instance_id == "inst-1"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("true", True), ("True", True), ("TRUE", True), ("1", True), ("yes", True), ("on", True),
     ("false", False), ("False", False), ("0", False), ("no", False), ("Off", False)],
)
def test_env_booleans(raw: str, expected: bool) -> None:
    assert EngineConfig.from_env({"LMCACHE_SAVE_DECODE_CACHE": raw}).save_decode_cache is expected


@pytest.mark.parametrize(("raw", "expected"), [("5", 5.0), ("5.0", 5.0), ("0.5", 0.5), (" 2.25 ", 2.25), ("1e1", 10.0)])
def test_env_floats(raw: str, expected: float) -> None:
    value = EngineConfig.from_env({"LMCACHE_MAX_LOCAL_CPU_SIZE": raw}).max_local_cpu_size
    assert value == expected and isinstance(value, float)


def test_env_int_accepts_integral_float_text() -> None:
    assert EngineConfig.from_env({"LMCACHE_CHUNK_SIZE": "256.0"}).chunk_size == 256


@pytest.mark.parametrize("raw", ["None", "null", "NULL", ""])
def test_env_none_forms(raw: str) -> None:
    config = EngineConfig.from_env(
        {"LMCACHE_LMCACHE_WORKER_PORT": raw, "LMCACHE_CONTROLLER_URL": raw, "LMCACHE_EXTRA_CONFIG": raw}
    )
    assert config.lmcache_worker_port is None and config.controller_url is None and config.extra_config is None


def test_env_extra_config_json() -> None:
    config = EngineConfig.from_env({"LMCACHE_EXTRA_CONFIG": '{"a": 1, "b": [1, 2]}'})
    assert config.extra_config == {"a": 1, "b": [1, 2]}


def test_env_kvmesh_keys() -> None:
    config = EngineConfig.from_env(
        {"LMCACHE_NATS_URL": "nats://10.0.0.1:4222", "LMCACHE_REMOTE_PARTITIONS": "3", "LMCACHE_REMOTE_SIZE": "0.5"}
    )
    assert config.nats_url == "nats://10.0.0.1:4222"
    assert config.remote_partitions == 3
    assert config.remote_size_bytes == GB // 2


def test_env_ignores_unrelated_variables() -> None:
    env = {"LMCACHE_LOG_LEVEL": "DEBUG", "LMCACHE_TRACK_USAGE": "false", "PATH": "/bin", "VLLM_X": "1"}
    assert EngineConfig.from_env(env) == EngineConfig()


# ---- kv_connector_extra_config ------------------------------------------------------------------------------------
def test_with_overrides_prefix_and_plain() -> None:
    base = EngineConfig.from_defaults(chunk_size=256)
    config = base.with_overrides(
        {"lmcache.chunk_size": 64, "local_cpu": False, "lmcache.local_disk": "file:///tmp/kv/"},
        "kv_connector_extra_config",
    )
    assert config.chunk_size == 64 and config.local_cpu is False
    assert config.local_disk_path == Path("/tmp/kv")
    assert base.chunk_size == 256  # a copy; the original is untouched


def test_load_engine_config(tmp_path: Path) -> None:
    env = {"LMCACHE_CONFIG_FILE": str(write(tmp_path, SEED_000_YAML)), "LMCACHE_CHUNK_SIZE": "128"}
    assert load_engine_config(environ=env).chunk_size == 128
    config = load_engine_config({"lmcache.chunk_size": 32, "lmcache.max_local_cpu_size": 1}, environ=env)
    assert config.chunk_size == 32  # extra config overrides env, which overrides the file
    assert config.max_local_cpu_size == 1.0
    assert config.controller_url == "localhost:9001"


def test_load_engine_config_error_names_source() -> None:
    with pytest.raises(ConfigError) as exc:
        load_engine_config({"lmcache.chunk_size": "big"}, environ={})
    assert_names(exc, "kv_connector_extra_config", "lmcache.chunk_size", "'big'")


# ---- errors ---------------------------------------------------------------------------------------------------------
def test_unknown_key_in_file_with_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_sz: 256\n")
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_file(path)
    assert_names(exc, f"config file {path}", "unknown key 'chunk_sz'", "did you mean 'chunk_size'")


def test_unknown_key_in_file_without_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "completely_unrelated: 1\n")
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_file(path)
    assert_names(exc, str(path), "'completely_unrelated'")
    assert "did you mean" not in str(exc.value)


def test_unknown_env_var_with_suggestion() -> None:
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_env({"LMCACHE_CHUNK_SIZ": "256"})
    assert_names(exc, "LMCACHE_CHUNK_SIZ", "did you mean LMCACHE_CHUNK_SIZE")


def test_unknown_env_var_plain() -> None:
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_env({"LMCACHE_FROBNICATE": "1"})
    assert_names(exc, "LMCACHE_FROBNICATE")


def test_unknown_override_key() -> None:
    with pytest.raises(ConfigError) as exc:
        EngineConfig().with_overrides({"lmcache.chunksize": 1}, "kv_connector_extra_config")
    assert_names(exc, "kv_connector_extra_config", "'lmcache.chunksize'", "did you mean 'chunk_size'")
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_defaults(max_cpu=1)
    assert_names(exc, "from_defaults", "'max_cpu'")


@pytest.mark.parametrize(
    ("line", "key", "shown"),
    [
        ("chunk_size: abc", "chunk_size", "'abc'"),
        ("chunk_size: 12.5", "chunk_size", "12.5"),
        ("chunk_size: true", "chunk_size", "True"),
        ("local_cpu: maybe", "local_cpu", "'maybe'"),
        ("local_cpu: 2", "local_cpu", "2"),
        ("encrypt_stores: maybe", "encrypt_stores", "'maybe'"),
        ("max_local_cpu_size: five", "max_local_cpu_size", "'five'"),
        ("max_local_cpu_size: [5]", "max_local_cpu_size", "[5]"),
        ("max_local_cpu_size: .nan", "max_local_cpu_size", "nan"),
        ("lmcache_instance_id: True", "lmcache_instance_id", "True"),
        ("controller_url: 9001", "controller_url", "9001"),
        ("lmcache_worker_port: localhost", "lmcache_worker_port", "'localhost'"),
        ("extra_config: [1, 2]", "extra_config", "[1, 2]"),
        ("chunk_size:", "chunk_size", "None"),
    ],
)
def test_wrong_types_in_file(tmp_path: Path, line: str, key: str, shown: str) -> None:
    path = write(tmp_path, line + "\n")
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_file(path)
    assert_names(exc, f"config file {path}", key, shown)


def test_yaml_string_numbers_are_accepted(tmp_path: Path) -> None:
    config = EngineConfig.from_file(write(tmp_path, 'max_local_cpu_size: "5"\nchunk_size: "128"\nlocal_cpu: "yes"\n'))
    assert config.max_local_cpu_size == 5.0 and config.chunk_size == 128 and config.local_cpu is True


@pytest.mark.parametrize(
    ("var", "raw", "shown"),
    [
        ("LMCACHE_CHUNK_SIZE", "abc", "expected an integer, got 'abc'"),
        ("LMCACHE_CHUNK_SIZE", "12.5", "'12.5'"),
        ("LMCACHE_CHUNK_SIZE", "None", "'None'"),  # not optional
        ("LMCACHE_LOCAL_CPU", "maybe", "expected a boolean, got 'maybe'"),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "5GB", "expected a number, got '5GB'"),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "inf", "'inf'"),
        ("LMCACHE_LMCACHE_WORKER_PORT", "80.5", "'80.5'"),
        ("LMCACHE_EXTRA_CONFIG", "{not json", "expected a JSON object"),
        ("LMCACHE_EXTRA_CONFIG", "[1, 2]", "[1, 2]"),
    ],
)
def test_wrong_types_in_env(var: str, raw: str, shown: str) -> None:
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_env({var: raw})
    assert_names(exc, var, shown)
    assert str(exc.value).startswith(var + ":")


def test_error_message_format_matches_contract() -> None:
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_env({"LMCACHE_CHUNK_SIZE": "abc"})
    assert str(exc.value) == "LMCACHE_CHUNK_SIZE: expected an integer, got 'abc'"


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("chunk_size", 0, "> 0"),
        ("chunk_size", -256, "> 0"),
        ("max_local_cpu_size", -1, ">= 0"),
        ("max_local_disk_size", -0.5, ">= 0"),
        ("remote_size", 0, "> 0"),
        ("remote_partitions", 0, ">= 1"),
        ("store_queue_size", 0, ">= 1"),
        ("write_behind_defer_secs", -0.5, ">= 0"),
        ("write_behind_idle_secs", 0, "> 0"),
        ("blocking_timeout_secs", 0, "> 0"),
        ("request_timeout_secs", -1, "> 0"),
        ("heartbeat_interval_secs", 0, "> 0"),
        ("blend_recompute_ratio", 1.5, "between 0 and 1"),
        ("lmcache_worker_port", 70000, "port"),
        ("lmcache_instance_id", "", "empty"),
        ("remote_serde", "pickle", "one of cachegen, kivi, naive"),
        ("cache_policy", "ARC", "one of FIFO, LFU, LRU, MRU"),
        ("local_disk", "s3://bucket/kv", "file://"),
    ],
)
def test_value_checks_name_key_and_source(tmp_path: Path, key: str, value: object, rule: str) -> None:
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_defaults(**{key: value})
    assert_names(exc, "from_defaults", key, rule)

    var = f"LMCACHE_{key.upper()}"
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_env({var: str(value)})
    assert_names(exc, var, rule)

    path = write(tmp_path, f"{key}: {value!r}\n" if isinstance(value, str) else f"{key}: {value}\n")
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_file(path)
    assert_names(exc, f"config file {path}: {key}", rule)


@pytest.mark.parametrize("text", ["- chunk_size: 256\n", "just a string\n", "42\n"])
def test_non_mapping_yaml(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_file(path)
    assert_names(exc, f"config file {path}", "mapping")


def test_invalid_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: [256\n")
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_file(path)
    assert_names(exc, f"config file {path}", "YAML")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_file(path)
    assert_names(exc, f"config file {path}", "cannot read")
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_env({"LMCACHE_CONFIG_FILE": str(path)})
    assert_names(exc, str(path))


def test_error_in_file_loaded_from_env_names_file(tmp_path: Path) -> None:
    path = write(tmp_path, "max_local_disk_size: -5\n")
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_env({"LMCACHE_CONFIG_FILE": str(path), "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"})
    assert_names(exc, f"config file {path}: max_local_disk_size", ">= 0")


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        EngineConfig.from_defaults(chunk_size=-1)


def test_a_local_disk_needs_a_size_once_every_source_is_applied() -> None:
    """local_disk in the file and max_local_disk_size in a variable is fine; a disk of size 0 is not."""
    with pytest.raises(ConfigError, match="max_local_disk_size: must be > 0 when local_disk is set"):
        load_engine_config(environ={"LMCACHE_LOCAL_DISK": "file:///tmp/kv"})
    config = load_engine_config({"max_local_disk_size": 2}, environ={"LMCACHE_LOCAL_DISK": "file:///tmp/kv"})
    assert config.max_local_disk_bytes == 2 * GB


def test_p2p_keys_in_every_form_lmcache_takes_them(tmp_path: Path) -> None:
    """p2p_init_ports: a YAML list, a JSON list or comma-separated text (LMCACHE_P2P_INIT_PORTS); enable_pd turns
    P2P on; a port out of range or a word is a ConfigError naming the key."""
    path = tmp_path / "pd.yaml"
    path.write_text("enable_pd: true\np2p_host: 10.0.0.5\np2p_init_ports: [8200, 8201]\n")
    from_file = load_engine_config(environ={"LMCACHE_CONFIG_FILE": str(path)})
    from_env = load_engine_config(environ={"LMCACHE_ENABLE_PD": "true", "LMCACHE_P2P_HOST": "10.0.0.5",
                                           "LMCACHE_P2P_INIT_PORTS": "8200,8201"})
    for config in (from_file, from_env):
        assert config.enable_p2p and config.p2p_host == "10.0.0.5" and config.p2p_init_ports == [8200, 8201]
    assert EngineConfig.from_defaults(p2p_init_ports="[8300]").p2p_init_ports == [8300]
    with pytest.raises(ConfigError, match="p2p_init_ports: every port must be 1-65535"):
        EngineConfig.from_defaults(p2p_init_ports=[8200, 70000])
    with pytest.raises(ConfigError, match="LMCACHE_P2P_INIT_PORTS: expected an integer, got 'eight'"):
        load_engine_config(environ={"LMCACHE_P2P_INIT_PORTS": "eight"})
