"""Fit a low-rank KV basis on the keys and values an engine computes for a calibration text.

One prefill with a block listener: every block the engine fills is read from the pool and
fed to a `MomentAccumulator` (kvtier.compress.lowrank), so the calibration KV is never held
in full. The basis and its arithmetic live in compress; running the model to get the KV is
this calibration step, above the engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from importlib import resources
from typing import Any

import torch

from kvtier.compress.lowrank import LowRankBasis, MomentAccumulator
from kvtier.engine import Engine, SamplingParams
from kvtier.errors import KvtierError


def calibration_text(name: str) -> str:
    """A calibration text by name: a file of `kvtier/data/calibration/`, or "prose" for the
    packaged prose that `kvtier eval` builds its haystacks from (a matched calibration)."""
    if name == "prose":
        folder = resources.files("kvtier") / "data" / "text"
        names = sorted(i.name for i in folder.iterdir() if i.name.endswith(".txt"))
        return "\n".join((folder / n).read_text(encoding="utf-8") for n in names)
    folder = resources.files("kvtier") / "data" / "calibration"
    known = sorted(i.name.removesuffix(".txt") for i in folder.iterdir() if i.name.endswith(".txt"))
    if name not in known:
        raise KvtierError(
            f"lowrank: unknown calibration text {name!r}; known: {', '.join([*known, 'prose'])}"
        )
    return (folder / f"{name}.txt").read_text(encoding="utf-8")


def calibration_tokens(tokenizer: Any, text: str, num_tokens: int) -> list[int]:
    """The text's token ids, repeated (a newline between copies) up to `num_tokens`."""
    ids = tokenizer.encode(text.strip() + "\n\n", add_special_tokens=False)
    return (ids * math.ceil(num_tokens / len(ids)))[:num_tokens]


class _BlockReader:
    """A `BlockEventListener` handing the KV of every block the engine fills to `take`, in
    token order."""

    def __init__(self, engine: Engine, take: Callable[[torch.Tensor], None]) -> None:
        self.pool, self.take = engine.kv_pool, take

    def on_block_filled(self, block_id: int, key: bytes) -> None:
        self.take(self.pool.read_block(block_id))

    def on_block_freed(self, block_id: int) -> None:
        pass

    def on_block_evicted(self, block_id: int, key: bytes) -> None:
        pass


def _prefill_with(
    engine: Engine, token_ids: list[int], take: Callable[[torch.Tensor], None]
) -> None:
    """One prefill of `token_ids`, handing the KV of every block it fills to `take`.

    The engine must cache prefixes (full blocks are read as they are registered), run no
    compression and be idle; its prefix cache is reset first so every block is computed, and
    after (the prefix is of no use to anyone)."""
    if not engine.config.enable_prefix_caching:
        raise KvtierError("lowrank calibration needs an engine with prefix caching on")
    if engine.config.compression is not None and not engine.config.compression.is_identity:
        raise KvtierError("lowrank calibration needs an engine without compression")
    if engine.has_unfinished_requests():
        raise KvtierError("lowrank calibration needs an idle engine")
    reader = _BlockReader(engine, take)
    engine.reset_prefix_cache()
    engine.add_block_listener(reader)
    try:
        [out] = engine.generate([token_ids], SamplingParams(temperature=0, max_tokens=1))
    finally:
        engine.remove_block_listener(reader)
    if out.finish_reason == "error":
        raise KvtierError(f"lowrank calibration failed: {out.error}")
    engine.reset_prefix_cache()


def prompt_kv(engine: Engine, token_ids: list[int]) -> torch.Tensor:
    """[layers, 2, kv_heads, tokens, head_dim] the engine computes for `token_ids`, whole
    blocks only (for measuring how well a basis fits real KV)."""
    blocks: list[torch.Tensor] = []
    _prefill_with(engine, token_ids, blocks.append)
    return torch.cat(blocks, dim=3)


def fit_basis(engine: Engine, token_ids: list[int], grouping: str = "layer") -> LowRankBasis:
    """Fit bases on the KV `engine` computes for `token_ids` (one prefill, see `_prefill_with`
    for what the engine must be)."""
    pool = engine.kv_pool
    moments = MomentAccumulator(pool.num_layers, pool.num_kv_heads, pool.head_dim, grouping)
    _prefill_with(engine, token_ids, moments.add)
    return moments.basis()
