"""The contract every eviction press keeps: scores per (KV head, token) -> kept tokens.

A press sees one layer at a time through a `LayerView` (that layer's keys and values as the
pool holds them, after RoPE; the last queries of the prompt; optionally the attention each
key accumulated during prefill). It returns a score per KV head and token; the shared
`select` keeps the `budget` highest-scoring tokens of each KV head. Every layer and head keeps
the same number of tokens (so a sequence's KV stays one rectangle of slots), but each head may
keep a different set: GQA-aware presses reduce their query heads to their KV head first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvtier.errors import KvtierError


@dataclass
class LayerView:
    """One layer of one sequence, as a press scores it (all float32).

    `keys` / `values` [kv_heads, T, D]; `key_positions` [kv_heads, T] the token position
    each slot holds (ascending); `queries` [kv_heads, group, W, D] the last W prompt queries
    (post-RoPE, query heads folded under their KV head) at `query_positions` [W];
    `attention_sum` [kv_heads, group, T] attention each key received from every prompt
    query the engine computed, or None when no press asked for it.
    """

    layer: int
    keys: torch.Tensor
    values: torch.Tensor
    key_positions: torch.Tensor
    queries: torch.Tensor
    query_positions: torch.Tensor
    attention_sum: torch.Tensor | None
    scale: float

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]

    def window_attention(self, last: int | None = None) -> torch.Tensor:
        """Softmax attention of the last `last` observed queries (all by default) over the
        keys: [kv_heads, group, W, T]. Causal: a query never sees a later position."""
        queries, positions = self.queries, self.query_positions
        if last is not None:
            queries, positions = queries[:, :, -last:], positions[-last:]
        scores = torch.einsum("hgwd,htd->hgwt", queries, self.keys) * self.scale
        future = self.key_positions[:, None, None, :] > positions[None, None, :, None]
        return scores.masked_fill(future, float("-inf")).softmax(-1)


class EvictionPress(ABC):
    """Keeps the highest-scoring tokens of each KV head within a budget.

    Subclasses set how many prompt queries they need (`query_window`), whether they need
    the attention accumulated over the whole prompt (`needs_attention_sum`), and implement
    `score`. `ratio` removes that share of the tokens; `keep_tokens` keeps that many.
    """

    query_window: int = 1
    needs_attention_sum: bool = False

    def __init__(self, ratio: float = 0.0, keep_tokens: int | None = None) -> None:
        if not 0.0 <= ratio < 1.0:
            raise KvtierError(f"compression ratio must be in [0, 1), got {ratio!r}")
        if keep_tokens is not None and keep_tokens < 1:
            raise KvtierError(f"keep_tokens must be positive, got {keep_tokens!r}")
        self.ratio = ratio
        self.keep_tokens = keep_tokens

    def budget(self, num_tokens: int) -> int:
        """Tokens kept per layer and KV head out of `num_tokens` (never fewer than one)."""
        if self.keep_tokens is not None:
            return min(num_tokens, self.keep_tokens)
        return max(1, int(num_tokens * (1.0 - self.ratio)))

    @abstractmethod
    def score(self, view: LayerView, budget: int) -> torch.Tensor:
        """[kv_heads, T] importance of each slot; the `budget` highest are kept."""

    def select(self, view: LayerView, budget: int) -> torch.Tensor:
        """Indices into the view's slots to keep: [kv_heads, budget], ascending."""
        if budget >= view.num_tokens:
            return torch.arange(view.num_tokens).expand(view.keys.shape[0], -1)
        scores = self.score(view, budget)
        return scores.topk(budget, dim=-1).indices.sort(dim=-1).values


def protect_recent(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Scores with the last `count` slots made unevictable (a recent window)."""
    if count > 0:
        scores = scores.clone()
        scores[:, -count:] = float("inf")
    return scores
