"""How far the bf16 engine's prompt logits lie from transformers' in float32, per prefill path.

A prefill chunk on CPU takes `PagedAttention._prefill_split` (the chunk over itself with
`is_causal`, the cached past unmasked, merged by log-sum-exp; in bf16 each partial output
comes back rounded before the merge) unless an attention observer is attached, which forces
the masked path (query sub-chunks with additive causal masks). This runs the same random
prompts both ways through `Engine.score` (512-token chunks, so every position past the first
chunk has a merged past) and prints the mean and max |logit difference| and the top-1
agreement with transformers at positions >= 512:

    env PYTHONPATH=$PWD/src .venv/bin/python \\
        benchmarks/bf16_drift.py
"""

from __future__ import annotations

import argparse

import torch
from drift_common import NoOpObserver, random_prompt, reference_model, report

from kvtier.engine import Engine, EngineConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reference = reference_model()
    engine = Engine(EngineConfig(dtype="bfloat16", num_threads=args.threads))
    masked = NoOpObserver()  # attached: prefill takes the masked path
    for seed in args.seeds:
        prompt = random_prompt(seed, args.tokens)
        with torch.inference_mode():
            want = reference(torch.tensor([prompt])).logits[0, 512:].float()
        for path in ("split", "masked"):
            if path == "masked":
                engine.add_attention_observer(masked)
            engine.reset_prefix_cache()
            (out,) = engine.score([prompt])
            if path == "masked":
                engine.remove_attention_observer(masked)
            got = out.logits[512:]
            report(seed, path, got, want)


if __name__ == "__main__":
    main()
