"""SnapKV: score tokens by the attention of an observation window at the end of the prompt.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024
(arXiv:2404.14469). The last `window` prompt queries (where the question sits) vote for the
tokens they attend to; votes are average-pooled along the sequence (`kernel_size`) so a
selected token brings its neighbours, and GQA query heads are averaged under their KV head.
The observation window itself is always kept. Applied after the whole prompt is prefilled,
so the question has been seen (query-aware). Defaults: a 16-query window and max pooling;
on SmolLM2 a 64- or 32-query window let the prose before the question outvote it and lost
passkey digits at ratio 0.5 (docs/compression.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtier.compress.presses.base import EvictionPress, LayerView, protect_recent
from kvtier.errors import KvtierError


class SnapKVPress(EvictionPress):
    def __init__(
        self,
        ratio: float = 0.0,
        keep_tokens: int | None = None,
        window: int = 16,
        kernel_size: int = 5,
        pooling: str = "max",
    ) -> None:
        super().__init__(ratio, keep_tokens)
        if pooling not in ("max", "avg"):
            raise KvtierError(f"snapkv pooling must be 'max' or 'avg', got {pooling!r}")
        self.query_window = window
        self.kernel_size = kernel_size
        self.pooling = pooling

    def score(self, view: LayerView, budget: int) -> torch.Tensor:
        votes = view.window_attention().sum(dim=2).mean(dim=1)  # [kv_heads, T]
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        pooled = pool(votes[:, None], self.kernel_size, stride=1, padding=self.kernel_size // 2)
        pooled = pooled[:, 0, : votes.shape[-1]]
        # The window is never scored against itself: it is kept while budget allows.
        observed = min(view.queries.shape[2], view.num_tokens)
        return protect_recent(pooled, min(observed, budget))
