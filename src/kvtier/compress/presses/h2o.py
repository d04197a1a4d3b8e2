"""H2O: Heavy-Hitter Oracle - keep the tokens with the largest accumulated attention.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023 (arXiv:2306.14048). Each key's attention summed over every prompt
query it was visible to ranks the "heavy hitters"; half the budget (`recent_share`) goes to
the most recent tokens, as in the paper.
"""

from __future__ import annotations

import torch

from kvtier.compress.presses.base import EvictionPress, LayerView, protect_recent
from kvtier.errors import KvtierError


class H2OPress(EvictionPress):
    query_window = 0
    needs_attention_sum = True

    def __init__(
        self, ratio: float = 0.0, keep_tokens: int | None = None, recent_share: float = 0.5
    ) -> None:
        super().__init__(ratio, keep_tokens)
        if not 0.0 <= recent_share <= 1.0:
            raise KvtierError(f"h2o recent_share must be in [0, 1], got {recent_share!r}")
        self.recent_share = recent_share

    def score(self, view: LayerView, budget: int) -> torch.Tensor:
        if view.attention_sum is None:
            raise KvtierError("h2o needs the prompt's accumulated attention; none was recorded")
        accumulated = view.attention_sum.mean(dim=1)  # GQA: average the group per KV head
        return protect_recent(accumulated, int(budget * self.recent_share))
