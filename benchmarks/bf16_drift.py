"""How far the bf16 engine's prompt logits lie from transformers' in float32, per prefill path.

A prefill chunk on CPU takes `PagedAttention._prefill_split` (the chunk over itself with
`is_causal`, the cached past unmasked, merged by log-sum-exp; in bf16 each partial output
comes back rounded before the merge) unless an attention observer is attached, which forces
the masked path (query sub-chunks with additive causal masks). This runs the same random
prompts both ways through `Engine.score` (512-token chunks, so every position past the first
chunk has a merged past) and prints the mean and max |logit difference| and the top-1
agreement with transformers at positions >= 512:

    flock /tmp/kvtier-measure.lock env PYTHONPATH=$PWD/src .venv/bin/python \\
        benchmarks/bf16_drift.py
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from kvtier.engine import Engine, EngineConfig
from kvtier.models import resolve_model_dir


class _NoOpObserver:
    """Sees nothing; attached only so that prefill takes the masked path."""

    needs_weights = False

    def observe(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reference = AutoModelForCausalLM.from_pretrained(
        str(resolve_model_dir(None)), dtype=torch.float32
    ).eval()
    engine = Engine(EngineConfig(dtype="bfloat16", num_threads=args.threads))
    masked = _NoOpObserver()
    for seed in args.seeds:
        generator = torch.Generator().manual_seed(seed)
        prompt = torch.randint(100, 49152, (args.tokens,), generator=generator).tolist()
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
            diff = (got - want).abs()
            agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
            print(
                f"seed {seed} {path:6s}: mean |diff| {diff.mean():.4f}  max {diff.max():.2f}  "
                f"top-1 agreement {100 * agree:.1f}%"
            )


if __name__ == "__main__":
    main()
