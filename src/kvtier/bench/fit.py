"""Refuse, before anything is replayed, a workload whose longest request the engine cannot run.

Such a request fails under every policy alike, so it says nothing about the policies and only
shows as a failed count. Refusing is the default (lengths are never cut silently); the error
names the request, the pool and the smallest `--kv-cache-bytes` that fits, and
`--scale-to-context` shrinks a workload that is too long for the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.bench.replay import prompt_token_ids
from kvtier.errors import KvtierError

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine
    from kvtier.workload.model import Request

_MIB = 1 << 20


def check_fits(
    engine: Engine, requests: Sequence[Request], max_output_tokens: int | None = None
) -> None:
    """Raise KvtierError (one line) unless every prompt fits the model's context and every
    request fits the device pool on its own: its prompt and whole answer (with compression,
    its prompt and first token: the press shrinks the KV after prefill)."""
    context = engine.max_model_len
    # text prompts as the chat template renders them, with the workload's own answers in the
    # history (the engine's answers have the same token counts, give or take a few)
    prompts = [len(prompt_token_ids(engine, request)) for request in requests]
    prompt, longest = max(zip(prompts, requests, strict=True), key=lambda p: p[0])
    if prompt >= context:
        raise KvtierError(
            f"the longest prompt, request {longest.request_id}'s, has {prompt:,} tokens, beyond "
            f"the model's {context:,}-token context; shrink the workload with "
            "--scale-to-context TOKENS"
        )

    def answer(request: Request) -> int:
        if engine.compressor is not None:
            return 1
        tokens = max(1, request.output_tokens)
        return tokens if max_output_tokens is None else min(tokens, max(1, max_output_tokens))

    # the engine ends an answer at the context's end: a length stop, not a failure
    held, prompt, request = max(
        ((min(p + answer(r), context), p, r) for p, r in zip(prompts, requests, strict=True)),
        key=lambda t: t[0],
    )
    pool = engine.kv_pool
    block_size = engine.config.block_size
    blocks = math.ceil(held / block_size)
    if blocks > pool.num_blocks:
        smallest = math.ceil(blocks * pool.bytes_per_block / _MIB)
        raise KvtierError(
            f"the longest request, {request.request_id}, needs {held:,} tokens of KV (prompt "
            f"{prompt:,} + answer {held - prompt:,}) = {blocks:,} blocks, but the "
            f"{engine.config.kv_cache_bytes / _MIB:,.4g} MiB device pool holds "
            f"{pool.num_blocks:,} blocks ({pool.num_blocks * block_size:,} tokens); give "
            f"--kv-cache-bytes {smallest}MiB or more, or shrink the workload with "
            "--scale-to-context TOKENS"
        )
