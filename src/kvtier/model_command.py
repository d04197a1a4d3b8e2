"""`kvtier model`: prepare the embedded model and run a short generation smoke test."""

from __future__ import annotations

import argparse
import json
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["prepare", "info", "generate"])
    parser.add_argument("--model", default=None, help="local HF folder (default: embedded SmolLM2)")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")


def run(args: argparse.Namespace) -> int:
    from kvtier.errors import KvtierError
    from kvtier.models.resolve import resolve_model_dir

    if args.max_tokens <= 0:
        raise KvtierError("--max-tokens must be a positive integer")
    started = time.perf_counter()
    model_dir = resolve_model_dir(args.model)
    if args.action == "prepare":
        from kvtier.models.identity import model_digest

        # the digest of its bytes is what names its KV; computed now, not on the first load
        digest = model_digest(model_dir)
        elapsed = time.perf_counter() - started
        print(f"model ready: {model_dir} (digest {digest}, {elapsed:.1f} s)")
        return 0
    if args.action == "info":
        config = json.loads((model_dir / "config.json").read_text())
        keys = (
            "model_type",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "hidden_size",
            "max_position_embeddings",
            "vocab_size",
        )
        print(json.dumps({"path": str(model_dir), **{k: config.get(k) for k in keys}}, indent=2))
        return 0
    return _generate(model_dir, args)


def _generate(model_dir, args: argparse.Namespace) -> int:
    from kvtier.engine import Engine, EngineConfig, SamplingParams

    started = time.perf_counter()
    engine = Engine(EngineConfig(model_dir=model_dir, device=args.device))
    load_s = time.perf_counter() - started
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    started = time.perf_counter()
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    [output] = engine.generate([prompt], greedy)
    gen_s = time.perf_counter() - started
    print(f"prompt: {args.prompt!r}")
    print(f"output: {output.text!r}")
    print(
        f"{engine.device}: load {load_s:.1f} s; {len(output.token_ids)} tokens in {gen_s:.2f} s "
        f"({len(output.token_ids) / gen_s:.1f} tok/s, greedy, prefill included)"
    )
    return 0
