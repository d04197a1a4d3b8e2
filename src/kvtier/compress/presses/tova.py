"""TOVA: Token Omission Via Attention - keep the tokens the last query attends to most.

Oren et al., "Transformers are Multi-State RNNs", 2024 (arXiv:2401.06104). The score is the
last token's attention averaged over all heads, so every head keeps the same tokens (the
paper's head-averaged policy); the last token itself is always kept.
"""

from __future__ import annotations

import torch

from kvtier.compress.presses.base import EvictionPress, LayerView, protect_recent


class TOVAPress(EvictionPress):
    query_window = 1

    def score(self, view: LayerView, budget: int) -> torch.Tensor:
        weights = view.window_attention(last=1)[:, :, -1]  # [kv_heads, group, T]
        # Head-averaged needs one key set; with per-head sets (after an earlier per-head
        # press) each KV head averages over its own group instead.
        if _same_tokens_in_every_head(view):
            weights = weights.mean(dim=(0, 1)).expand(view.keys.shape[0], -1)
        else:
            weights = weights.mean(dim=1)
        return protect_recent(weights, 1)


def _same_tokens_in_every_head(view: LayerView) -> bool:
    return bool((view.key_positions == view.key_positions[:1]).all())
