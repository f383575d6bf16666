#!/usr/bin/env python
"""Build PEFT-format LoRA adapters for a model made by scripts/make_demo_model.py, offline and deterministically.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` with the keys PEFT writes,
`base_model.model.model.layers.{i}.self_attn.k_proj.lora_A.weight` ([rank, in]) and `...lora_B.weight`
([out, rank]); the shapes come from the base model's `config.json`. The weights are seeded random numbers
(neither factor is zero, unlike a fresh PEFT adapter), scaled so that the merged update `scaling * B @ A` of each
target has a standard deviation of `strength` times the base weights' (`initializer_range` of the config):
with the default strength the K and V of every layer change clearly and greedy outputs of two adapters differ
from each other and from the base model, while the model stays finite in float32.

    python scripts/make_lora_adapters.py OUTDIR --base MODEL_DIR --seed 1
    python scripts/make_lora_adapters.py OUTDIR --base MODEL_DIR --seed 2 --rank 8 --targets q_proj,v_proj
    python scripts/make_lora_adapters.py OUTDIR --base MODEL_DIR --seed 1 --verify

vLLM (also the CPU build) serves them with `--enable-lora --max-lora-rank 8 --lora-modules a=DIR_A b=DIR_B`;
requests pick one with `"model": "a"`, the base model with the served model name. On the CPU build, give
`--max-loras` at least one more slot than adapters in use (`--max-loras 3` for a and b): its PyTorch LoRA ops
index the adapter slots with the "no LoRA" marker -1, i.e. the last slot, so a base-model request batched with
LoRA requests gets the adapter in the last slot applied when that slot is filled (vllm-project/vllm#48421).

The same arguments (and the same base config) give byte-identical files; a `kvmesh_lora.json` next to them
records the arguments and the base shapes, so `ensure_lora_adapter` skips rebuilding a current directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, however this script is loaded
from make_demo_model import digest  # noqa: E402  (one digest of a directory for both builders)

MARKER_FILE = "kvmesh_lora.json"
FORMAT_VERSION = 1  # bump when the build changes in a way that changes the files
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
DEFAULT_STRENGTH = 1.0


def base_shapes(base_model_dir: str | os.PathLike[str]) -> dict[str, int | float]:
    """The dimensions of the base model that fix the adapter's shapes (from its config.json)."""
    config = json.loads((Path(base_model_dir) / "config.json").read_text())
    config = config.get("text_config", config)  # multimodal-style configs nest the language model's
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    return {"layers": int(config["num_hidden_layers"]), "hidden": hidden, "heads": heads,
            "kv_heads": int(config.get("num_key_value_heads") or heads), "head_dim": int(head_dim),
            "intermediate": int(config["intermediate_size"]),
            "initializer_range": float(config.get("initializer_range", 0.02))}


