#!/usr/bin/env python
"""The disk-offload setup's query-twice: the same long prompt twice against a vLLM server; prints cold and warm TTFT.

    python scripts/query_twice.py --base-url http://localhost:8000/v1 [--context-file man-bash.txt]

The long context is `--context-file` (LMCache's example uses `man bash > man-bash.txt`), else the Python language
reference that ships with CPython. It is cut to fit the server's max_model_len (`--max-prompt-tokens` to cut
further). Streaming chat completion as in the seed; temperature 0 by default so both answers can be compared.
With `--json PATH` the numbers are also written as JSON. Exit status 0 unless a request fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

QUESTION = "Summarize this text in 2 sentences."


def default_context() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_demo_model import long_text

    return long_text()


def fit_context(context: str, tokenizer: object, max_tokens: int) -> tuple[str, int]:
    """The longest prefix of `context` whose prompt (with the question and chat template) fits `max_tokens`."""
    ids = tokenizer.encode(context, add_special_tokens=False)  # type: ignore[attr-defined]
    budget = max_tokens - len(tokenizer.encode(QUESTION, add_special_tokens=False)) - 32  # type: ignore[attr-defined]
    if len(ids) > budget:
        context = tokenizer.decode(ids[:budget])  # type: ignore[attr-defined]
    prompt = f"{context}\n\n{QUESTION}"
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    return prompt, len(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]


def query_and_measure_ttft(client: object, model: str, prompt: str, temperature: float,
                           max_tokens: int) -> tuple[float, str]:
    start = time.perf_counter()
    ttft = None
    text = []
    stream = client.chat.completions.create(  # type: ignore[attr-defined]
        messages=[{"role": "user", "content": prompt}], model=model, temperature=temperature,
        max_tokens=max_tokens, stream=True)
    for chunk in stream:
        if not chunk.choices:
            continue
        piece = chunk.choices[0].delta.content
        if piece:
            if ttft is None:
                ttft = time.perf_counter()
            text.append(piece)
            print(piece, end="", flush=True)
    print("\n")
    end = time.perf_counter()
    return (ttft or end) - start, "".join(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://localhost:8000/v1")
    parser.add_argument("--context-file", type=Path, help="long text (default: the Python language reference)")
    parser.add_argument("--max-prompt-tokens", type=int, help="cut the prompt to this many tokens")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--salt", default="", help="text put before the context (a fresh prefix = a cold cache)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    import httpx
    from openai import OpenAI
    from transformers import AutoTokenizer

    client = OpenAI(api_key="dummy-key", base_url=args.base_url)
    models = client.models.list()
    model = models.data[0].id
    card = httpx.get(f"{args.base_url.rstrip('/')}/models", timeout=10).json()["data"][0]
    max_model_len = int(card.get("max_model_len") or 4096)
    tokenizer = AutoTokenizer.from_pretrained(card.get("root") or model)
    context = args.context_file.read_text(errors="replace") if args.context_file else default_context()
    if args.salt:
        context = f"{args.salt}\n{context}"
    limit = min(args.max_prompt_tokens or max_model_len, max_model_len - args.max_tokens - 8)
    prompt, num_tokens = fit_context(context, tokenizer, limit)
    print(f"Number of tokens in prompt: {num_tokens}")

    print("Querying vLLM server with a cold KVMesh cache")
    cold_ttft, cold_text = query_and_measure_ttft(client, model, prompt, args.temperature, args.max_tokens)
    print(f"Cold TTFT: {cold_ttft:.3f} seconds")
    print("\nQuerying vLLM server with a warm KVMesh cache")
    warm_ttft, warm_text = query_and_measure_ttft(client, model, prompt, args.temperature, args.max_tokens)
    print(f"Warm TTFT: {warm_ttft:.3f} seconds")
    print(f"\nTTFT Improvement: {(cold_ttft - warm_ttft):.3f} seconds ({(cold_ttft / warm_ttft):.1f}x faster)")
    same = cold_text == warm_text
    if args.temperature == 0:
        print(f"Greedy outputs identical: {same}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": model, "prompt_tokens": num_tokens, "cold_ttft_s": cold_ttft,
                                         "warm_ttft_s": warm_ttft, "speedup": cold_ttft / warm_ttft,
                                         "same_output": same}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
