"""How far the bf16 engine's DECODE logits lie from transformers' in float32, per decode path.

With `EngineConfig.paged_decode`, decodes on CPU read K/V straight from the pool
(`engine/paged_decode.py`) unless an attention observer is attached, which forces the gather
+ padded SDPA path. This generates greedily from the same random prompts both ways,
records the logits of every decode step (the runner's `StepResult`), and compares them with
transformers' float32 logits at the same positions of the same token sequence (teacher
forced: each path is held against the reference on the tokens it generated). Prints the mean
and max |logit difference| and the top-1 agreement:

    env PYTHONPATH=$PWD/src .venv/bin/python \\
        benchmarks/decode_drift.py
"""

from __future__ import annotations

import argparse

import torch
from drift_common import NoOpObserver, random_prompt, reference_model, report

from kvtier.engine import Engine, EngineConfig, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1500, help="prompt length")
    parser.add_argument("--decodes", type=int, default=48, help="tokens generated per prompt")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reference = reference_model()
    engine = Engine(EngineConfig(dtype="bfloat16", num_threads=args.threads, paged_decode=True))
    steps: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording(*a, **k):
        result = execute(*a, **k)
        if len(result.logits):  # prefill chunks before the last sample nothing
            steps.append(result.logits[0].clone())
        return result

    engine.runner.execute = recording
    gather_path = NoOpObserver()  # attached: decodes take the gather + SDPA path
    greedy = SamplingParams(temperature=0, max_tokens=args.decodes, ignore_eos=True)
    for seed in args.seeds:
        prompt = random_prompt(seed, args.tokens)
        for path in ("kernel", "gather"):
            if path == "gather":
                engine.add_attention_observer(gather_path)
            engine.reset_prefix_cache()
            steps.clear()
            (out,) = engine.generate([prompt], greedy)
            if path == "gather":
                engine.remove_attention_observer(gather_path)
            got = torch.stack(steps[-(args.decodes - 1) :])  # the decode steps
            tokens = prompt + out.token_ids[:-1]
            with torch.inference_mode():
                want = reference(torch.tensor([tokens])).logits[0, args.tokens :].float()
            report(seed, path, got, want, f"  ({len(got)} decodes)")


if __name__ == "__main__":
    main()
