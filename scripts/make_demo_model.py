#!/usr/bin/env python
"""Build a small Llama-architecture model offline: random (seeded) weights and a BPE tokenizer trained on local text.

No hub access is needed or used. The tokenizer is a byte-level BPE trained with `tokenizers` on text that ships
with every CPython (the language reference prose in `pydoc_data.topics` plus a fixed list of stdlib sources),
saved as a Hugging Face fast tokenizer with bos/eos tokens and a Llama-3-style chat template. The weights are
`LlamaForCausalLM(LlamaConfig(...))` under `torch.manual_seed(seed)`, saved as safetensors.

Two presets have sliding-window attention, for vLLM's hybrid KV cache manager (one KV cache group per kind of
attention) and for connectors that must handle windowed layers; both are served by vLLM's CPU build:
* "hybrid": `Gemma2ForCausalLM`, layers alternate sliding-window (even indices) and full attention
  (`layer_types`), window 128 tokens, so a 2k-token prompt crosses it many times. vLLM makes two KV cache
  groups, a FullAttentionSpec one and a SlidingWindowSpec one. Gemma2's logit soft-capping is off (the
  attention and the final logits are plain), everything else is Gemma2 as transformers builds it.
* "swa": `MistralForCausalLM` with `sliding_window` 128: every layer windowed, one SlidingWindowSpec group.
  Its weights and tokenizer are those of "tiny" (same seed, same shapes), so only the window differs.
* "qwen3next": `Qwen3NextForCausalLM`, three Gated DeltaNet (linear attention) layers and one full-attention
  layer, a 4-expert MoE; bf16 (vLLM's CPU GDN kernels take nothing else). vLLM makes one MambaSpec group per
  linear-attention layer (their recurrent state) and a FullAttentionSpec group.
Both give the same logprobs in vLLM CPU as in transformers (eager attention), window included.
Qwen2/Qwen3 configs with mixed `layer_types` are not usable: vLLM's Qwen2 model refuses them unless
`max_window_layers == num_hidden_layers`, and then applies no per-layer window at all.

One preset is a speculative-decoding draft:
* "eagle": an EAGLE-1 draft head for "tiny": one Llama layer of tiny's shape behind the `fc` that mixes the next
  token's embedding with tiny's hidden state, in the layout vLLM's `EagleLlamaForCausalLM` loads (random
  weights; vLLM puts its layer in tiny's full-attention KV cache group).

One preset takes images, for connectors that must key the KV of image tokens by the image:
* "vision": `Idefics3ForConditionalGeneration`: a tiny SigLIP-like vision tower (128x128 pixels, 8x8 patches,
  hidden 64) whose 256 patch features are pixel-shuffled (scale 2) into 64 image tokens for a "tiny"-sized
  Llama text model. The tokenizer is "tiny"'s plus the Idefics3 special tokens (`<fake_token_around_image>`,
  `<image>`, `<end_of_utterance>`, `<global-img>`); its chat template also takes OpenAI-style content lists and
  puts `<image>` where the image part is, so vLLM places the image between the text parts. The processor
  (`Idefics3Processor` with the PIL `Idefics3ImageProcessorPil`, no image splitting) is saved next to the weights:
  an image becomes `<fake_token_around_image><global-img>` + 64 x `<image>` + `<fake_token_around_image>`.
  Why Idefics3 and not LLaVA: vLLM's llava.py imports its Pixtral support, which imports transformers' Pixtral
  image processor, which needs torchvision; the CPU install has none (the PyPI wheels are CUDA builds whose
  operators do not load with the CPU torch), and Idefics3 needs none.

    python scripts/make_demo_model.py OUTDIR                 # tiny: fast tests (2 layers, hidden 256, fp32)
    python scripts/make_demo_model.py OUTDIR --bench         # benchmarks/ttft.py: 6 layers, hidden 512, bf16
    python scripts/make_demo_model.py OUTDIR --layers 4 --hidden 384 --dtype bfloat16
    python scripts/make_demo_model.py OUTDIR --preset hybrid # Gemma2: sliding-window (128) and full layers, fp32
    python scripts/make_demo_model.py OUTDIR --preset swa    # Mistral: every layer sliding-window (128), fp32
    python scripts/make_demo_model.py OUTDIR --preset vision # Idefics3: images (64 tokens each) + text, fp32
    python scripts/make_demo_model.py OUTDIR --preset qwen3next # Qwen3-Next: 3 GDN + 1 full layer, MoE, bf16
    python scripts/make_demo_model.py OUTDIR --preset eagle  # an EAGLE-1 draft head (one layer) for "tiny"

The same arguments give byte-identical files (checked by `--verify`); a `kvmesh_demo.json` next to the weights
records the arguments, so callers can reuse a built directory when the arguments match (`model_is_current`).

Why float32 for the tiny test model: a random model has nearly flat logits, so greedy decoding flips on the
last-bit differences between a full prefill and a prefill over loaded KV (different GEMM shapes); in float32
those differences are ~1e-6 and the end-to-end tests can demand identical text. The bench model is bfloat16,
the dtype people serve.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"
# A Llama-3-like template: vLLM's chat endpoint renders it and tokenizes without adding special tokens again.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Stdlib sources used as tokenizer training text besides the language reference (relative to the stdlib dir).
CORPUS_SOURCES = ["argparse.py", "dataclasses.py", "functools.py", "inspect.py", "pathlib.py", "shutil.py",
                  "subprocess.py", "textwrap.py", "typing.py", "asyncio/base_events.py", "json/decoder.py",
                  "logging/__init__.py", "http/client.py", "email/message.py", "unittest/case.py"]

PRESETS: dict[str, dict[str, object]] = {
    # fast tests: ~4 MB of weights, vLLM CPU prefill of 2k tokens in well under a second
    "tiny": dict(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=4096,
                 max_positions=8192, dtype="float32"),
    # benchmarks/ttft.py: big enough that prefill of 8k-16k tokens takes seconds on 2 cores
    "bench": dict(layers=6, hidden=512, intermediate=2048, heads=8, kv_heads=2, head_dim=64, vocab=8192,
                  max_positions=32768, dtype="bfloat16"),
    # hybrid KV cache: Gemma2, layers 0 and 2 sliding-window (128 tokens), layers 1 and 3 full attention
    # (`full_every`: every n-th layer is full; 0 makes every layer sliding)
    "hybrid": dict(arch="gemma2", layers=4, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64,
                   vocab=4096, max_positions=8192, dtype="float32", sliding_window=128, full_every=2),
    # pure sliding window: Mistral (a Llama with `sliding_window`), every layer windowed
    "swa": dict(arch="mistral", layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64,
                vocab=4096, max_positions=8192, dtype="float32", sliding_window=128),
    # Gated DeltaNet hybrid: Qwen3-Next, layers 0-2 linear attention (GDN), layer 3 full attention, a small MoE;
    # vLLM makes MambaSpec groups (the recurrent conv + SSM state) and a FullAttentionSpec group. bf16: vLLM's
    # CPU GDN kernels take nothing else (and head dims of 64 or more)
    "qwen3next": dict(arch="qwen3next", layers=4, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64,
                      vocab=4096, max_positions=8192, dtype="bfloat16", full_every=4, linear_heads=4,
                      linear_head_dim=64, experts=4, experts_per_tok=2, moe_intermediate=128),
    # Mamba2 hybrid: Nemotron-H, layers Mamba2 / MLP / Mamba2 / attention / Mamba2 / MLP (vLLM: MambaSpec groups
    # and a FullAttentionSpec group). fp32: vLLM unifies the pages to 256-token blocks, the chunk size, and its
    # CPU Mamba2 path needs every prefill step within one block (--max-num-batched-tokens 256): a longer step
    # fails inside vLLM (`varlen_states[last_chunk_indices_p]`: IndexError) with or without a connector
    "nemotronh": dict(arch="nemotronh", layers=6, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64,
                      vocab=4096, max_positions=8192, dtype="float32", mamba_heads=8, mamba_head_dim=64,
                      ssm_state=64, expand=2, mamba_chunk=64,
                      block_types=["linear_attention", "mlp", "linear_attention", "full_attention",
                                   "linear_attention", "mlp"]),
    # speculative decoding: an EAGLE-1 draft head for "tiny" (one Llama layer of tiny's shape behind `fc`, which
    # mixes the next token's embedding with tiny's hidden state; it borrows tiny's embedding and LM head)
    "eagle": dict(arch="eagle", layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=4096,
                  max_positions=8192, dtype="float32"),
    # images: Idefics3, "tiny"'s text model behind a tiny vision tower; (image_size / patch_size)^2 / scale^2
    # = 64 image tokens per image
    "vision": dict(arch="idefics3", layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64,
                   vocab=4096, max_positions=8192, dtype="float32", image_size=128, patch_size=8, scale_factor=2,
                   vision_layers=2, vision_hidden=64, vision_intermediate=128, vision_heads=2),
}
# "arch" (default "llama"), "sliding_window" and "full_every" appear only in the sliding-window presets' specs, and
# the image keys only in "vision"'s, so the "tiny"/"bench" specs, markers and files are the same as before these
# presets existed.
ARCHS = ("llama", "gemma2", "mistral", "idefics3", "qwen3next", "nemotronh", "eagle")
# The vision preset's special tokens, appended to the tokenizer in this order (ids vocab .. vocab + 3).
VISION_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
# "tiny"'s chat template, except that a content list (vLLM passes OpenAI-style parts through when the template
# iterates over them) renders its text parts in order and `<image>` for each image part.
VISION_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}<image>{% endif %}"
    "{% endfor %}{% endif %}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MARKER_FILE = "kvmesh_demo.json"
FORMAT_VERSION = 1  # bump when the build changes in a way that changes the files


def corpus_text() -> str:
    """Local training text, identical on every machine with the same CPython minor version."""
    from pydoc_data import topics

    parts = [topics.topics[name] for name in sorted(topics.topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for rel in CORPUS_SOURCES:
        path = stdlib / rel
        if path.is_file():
            parts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "\n\n".join(parts)


def long_text(min_chars: int = 200_000) -> str:
    """A long English text for prompts (the language reference), at least `min_chars` characters if possible."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[name] for name in sorted(topics.topics))
    return text if len(text) >= min_chars else (text + "\n\n") * (min_chars // max(1, len(text)) + 1)


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    text = corpus_text()
    lines = [text[i : i + 4096] for i in range(0, len(text), 4096)]
    tokenizer.train_from_iterator(lines, trainer=trainer, length=len(lines))
    bos_id = tokenizer.token_to_id(BOS)
    # like Llama 3: a plain encode() starts with <|begin_of_text|>
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                             special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS,
                                   pad_token="<|end_of_text|>", model_max_length=1 << 30)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def layer_types(spec: dict[str, object]) -> list[str]:
    """Gemma2-style `layer_types`: every `full_every`-th layer full attention, the others sliding-window."""
    every = int(spec.get("full_every", 0))  # type: ignore[arg-type]
    return ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention"
            for i in range(int(spec["layers"]))]  # type: ignore[arg-type]


