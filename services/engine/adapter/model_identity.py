"""The model part of chunk keys: everything about the model and its KV cache that changes K/V besides the
tokens and the KV layout (the layout's chunk format already holds the KV dtype and shape).

Computed in `KVMeshConnector.__init__` for each worker half from the same `VllmConfig` (the workers get a
pickled copy of the scheduler's); the scheduler hashes with the identity its workers publish (`publish_worker`,
agents/rendezvous.py), so every rank of one instance must compute the same string. It reads like
`name@revision+quantization~part~part`, and a model with none of the inputs below keeps exactly
`name@revision+quantization`, so its keys never change:

  * `~rope:<digest>`: the RoPE settings of `hf_text_config` (`rope_parameters`; `rope_scaling`/`rope_theta`
    on older transformers), only when a scaling is in effect (a `rope_type` other than "default"). K is stored
    after RoPE, and a local checkpoint's config.json can be edited without a new revision.
  * `~hf:<digest>`: any non-empty `--hf-overrides` (vLLM's `model_config.hf_overrides`), whatever it overrides.
    A dict is digested sorted; a callable cannot be hashed stably, so the config it produced
    (`hf_config.to_dict()`) is digested instead (logged once); if that fails the instance keys privately.
  * `~w:<dtype>`: the weights' dtype when the KV cache dtype is not "auto" and differs from it (fp8 and the
    like): K/V were computed in the weights' dtype, which the stored dtype no longer tells.
  * `~own:<digest>`: KV private to this instance's run: KV scales computed from the first batch
    (`cache_config.calculate_kv_scales`, a flag vLLM 0.32 no longer has: its scales come with the checkpoint,
    covered by name/revision/quantization, or are 1.0), or a callable override that cannot be digested. The
    digest is of `instance_of(...)`: the LMCache instance id, vLLM's per-run `VllmConfig.instance_id` and the
    data-parallel rank, so restarts and replicas, which compute their own scales, never share either.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

log = logging.getLogger(__name__)

DIGEST_BYTES = 6  # 12 hex digits: names a variant among a handful, not a security boundary (keys are blake2b)
FLOAT_NAMES = {"half": "float16", "float": "float32"}  # vLLM's --dtype aliases
_logged: set[str] = set()


def model_identity(name: str, model_config: Any, cache_config: Any = None, instance: str = "") -> str:
    """`name@revision+quantization`, plus a short part per other input that changes this model's K/V."""
    revision = getattr(model_config, "revision", None)
    quantization = getattr(model_config, "quantization", None)
    identity = name + (f"@{revision}" if revision else "") + (f"+{quantization}" if quantization else "")
    private = False
    rope = rope_settings(getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None))
    if rope is not None:
        identity += f"~rope:{digest(rope)}"
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):
        produced = config_dict(getattr(model_config, "hf_config", None))
        if produced is None:
            private = True
            _log_once("callable-private", "--hf-overrides is a callable and the config it produced cannot be "
                      "digested: this instance's KV is keyed for itself only")
        else:
            identity += f"~hf:{digest(produced)}"
            _log_once("callable", "--hf-overrides is a callable: chunk keys mix in a digest of the HF config "
                      "it produced")
    elif overrides:
        identity += f"~hf:{digest(overrides)}"
    cache_dtype = str(getattr(cache_config, "cache_dtype", "auto") or "auto")
    if cache_dtype != "auto":
        weights = dtype_name(getattr(model_config, "dtype", None))
        if weights != cache_dtype:
            identity += f"~w:{weights}"
    if getattr(cache_config, "calculate_kv_scales", False):
        private = True
        _log_once("kv-scales", "calculate_kv_scales: KV scales come from this instance's first batch, so its KV "
                  "is keyed for this run of this instance only")
    if private:
        if not instance:
            raise ValueError("this model's KV is private to its instance, but no instance id was given")
        identity += f"~own:{digest(instance)}"
    return identity


def instance_of(vllm_config: Any, lmcache_instance_id: str) -> str:
    """One vLLM instance's run, the same in its scheduler and every worker (they share the pickled config)."""
    run = getattr(vllm_config, "instance_id", "")  # vLLM sets it per VllmConfig: time.time_ns() or a random id
    dp_rank = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_rank", 0)
    return f"{lmcache_instance_id}/{run}/dp{dp_rank}"


def rope_settings(hf_config: Any) -> dict[str, Any] | None:
    """RoPE settings when a scaling is in effect; None for plain RoPE (or none): those keys stay as they were."""
    if hf_config is None:
        return None
    found = {attr: getattr(hf_config, attr, None) for attr in ("rope_parameters", "rope_scaling", "rope_theta")}
    found = {attr: value for attr, value in found.items() if value is not None}
    params = [found.get("rope_parameters"), found.get("rope_scaling")]
    scaled = any(_scaled(p) for p in params if isinstance(p, dict))
    return found if scaled else None


def _scaled(params: dict[str, Any]) -> bool:
    if any(isinstance(value, dict) for value in params.values()):  # per layer type (transformers' nested form)
        return any(_scaled(value) for value in params.values() if isinstance(value, dict))
    kind = params.get("rope_type", params.get("type"))
    return kind not in (None, "default")


def config_dict(hf_config: Any) -> dict[str, Any] | None:
    try:
        produced = hf_config.to_dict()
        json.dumps(produced, sort_keys=True)  # only plain values digest the same in every process and run
    except Exception:  # noqa: BLE001 - any failure means: no stable digest
        return None
    return produced if isinstance(produced, dict) else None


def dtype_name(dtype: Any) -> str:
    text = str(dtype if dtype is not None else "auto").removeprefix("torch.")
    return FLOAT_NAMES.get(text, text)


def digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=repr)  # repr: values with no JSON form
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).hexdigest()


def _log_once(what: str, message: str) -> None:
    if what not in _logged:
        _logged.add(what)
        log.info(message)
