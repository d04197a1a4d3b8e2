"""Scissorhands: keep tokens whose importance persists across recent queries.

Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV
Cache Compression at Test Time", NeurIPS 2023 (arXiv:2305.17118). Over a history window of
the last `history` queries, a key counts as pivotal for a query when it gets more than the
average attention (1 / number of visible keys); tokens pivotal most often are kept, and a
recent window (`recent_share` of the budget) is always kept.
"""

from __future__ import annotations

import torch

from kvtier.compress.presses.base import EvictionPress, LayerView, protect_recent


class ScissorhandsPress(EvictionPress):
    def __init__(
        self,
        ratio: float = 0.0,
        keep_tokens: int | None = None,
        history: int = 128,
        recent_share: float = 0.25,
    ) -> None:
        super().__init__(ratio, keep_tokens)
        self.query_window = history
        self.recent_share = recent_share

    def score(self, view: LayerView, budget: int) -> torch.Tensor:
        weights = view.window_attention()  # [kv_heads, group, W, T]
        visible = (weights > 0).sum(-1, keepdim=True).clamp(min=1)
        pivotal = (weights > 1.0 / visible).float().sum(dim=2).mean(dim=1)  # [kv_heads, T]
        # Ties (same count) go to the more recent token.
        tiebreak = torch.linspace(0.0, 0.5, view.num_tokens)
        return protect_recent(pivotal + tiebreak, int(budget * self.recent_share))
