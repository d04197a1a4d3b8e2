"""The speed cost of deterministic mode: two engines side by side in one process.

The same embedded model, dtype (bf16), threads and token ids; one engine in the default mode,
one with `EngineConfig(deterministic=True)`. Each row of `benchmarks/engine.py` (prefill at
512 and 2,048 tokens, output and decode-only tok/s at 1 / 8 / 32 concurrent sequences, TTFT of
a 1,539-token prompt cold and on a prefix hit) and of its long-context suite (prefill at
8,064 tokens, decode at 8K context) is measured for both engines, repeats alternating between
them, and reported as medians with the ratio deterministic / default (for rates: above 1 is faster).

    .venv/bin/python benchmarks/deterministic.py --out out/deterministic.json [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import KvtierBench, machine_busy_s
from vllm_cpu import (
    CONCURRENCY,
    DECODE_NEW_TOKENS,
    DECODE_PROMPT_LEN,
    LONG_DECODE_NEW_TOKENS,
    LONG_DECODE_PROMPT_LEN,
    LONG_PREFILL_LENGTHS,
    PREFILL_LENGTHS,
    TTFT_PROMPT_LEN,
    make_prompt,
)

from kvtier.engine import Engine, EngineConfig

MODES = ("default", "deterministic")


def rows(bench: KvtierBench, repeat: int) -> dict[str, float]:
    """One measurement of every row for one engine (rates in tok/s, times in ms)."""
    out: dict[str, float] = {}
    for n in (*PREFILL_LENGTHS, LONG_PREFILL_LENGTHS[-1]):
        out[f"prefill_{n}_tok_s"] = n / bench.ttft_s(make_prompt(n, 100 + repeat), cold=True)
    for b in CONCURRENCY:
        prompts = [make_prompt(DECODE_PROMPT_LEN, 1000 + i) for i in range(b)]
        output_rate, decode_rate = bench.concurrent(prompts)
        out[f"decode_{b}_output_tok_s"] = output_rate
        out[f"decode_{b}_decode_only_tok_s"] = decode_rate
    ttft_prompt = make_prompt(TTFT_PROMPT_LEN, 7)
    out["ttft_1539_cold_ms"] = 1000 * bench.ttft_s(ttft_prompt, cold=True)
    out["ttft_1539_prefix_hit_ms"] = 1000 * bench.ttft_s(ttft_prompt, cold=False)
    long_prompt = make_prompt(LONG_DECODE_PROMPT_LEN, 8)
    bench.generate_s(long_prompt, 1, cold=True)  # cached from here on
    steps = bench.generate_s(long_prompt, 1 + LONG_DECODE_NEW_TOKENS, cold=False)
    steps -= bench.generate_s(long_prompt, 1, cold=False)
    out[f"decode_{LONG_DECODE_PROMPT_LEN}_ctx_tok_s"] = LONG_DECODE_NEW_TOKENS / steps
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/deterministic.json"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    started, busy_before = time.perf_counter(), machine_busy_s()
    benches = {
        mode: KvtierBench(
            Engine(
                EngineConfig(
                    num_threads=threads,
                    deterministic=mode == "deterministic",
                    kv_cache_bytes=1 << 30,
                    prefault_kv_pool=False,
                )
            )
        )
        for mode in MODES
    }
    for bench in benches.values():  # warm-up (first-call allocations, kernel builds)
        bench.ttft_s(make_prompt(64, 0), cold=True)
    samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES if repeat % 2 == 0 else reversed(MODES):
            samples[mode].append(rows(benches[mode], repeat))
            print(f"repeat {repeat} {mode} done", flush=True)
    medians = {
        mode: {key: statistics.median(s[key] for s in samples[mode]) for key in samples[mode][0]}
        for mode in MODES
    }
    ratios = {
        key: medians["deterministic"][key] / medians["default"][key] for key in medians["default"]
    }
    elapsed = time.perf_counter() - started
    busy = machine_busy_s()
    result = {
        "command": " ".join(sys.argv),
        "host": platform.processor() or platform.machine(),
        "threads": threads,
        "repeats": args.repeats,
        "decode_new_tokens": DECODE_NEW_TOKENS,
        "wall_s": elapsed,
        "machine_cpu_s": None if busy is None or busy_before is None else busy - busy_before,
        "median": medians,
        "samples": samples,
        "deterministic_over_default": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'row':34} {'default':>10} {'determ.':>10} {'ratio':>7}")
    for key, ratio in ratios.items():
        d, x = medians["default"][key], medians["deterministic"][key]
        print(f"{key:34} {d:10.1f} {x:10.1f} {ratio:7.3f}")


if __name__ == "__main__":
    main()
