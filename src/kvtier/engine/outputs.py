"""What the engine hands back: per-step deltas, finished generations, scores, stats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvtier.engine.request import RequestMetrics


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta; the last one has finished=True)."""

    request_id: str
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int | None = None
    metrics: RequestMetrics | None = None
    # On the finished output: KV slots and pool bytes (blocks held x bytes per block) the
    # request occupied right after its prompt was prefilled and compressed, measured from
    # the pool. None when the request never completed its prefill.
    kv_tokens_held: int | None = None
    kv_bytes_held: int | None = None


@dataclass
class GenerationOutput:
    request_id: str | None
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int = 0
    num_cached_tokens: int | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None
    kv_tokens_held: int | None = None  # as in RequestOutput
    kv_bytes_held: int | None = None


@dataclass
class ScoreOutput:
    """Logits of every position the engine computed for a prompt (float32, [n, vocab]).

    Row i was computed at position `start_position + i` (it predicts the token after it).
    Positions served from the prefix cache are not recomputed and so have no row:
    `start_position` is the number of prompt tokens found cached.
    """

    logits: torch.Tensor
    start_position: int
    num_cached_tokens: int


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached_idle: int
    kv_usage: float
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found cached
    num_preemptions: int
    num_evictions: int
    num_steps: int
    num_sessions: int = 0  # tracked by the session tracker
    num_sessions_evicted: int = 0  # forgotten to hold its max_sessions
    tiers: dict[str, Any] | None = None  # the tiered connector's stats(), when configured
