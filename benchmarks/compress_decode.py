"""Decode time per token with a compressed cache (docs/compression.md, "Decode speed"):
median inter-token latency over 32 tokens after a 1,500-token prompt, median of 3 runs."""

import statistics
from pathlib import Path

from kvtier.compress import parse_method
from kvtier.engine import Engine, EngineConfig

engine = Engine(EngineConfig(kv_cache_bytes=128 << 20, num_threads=1))
text = Path("/usr/share/common-licenses/GPL-3").read_text()
prompt = engine.tokenizer.encode(text)[:1500]
params = {"temperature": 0, "max_tokens": 33, "ignore_eos": True}
for method in ("full", "snapkv:0.5", "snapkv:0.875", "streaming_llm@256", "kivi4"):
    engine.set_compression(parse_method(method))
    itl, held = [], None
    for _ in range(3):
        engine.reset_prefix_cache()
        out = engine.generate([prompt], params)[0]
        itl.append(statistics.median(out.metrics.itl_s))
        held = out.kv_bytes_held
    print(
        f"{method}\tdecode ms/token median of 3 runs: {1000 * statistics.median(itl):.1f}"
        f"\truns: {[round(1000 * x, 1) for x in itl]}\tkv_bytes_held {held}",
        flush=True,
    )