def target_shape(shapes: dict[str, int | float], target: str) -> tuple[int, int]:
    """(in_features, out_features) of one target module."""
    hidden, q_out = int(shapes["hidden"]), int(shapes["heads"]) * int(shapes["head_dim"])
    kv_out, inter = int(shapes["kv_heads"]) * int(shapes["head_dim"]), int(shapes["intermediate"])
    table = {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
             "o_proj": (q_out, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
             "down_proj": (inter, hidden)}
    if target not in table:
        raise ValueError(f"unsupported LoRA target {target!r}; choose from {sorted(table)}")
    return table[target]


def module_prefix(layer: int, target: str) -> str:
    block = "self_attn" if target in ATTENTION_TARGETS else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{target}"


def _generator(seed: int, layer: int, target: str):
    """An independent stream per (seed, layer, target): adding a target leaves the others' weights alone."""
    import torch

    sub = int.from_bytes(hashlib.sha256(f"kvmesh-lora:{seed}:{layer}:{target}".encode()).digest()[:8], "little")
    return torch.Generator(device="cpu").manual_seed(sub & ((1 << 63) - 1))


def adapter_config(rank: int, targets: tuple[str, ...]) -> dict[str, object]:
    return {
        "alpha_pattern": {}, "base_model_name_or_path": None, "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "layers_pattern": None, "layers_to_transform": None,
        "lora_alpha": 2 * rank, "lora_dropout": 0.0, "modules_to_save": None, "peft_type": "LORA", "r": rank,
        "rank_pattern": {}, "revision": None, "target_modules": sorted(targets), "task_type": "CAUSAL_LM",
        "use_dora": False, "use_rslora": False,
    }


def build(outdir: Path, shapes: dict[str, int | float], seed: int, rank: int, targets: tuple[str, ...],
          strength: float) -> None:
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    outdir.mkdir(parents=True, exist_ok=True)
    config = adapter_config(rank, targets)
    scaling = float(config["lora_alpha"]) / rank  # type: ignore[arg-type]
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(shapes["layers"])):
        for target in sorted(targets):
            fan_in, fan_out = target_shape(shapes, target)
            gen = _generator(seed, layer, target)
            # A ~ N(0, 1/in) keeps x @ A.T at the scale of x; B is sized so that scaling * B @ A has
            # std = strength * initializer_range, i.e. the update is as large as the base weight times strength.
            a = torch.randn(rank, fan_in, generator=gen, dtype=torch.float32) / fan_in ** 0.5
            b_std = strength * float(shapes["initializer_range"]) / (scaling * (rank / fan_in) ** 0.5)
            b = torch.randn(fan_out, rank, generator=gen, dtype=torch.float32) * b_std
            prefix = module_prefix(layer, target)
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    save_file(dict(sorted(tensors.items())), str(outdir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (outdir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (outdir / MARKER_FILE).write_text(
        json.dumps(marker(shapes, seed, rank, targets, strength), indent=2, sort_keys=True) + "\n")


def marker(shapes: dict[str, int | float], seed: int, rank: int, targets: tuple[str, ...],
           strength: float) -> dict[str, object]:
    return {"format": FORMAT_VERSION, "seed": seed, "rank": rank, "targets": sorted(targets),
            "strength": strength, "base": shapes}


def adapter_is_current(outdir: Path, shapes: dict[str, int | float], seed: int, rank: int,
                       targets: tuple[str, ...], strength: float) -> bool:
    path = Path(outdir) / MARKER_FILE
    try:
        return (json.loads(path.read_text()) == json.loads(json.dumps(marker(shapes, seed, rank, targets, strength)))
                and (Path(outdir) / "adapter_model.safetensors").is_file()
                and (Path(outdir) / "adapter_config.json").is_file())
    except (OSError, ValueError):
        return False


def ensure_lora_adapter(outdir: str | os.PathLike[str], base_model_dir: str | os.PathLike[str], seed: int,
                        rank: int = 8, targets: tuple[str, ...] | list[str] = ATTENTION_TARGETS,
                        strength: float = DEFAULT_STRENGTH) -> Path:
    """Write a seeded PEFT LoRA adapter for `base_model_dir` into `outdir` unless an identical one is there."""
    targets = tuple(targets)
    for target in targets:
        target_shape({"hidden": 1, "heads": 1, "kv_heads": 1, "head_dim": 1, "intermediate": 1}, target)
    shapes = base_shapes(base_model_dir)
    path = Path(outdir)
    if not adapter_is_current(path, shapes, seed, rank, targets, strength):
        build(path, shapes, seed, rank, targets, strength)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--base", type=Path, required=True, help="the base model directory (its config.json)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default=",".join(ATTENTION_TARGETS),
                        help="comma-separated module names (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")
    parser.add_argument("--strength", type=float, default=DEFAULT_STRENGTH,
                        help="std of the merged update relative to the base weights' initializer_range")
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory is current")
    parser.add_argument("--verify", action="store_true", help="build twice and check the files are identical")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    if args.force:
        build(args.outdir, base_shapes(args.base), args.seed, args.rank, targets, args.strength)
    ensure_lora_adapter(args.outdir, args.base, args.seed, args.rank, targets, args.strength)
    if args.verify:
        import tempfile

        with tempfile.TemporaryDirectory() as other:
            build(Path(other), base_shapes(args.base), args.seed, args.rank, targets, args.strength)
            if digest(Path(other)) != digest(args.outdir):
                print("NOT deterministic: a second build differs", file=sys.stderr)
                return 1
    print(json.dumps({"adapter": str(args.outdir), "digest": digest(args.outdir)[:16], "seed": args.seed,
                      "rank": args.rank, "targets": sorted(targets), "strength": args.strength}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