def _special_ids(tokenizer) -> dict[str, int]:
    ids = tokenizer.convert_tokens_to_ids
    return {"bos_token_id": ids(BOS), "eos_token_id": ids(EOS), "pad_token_id": ids("<|end_of_text|>")}


def _windowed_model(spec: dict[str, object], tokenizer):
    """The model of a preset other than "tiny"/"bench"/"vision" ("gemma2": hybrid layers, "mistral": every layer
    windowed, "qwen3next": GDN hybrid, "nemotronh": Mamba2 hybrid)."""
    arch = spec["arch"]
    common = dict(vocab_size=len(tokenizer), hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                  num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                  num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"],
                  max_position_embeddings=spec["max_positions"], initializer_range=0.02,
                  sliding_window=spec.get("sliding_window"), **_special_ids(tokenizer))
    if arch == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        config = Gemma2Config(**common, layer_types=layer_types(spec), rope_theta=10000.0, rms_norm_eps=1e-6,
                              query_pre_attn_scalar=spec["head_dim"], final_logit_softcapping=None,
                              attn_logit_softcapping=None, tie_word_embeddings=True)
        return Gemma2ForCausalLM(config)
    if arch == "qwen3next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        types = ["linear_attention" if t == "sliding_attention" else t for t in layer_types(spec)]
        config = Qwen3NextConfig(
            **{k: v for k, v in common.items() if k != "sliding_window"}, layer_types=types, rope_theta=10000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=False, linear_num_key_heads=spec["linear_heads"],
            linear_num_value_heads=spec["linear_heads"], linear_key_head_dim=spec["linear_head_dim"],
            linear_value_head_dim=spec["linear_head_dim"], linear_conv_kernel_dim=4,
            num_experts=spec["experts"], num_experts_per_tok=spec["experts_per_tok"],
            moe_intermediate_size=spec["moe_intermediate"], shared_expert_intermediate_size=spec["moe_intermediate"],
            decoder_sparse_step=1, partial_rotary_factor=0.25)
        return Qwen3NextForCausalLM(config)
    if arch == "nemotronh":
        from transformers import NemotronHConfig, NemotronHForCausalLM

        config = NemotronHConfig(
            vocab_size=len(tokenizer), hidden_size=spec["hidden"], layers_block_type=spec["block_types"],
            num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"],
            intermediate_size=spec["intermediate"], mlp_hidden_act="relu2", mamba_num_heads=spec["mamba_heads"],
            mamba_head_dim=spec["mamba_head_dim"], n_groups=1, ssm_state_size=spec["ssm_state"], conv_kernel=4,
            expand=spec["expand"], chunk_size=spec["mamba_chunk"], max_position_embeddings=spec["max_positions"],
            tie_word_embeddings=False, **_special_ids(tokenizer))
        return NemotronHForCausalLM(config)
    if arch == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        config = MistralConfig(**common, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
        return MistralForCausalLM(config)
    raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")


def _text_config(spec: dict[str, object], tokenizer):
    """The Llama config of the "tiny"/"bench" models (and of the vision preset's language model)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
        head_dim=spec["head_dim"], max_position_embeddings=spec["max_positions"], rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.02,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS), eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|end_of_text|>"),
    )


def _build_vision(outdir: Path, spec: dict[str, object], seed: int) -> None:
    """The "vision" preset: Idefics3 weights, its tokenizer (with the image tokens) and its processor."""
    import torch
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor,
                              Idefics3VisionConfig)
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = build_tokenizer(int(spec["vocab"]))  # type: ignore[arg-type]
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    image_size, patch_size, scale = (int(spec[k]) for k in ("image_size", "patch_size",  # type: ignore[call-overload]
                                                             "scale_factor"))
    # one image, never split into tiles: resized so that its longest edge is `image_size`
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": image_size},
                                                max_image_size={"longest_edge": image_size},
                                                do_image_splitting=False)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=(image_size // patch_size) ** 2 // scale**2,
                                  chat_template=VISION_CHAT_TEMPLATE)
    vision = Idefics3VisionConfig(hidden_size=spec["vision_hidden"], intermediate_size=spec["vision_intermediate"],
                                  num_hidden_layers=spec["vision_layers"], num_attention_heads=spec["vision_heads"],
                                  image_size=image_size, patch_size=patch_size, initializer_range=0.02)
    special = _special_ids(tokenizer)
    config = Idefics3Config(vision_config=vision, text_config=_text_config(spec, tokenizer),
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=scale,
                            tie_word_embeddings=False, **special)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(getattr(torch, str(spec["dtype"])))
    model.eval()
    model.save_pretrained(outdir, safe_serialization=True)
    processor.save_pretrained(outdir)  # the tokenizer files too, with the image tokens and the template
    (outdir / MARKER_FILE).write_text(json.dumps(marker(spec, seed), indent=2, sort_keys=True) + "\n")


def _build_eagle(outdir: Path, spec: dict[str, object], seed: int) -> None:
    """The "eagle" preset: an EAGLE-1 draft in the layout vLLM's `EagleLlamaForCausalLM` loads (`fc.weight` and
    `layers.0.*`, no embedding or LM head: vLLM shares the target's), with a plain Llama config.json that vLLM
    wraps as an EAGLE config (`--speculative-config '{"method": "eagle", "model": DIR, ...}'`). Random weights:
    the target verifies every drafted token, so the answers are the target's whatever the draft proposes."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    tokenizer = build_tokenizer(int(spec["vocab"]))  # type: ignore[arg-type]
    tokenizer.save_pretrained(outdir)
    config = _text_config(spec, tokenizer)
    config.architectures = ["LlamaForCausalLM"]  # vLLM names the draft's class after it (EagleLlamaForCausalLM)
    dtype = getattr(torch, str(spec["dtype"]))
    torch.manual_seed(seed)
    layer = LlamaForCausalLM(config).to(dtype).model.layers[0]
    # vLLM's EAGLE layer 0 has no input norm: the input is fc's output
    weights = {f"layers.0.{name}": tensor.contiguous() for name, tensor in layer.state_dict().items()
               if not name.startswith("input_layernorm")}
    hidden = int(spec["hidden"])  # type: ignore[arg-type]
    weights["fc.weight"] = (torch.randn(hidden, 2 * hidden) * config.initializer_range).to(dtype)
    config.save_pretrained(outdir)
    save_file(weights, str(outdir / "model.safetensors"), metadata={"format": "pt"})
    (outdir / MARKER_FILE).write_text(json.dumps(marker(spec, seed), indent=2, sort_keys=True) + "\n")


def build(outdir: Path, spec: dict[str, object], seed: int) -> None:
    import torch
    from transformers import LlamaForCausalLM

    # one thread: the result must not depend on the machine, and the build runs next to other work
    torch.set_num_threads(1)
    outdir.mkdir(parents=True, exist_ok=True)
    if spec.get("arch") == "idefics3":
        _build_vision(outdir, spec, seed)
        return
    if spec.get("arch") == "eagle":
        _build_eagle(outdir, spec, seed)
        return
    tokenizer = build_tokenizer(int(spec["vocab"]))  # type: ignore[arg-type]
    tokenizer.save_pretrained(outdir)
    dtype = getattr(torch, str(spec["dtype"]))
    if spec.get("arch", "llama") != "llama":  # the sliding-window presets; "tiny"/"bench" take the path below
        torch.manual_seed(seed)
        model = _windowed_model(spec, tokenizer).to(dtype)
        model.eval()
        model.save_pretrained(outdir, safe_serialization=True)
        (outdir / MARKER_FILE).write_text(json.dumps(marker(spec, seed), indent=2, sort_keys=True) + "\n")
        return
    config = _text_config(spec, tokenizer)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    model.eval()
    model.save_pretrained(outdir, safe_serialization=True)
    (outdir / MARKER_FILE).write_text(json.dumps(marker(spec, seed), indent=2, sort_keys=True) + "\n")


def marker(spec: dict[str, object], seed: int) -> dict[str, object]:
    return {"format": FORMAT_VERSION, "seed": seed, "spec": spec,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}"}


def model_is_current(outdir: Path, spec: dict[str, object], seed: int) -> bool:
    """True when `outdir` holds a complete build with these arguments (callers skip rebuilding)."""
    path = Path(outdir) / MARKER_FILE
    try:
        return json.loads(path.read_text()) == json.loads(json.dumps(marker(spec, seed))) and (
            Path(outdir) / "model.safetensors").is_file()
    except (OSError, ValueError):
        return False


def ensure_model(outdir: str | os.PathLike[str], preset: str = "tiny", seed: int = 0, **overrides: object) -> Path:
    """Build the model into `outdir` unless an identical build is already there; returns the directory."""
    spec = {**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    path = Path(outdir)
    if not model_is_current(path, spec, seed):
        build(path, spec, seed)
    return path


def digest(outdir: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(outdir.iterdir()):
        if path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--bench", action="store_true", help="the benchmark preset (6 layers, hidden 512, bf16)")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="tiny (default), bench, hybrid, swa, vision, qwen3next, nemotronh or eagle")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--intermediate", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--max-positions", type=int)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--sliding-window", type=int, help="window in tokens (hybrid/swa presets only)")
    parser.add_argument("--full-every", type=int, help="every n-th layer full attention, 0: none (hybrid only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory is current")
    parser.add_argument("--verify", action="store_true", help="build twice and check the files are identical")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.bench and args.preset not in (None, "bench"):
        print("--bench and --preset disagree", file=sys.stderr)
        return 2
    preset = args.preset or ("bench" if args.bench else "tiny")
    overrides = {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads",
                                               "head_dim", "vocab", "max_positions", "dtype")}
    windowed = {k: getattr(args, k) for k in ("sliding_window", "full_every") if getattr(args, k) is not None}
    if any(k not in PRESETS[preset] for k in windowed):
        print(f"--sliding-window/--full-every do not apply to the {preset!r} preset", file=sys.stderr)
        return 2
    overrides.update(windowed)
    spec = {**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    if args.force or not model_is_current(args.outdir, spec, args.seed):
        build(args.outdir, spec, args.seed)
    if args.verify:
        import tempfile

        with tempfile.TemporaryDirectory() as other:
            build(Path(other), spec, args.seed)
            if digest(Path(other)) != digest(args.outdir):
                print("NOT deterministic: a second build differs", file=sys.stderr)
                return 1
    print(json.dumps({"model": str(args.outdir), "digest": digest(args.outdir)[:16], **spec}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
