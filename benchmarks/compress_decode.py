"""Decode time per token with a compressed cache (docs/compression.md, "What the presses and
the packed pool cost"): median inter-token latency over 32 tokens after a 1,500-token prompt,
median of 3 runs.

Rows are presses on the full-precision pool (one engine, `set_compression`), then packed
pools (`EngineConfig.kv_quant`, one engine each: the storage form is fixed per engine).
`--only-pools` runs the full row and the packed pools only.
"""

import argparse
import statistics
from pathlib import Path

from kvtier.compress import parse_method
from kvtier.engine import Engine, EngineConfig

parser = argparse.ArgumentParser()
parser.add_argument("--only-pools", action="store_true")
args = parser.parse_args()

PRESSES = (
    ("full",)
    if args.only_pools
    else ("full", "snapkv:0.5", "snapkv:0.875", "streaming_llm@256", "kivi4")
)
POOLS = ("int8", "int4", "int2")
BUDGET = 128 << 20
text = Path("/usr/share/common-licenses/GPL-3").read_text()
params = {"temperature": 0, "max_tokens": 33, "ignore_eos": True}


def measure(engine: Engine, label: str) -> None:
    prompt = engine.tokenizer.encode(text)[:1500]
    itl, held = [], None
    for _ in range(3):
        engine.reset_prefix_cache()
        out = engine.generate([prompt], params)[0]
        itl.append(statistics.median(out.metrics.itl_s))
        held = out.kv_bytes_held
    pool = engine.kv_pool
    print(
        f"{label}\tdecode ms/token median of 3 runs: {1000 * statistics.median(itl):.1f}"
        f"\truns: {[round(1000 * x, 1) for x in itl]}\tkv_bytes_held {held}"
        f"\tpool blocks {pool.num_blocks} x {pool.bytes_per_block} B",
        flush=True,
    )


engine = Engine(EngineConfig(kv_cache_bytes=BUDGET, num_threads=1))
for method in PRESSES:
    engine.set_compression(parse_method(method))
    measure(engine, method)
del engine
for kv_quant in POOLS:
    measure(
        Engine(EngineConfig(kv_cache_bytes=BUDGET, num_threads=1, kv_quant=kv_quant)),
        f"pool {kv_quant}",
    )
