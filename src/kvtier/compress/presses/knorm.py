"""Knorm: keep the keys with the smallest L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
EMNLP 2024 (arXiv:2406.11430). Keys with a low norm were observed to receive high attention,
so the norm alone ranks tokens, with no query needed.
"""

from __future__ import annotations

import torch

from kvtier.compress.presses.base import EvictionPress, LayerView


class KnormPress(EvictionPress):
    query_window = 0

    def score(self, view: LayerView, budget: int) -> torch.Tensor:
        return -view.keys.norm(dim=-1)
