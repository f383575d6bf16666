"""The model part of chunk keys (services/engine/adapter/model_identity.py): what changes K/V besides the tokens
and the KV layout must change the identity, and a plain model keeps the identity (so the keys) it always had.

Built from real vLLM `ModelConfig` / `CacheConfig` objects over a tiny local Llama config.json (offline, no
weights: `skip_tokenizer_init`), so the attribute names and the resolved values (`dtype` as a torch dtype,
`hf_text_config.rope_parameters` after `--hf-overrides`) are vLLM's own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

vllm_config = pytest.importorskip("vllm.config")
transformers = pytest.importorskip("transformers")

from kvmesh.services.engine.adapter.model_identity import instance_of, model_identity  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "rope_theta": 10000.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=8192,
                             torch_dtype="bfloat16").save_pretrained(path)
    return path


def model(path: Path, **kwargs: Any) -> Any:
    return vllm_config.ModelConfig(model=str(path), skip_tokenizer_init=True, **kwargs)


def cache(cache_dtype: str = "auto") -> Any:
    return vllm_config.CacheConfig(cache_dtype=cache_dtype)


def test_a_plain_model_keeps_its_bare_name(model_dir: Path) -> None:
    assert model_identity("m", model(model_dir), cache(), "i1") == "m"
    assert model_identity("m", SimpleNamespace()) == "m"
    assert model_identity("m", SimpleNamespace(revision="abc", quantization="awq")) == "m@abc+awq"


def test_rope_scaling_overrides_change_the_identity(model_dir: Path) -> None:
    plain = model_identity("m", model(model_dir), cache(), "i1")
    yarn = model_identity("m", model(model_dir, hf_overrides={"rope_parameters": YARN}), cache(), "i1")
    dynamic = model_identity("m", model(model_dir, hf_overrides={"rope_parameters": DYNAMIC}), cache(), "i1")
    assert len({plain, yarn, dynamic}) == 3
    assert yarn.startswith("m~"), "the bare name stays readable in front"
    # the same override on another instance (or the scheduler's copy of the config) gives the same identity
    assert model_identity("m", model(model_dir, hf_overrides={"rope_parameters": YARN}), cache(), "i2") == yarn


def test_any_hf_override_changes_the_identity_stably(model_dir: Path) -> None:
    plain = model_identity("m", model(model_dir), cache(), "i1")
    theta = model_identity("m", model(model_dir, hf_overrides={"rope_theta": 500000.0}), cache(), "i1")
    heads = model_identity("m", model(model_dir, hf_overrides={"attention_bias": True}), cache(), "i1")
    assert len({plain, theta, heads}) == 3
    # dict order does not matter: the digest is of the sorted overrides
    a = SimpleNamespace(hf_overrides={"x": 1, "y": {"b": 2, "a": 1}})
    b = SimpleNamespace(hf_overrides={"y": {"a": 1, "b": 2}, "x": 1})
    assert model_identity("m", a) == model_identity("m", b) != "m"


def test_callable_hf_overrides_are_keyed_by_the_config_they_produce(
        model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    def yarn(config: Any) -> Any:
        config.rope_parameters = dict(YARN)
        return config

    def nothing(config: Any) -> Any:
        return config

    with caplog.at_level(logging.INFO):
        first = model_identity("m", model(model_dir, hf_overrides=yarn), cache(), "i1")
        again = model_identity("m", model(model_dir, hf_overrides=yarn), cache(), "i2")
    plain = model_identity("m", model(model_dir), cache(), "i1")
    noop = model_identity("m", model(model_dir, hf_overrides=nothing), cache(), "i1")
    assert first == again and len({first, plain, noop}) == 3
    assert "callable" in caplog.text


def test_a_callable_override_whose_config_cannot_be_digested_keys_privately() -> None:
    class Opaque:
        def to_dict(self) -> dict[str, Any]:
            raise TypeError("no dict")

    def fn(config: Any) -> Any:
        return config

    config = SimpleNamespace(hf_overrides=fn, hf_config=Opaque())
    one, two = model_identity("m", config, instance="i1"), model_identity("m", config, instance="i2")
    assert one != two and "m" not in {one, two}
    assert model_identity("m", config, instance="i1") == one, "the scheduler and the workers agree"


def test_a_quantized_kv_cache_mixes_in_the_weights_dtype(model_dir: Path) -> None:
    bf16 = model_identity("m", model(model_dir, dtype="bfloat16"), cache("fp8"), "i1")
    fp16 = model_identity("m", model(model_dir, dtype="float16"), cache("fp8"), "i1")
    assert bf16 != fp16 and "m" not in {bf16, fp16}
    assert model_identity("m", model(model_dir, dtype="bfloat16"), cache("fp8_e5m2"), "i2") != fp16


def test_an_auto_kv_cache_ignores_the_weights_dtype(model_dir: Path) -> None:
    """With "auto" the KV dtype is the weights' dtype, already in the chunk format: the keys stay unchanged."""
    assert model_identity("m", model(model_dir, dtype="bfloat16"), cache("auto"), "i1") == "m"
    assert model_identity("m", model(model_dir, dtype="float16"), cache("auto"), "i1") == "m"
    # a float cache dtype that names the weights' dtype is the same KV
    assert model_identity("m", model(model_dir, dtype="bfloat16"), cache("bfloat16"), "i1") == "m"
    # one that does not was computed in another dtype than an "auto" cache of that dtype
    assert model_identity("m", model(model_dir, dtype="float16"), cache("bfloat16"), "i1") != "m"


def test_kv_scales_computed_per_instance_are_never_shared() -> None:
    """vLLM 0.32 has no `calculate_kv_scales` (scales come with the checkpoint or are 1.0); a build that has it
    computes them from each instance's first batch, so such KV is private to the instance's run."""
    weights = SimpleNamespace(dtype="bfloat16")
    computed = SimpleNamespace(cache_dtype="fp8", calculate_kv_scales=True)
    fixed = SimpleNamespace(cache_dtype="fp8", calculate_kv_scales=False)
    one = model_identity("m", weights, computed, "i1")
    two = model_identity("m", weights, computed, "i2")
    off = model_identity("m", weights, fixed, "i1")
    assert len({one, two, off}) == 3
    assert off == model_identity("m", weights, fixed, "i2"), "checkpoint scales are shared across instances"
    assert model_identity("m", weights, computed, "i1") == one, "the scheduler and the workers agree"
    with pytest.raises(ValueError):
        model_identity("m", weights, computed, "")  # no instance to keep it private to


def test_the_instance_is_per_run_and_per_data_parallel_replica() -> None:
    def config(run: str, dp_rank: int) -> Any:
        return SimpleNamespace(instance_id=run, parallel_config=SimpleNamespace(data_parallel_rank=dp_rank))

    base = instance_of(config("100", 0), "lmcache_default_instance")
    assert base == instance_of(config("100", 0), "lmcache_default_instance")
    assert len({base, instance_of(config("101", 0), "lmcache_default_instance"),
                instance_of(config("100", 1), "lmcache_default_instance"),
                instance_of(config("100", 0), "other")}) == 4
