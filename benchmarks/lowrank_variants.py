"""Low-rank variants that method strings cannot name (docs/compression.md, "Low rank"): the
samples of a `kvtier eval` run scored under lowrank without its 4 exact sink tokens, with a
window of 128 exact recent tokens (as KIVI keeps), and with bases calibrated on the eval's
own prose (matched) instead of the separate calibration text.

    python benchmarks/lowrank_variants.py --eval-dir out/eval-lowrank --threads 1
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtier.compress import CompressionConfig, PressSpec
from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.eval.sample import read_jsonl
from kvtier.eval.scoring import score
from kvtier.lowrank.bases import with_fitted_bases

VARIANTS = {
    "lowrank:0.25, no sinks": {"ratio": 0.25, "options": {"sinks": 0}},
    "lowrank:0.5, no sinks": {"ratio": 0.5, "options": {"sinks": 0}},
    "lowrank:0.5 + 128 exact recent": {"ratio": 0.5, "options": {"residual": 128}},
    "lowrank:0.75 + 128 exact recent": {"ratio": 0.75, "options": {"residual": 128}},
    "lowrank:0.5 calibrated on the eval prose": {"ratio": 0.5, "options": {"calibration": "prose"}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--eval-dir", type=Path, default=Path("out/eval-lowrank"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    samples = read_jsonl(args.eval_dir / "samples.jsonl")
    tasks = sorted({s.task for s in samples})
    # the same engine settings as `kvtier eval` (kvtier.eval.runner.make_engine)
    engine = Engine(
        EngineConfig(
            num_threads=args.threads, max_num_batched_tokens=1024, enable_prefix_caching=False
        )
    )
    print("| variant | " + " | ".join(tasks) + " | avg |")
    print("|---|" + "---|" * (len(tasks) + 1))
    for label, spec in VARIANTS.items():
        pipeline = CompressionConfig(presses=[PressSpec(name="lowrank", **spec)])
        engine.set_compression(with_fitted_bases(pipeline))
        outs = engine.generate(
            [s.prompt_token_ids for s in samples],
            [SamplingParams(temperature=0, max_tokens=s.max_tokens) for s in samples],
        )
        scores: dict[str, list[float]] = {t: [] for t in tasks}
        for sample, out in zip(samples, outs, strict=True):
            scores[sample.task].append(score(sample.metric, out.text, sample.answers))
        means = [100 * sum(v) / len(v) for v in scores.values()]
        cells = " | ".join(f"{m:.1f}" for m in means)
        print(f"| {label} | {cells} | {sum(means) / len(means):.1f} |", flush=True)


if __name__ == "__main__":
    main()
