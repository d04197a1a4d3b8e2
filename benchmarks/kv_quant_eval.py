"""Accuracy of a packed KV pool (EngineConfig.kv_quant) on kvtier eval's tasks, against full
precision and the `kivi` press simulated on a full-precision pool (docs/compression.md).

Same samples, runner and scoring as `kvtier eval`; each pool form is its own engine, since
the storage form is fixed per engine. Prints one row per configuration:
average score, per-task scores, KV bytes held per request, wall time.

    python benchmarks/kv_quant_eval.py --length 1024 --samples 2
"""

import argparse
import time
from dataclasses import replace

from kvtier.engine import Engine
from kvtier.eval.methods import MethodRun
from kvtier.eval.report import summarize
from kvtier.eval.runner import RunnerConfig, make_engine, run_eval
from kvtier.eval.tasks import TASKS, generate_samples

parser = argparse.ArgumentParser()
parser.add_argument("--length", type=int, default=1024)
parser.add_argument("--samples", type=int, default=1)
parser.add_argument("--pools", default="int8,int4")
parser.add_argument("--simulated", default="kivi4", help="kivi presses on the bf16 pool")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

config = RunnerConfig()
full_engine = make_engine(config)
full_config = full_engine.config
samples = generate_samples(full_engine.tokenizer, list(TASKS), [args.length], args.samples, 0)
print(f"{len(samples)} samples ({len(TASKS)} tasks x {args.samples}) at {args.length} tokens")


def report(label: str, engine: Engine, spec: str = "full") -> None:
    started = time.perf_counter()
    result = run_eval(samples, [MethodRun(spec, None, spec)], config, engine)
    (row,) = summarize(result)
    scores = " ".join(f"{task}={score:.0f}" for task, score in row["scores"].items())
    print(
        f"{label}\tavg {row['average']:.1f}\tKV bytes held/request "
        f"{row['kv_bytes_held_mean']:.0f}\twall {time.perf_counter() - started:.0f} s\t{scores}",
        flush=True,
    )


report("full (bf16 pool)", full_engine)
for spec in filter(None, args.simulated.split(",")):
    report(f"{spec} simulated (bf16 pool)", full_engine, spec)
del full_engine
for kv_quant in filter(None, args.pools.split(",")):
    # make_engine's settings (prefix caching off, same budgets), packed pool
    engine = Engine(replace(full_config, kv_quant=kv_quant))
    report(f"pool {kv_quant}", engine)
    del engine
