"""Passkey retrieval under each press at ratio 0.5 (docs/compression.md, "What the presses and
the packed pool cost"): one prompt per needle depth, greedy; prints the answer, tokens and pool
bytes held."""

from pathlib import Path

from kvtier.compress import CompressionConfig, PressSpec, parse_method
from kvtier.engine import Engine, EngineConfig

engine = Engine(EngineConfig(kv_cache_bytes=64 << 20))
text = Path("/usr/share/common-licenses/GPL-3").read_text()
methods = [
    "full",
    "snapkv:0.5",
    "tova:0.5",
    "knorm:0.5",
    "streaming_llm:0.5",
    "h2o:0.5",
    "scissorhands:0.5",
]
kvpress_like = PressSpec(name="snapkv", ratio=0.5, options={"window": 64, "pooling": "avg"})
for depth in (600, 2000, 3400):
    prompt = (
        text[:depth]
        + "\n\nThe pass key is 71432. Remember it.\n"
        + text[depth:4000]
        + "\nWhat is the pass key? The pass key is"
    )
    for method in [*methods, "snapkv:0.5 window 64 avg"]:
        config = (
            CompressionConfig(presses=[kvpress_like]) if "avg" in method else parse_method(method)
        )
        engine.set_compression(config)
        engine.reset_prefix_cache()
        out = engine.generate([prompt], {"temperature": 0, "max_tokens": 6})[0]
        print(
            depth,
            out.num_prompt_tokens,
            method,
            repr(out.text),
            out.kv_tokens_held,
            out.kv_bytes_held,
            sep="\t",
            flush=True,
        )
