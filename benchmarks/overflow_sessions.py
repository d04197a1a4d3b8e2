"""What `spill_steps.py` and `write_through.py` share: one engine on the embedded model whose
device pool is too small for its sessions, the flags that size them, their token histories,
and the off / on table of medians they print and save."""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.engine.llama import LlamaConfig
from kvtier.models import resolve_model_dir

FEW = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def add_arguments(
    parser: argparse.ArgumentParser, *, rounds: int, prompt_tokens: int, pool_tokens: int
) -> None:
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--prompt-tokens", type=int, default=prompt_tokens)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--pool-tokens", type=int, default=pool_tokens)
    parser.add_argument("--chunk-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)


def small_pool_engine(args: argparse.Namespace) -> Engine:
    """The embedded model (bf16) with a pool of `--pool-tokens` tokens of KV."""
    mc = LlamaConfig.from_model_dir(resolve_model_dir(None))
    bytes_per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 2  # bf16 K and V
    return Engine(
        EngineConfig(kv_cache_bytes=args.pool_tokens * bytes_per_token, num_threads=args.threads)
    )


def random_tokens(r: random.Random, count: int) -> list[int]:
    return [r.randrange(1000, 20000) for _ in range(count)]


def histories(r: random.Random, args: argparse.Namespace) -> list[list[int]]:
    """Each session's opening prompt; runs append the answers and the next turns' tokens."""
    return [random_tokens(r, args.prompt_tokens) for _ in range(args.sessions)]


def report(
    args: argparse.Namespace,
    label: str,
    results: Mapping[str, Sequence[Mapping[str, float]]],
    keys: Sequence[str],
    digits: int,
) -> dict[str, dict[str, float]]:
    """Print the setup line and one row of medians per setup; save everything to `--out`."""
    print(
        f"\n{args.sessions} sessions x {args.rounds} rounds, {args.prompt_tokens}-token prompts "
        f"(+{args.turn_tokens}/turn), pool {args.pool_tokens} tokens, {args.chunk_tokens}-token "
        f"chunks, bf16, {args.threads} torch thread(s), medians of {args.repeats}\n"
    )
    print(f"| {label} | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    medians = {}
    for setup, rows in results.items():
        medians[setup] = {k: statistics.median(row[k] for row in rows) for k in keys}
        print(f"| {setup} | " + " | ".join(f"{medians[setup][k]:.{digits}g}" for k in keys) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        saved = vars(args) | {"out": str(args.out)}
        args.out.write_text(
            json.dumps({"args": saved, "runs": results, "medians": medians}, indent=2)
        )
    return medians
