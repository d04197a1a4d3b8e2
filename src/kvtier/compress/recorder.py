"""What presses need from the prefill, recorded as attention runs (an AttentionObserver).

Queries are never stored by the engine, so query-aware presses (SnapKV, TOVA, Scissorhands)
get the last `window` prompt queries of each layer from here; H2O gets the attention each
key accumulated over all prompt queries. Only requests still being prefilled are recorded
(`is_recording`), and a request's records are dropped once it has been compressed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class LayerRecord:
    queries: torch.Tensor  # [kv_heads, group, W, D] float32, last W queries seen
    positions: torch.Tensor  # [W] their positions
    attention_sum: torch.Tensor | None  # [kv_heads, group, T] or None


class PrefillRecorder:
    needs_weights = False  # it computes what it needs from queries and keys itself

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        window: int,
        accumulate: bool,
        is_recording: Callable[[str], bool],
    ) -> None:
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim**-0.5
        self.window = max(window, 1)
        self.accumulate = accumulate
        self.is_recording = is_recording
        self.records: dict[str, dict[int, LayerRecord]] = {}

    def observe(
        self,
        layer_idx: int,
        request_ids: list[str],
        query: torch.Tensor,
        key: torch.Tensor,
        attn_weights: torch.Tensor | None,
        key_lens: torch.Tensor,
    ) -> None:
        for b, request_id in enumerate(request_ids):
            if not self.is_recording(request_id):
                continue
            # Prefill chunks pass exactly their visible keys; decode batches are padded.
            visible = min(key.shape[2], int(key_lens[b]))
            heads, length, dim = query.shape[1], query.shape[2], query.shape[3]
            q = query[b].float().view(self.num_kv_heads, heads // self.num_kv_heads, length, dim)
            positions = torch.arange(visible - length, visible)
            self._record(request_id, layer_idx, q, positions, key[b, :, :visible])

    def _record(
        self,
        request_id: str,
        layer: int,
        q: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
    ) -> None:
        layers = self.records.setdefault(request_id, {})
        old = layers.get(layer)
        if old is not None and old.positions.numel() and old.positions[-1] >= positions[0]:
            old = None  # the request restarted (recompute after preemption)
        queries = q if old is None else torch.cat((old.queries, q), dim=2)
        all_positions = positions if old is None else torch.cat((old.positions, positions))
        attention_sum = None
        if self.accumulate:
            attention_sum = q.new_zeros(q.shape[0], q.shape[1], keys.shape[1])
            if old is not None and old.attention_sum is not None:
                attention_sum[..., : old.attention_sum.shape[-1]] += old.attention_sum
            attention_sum += self._attention(q, positions, keys.float()).sum(dim=2)
        layers[layer] = LayerRecord(
            queries[:, :, -self.window :].contiguous(), all_positions[-self.window :], attention_sum
        )

    def _attention(
        self, q: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """Causal softmax attention [kv_heads, group, L, T] of q over `keys`."""
        scores = torch.einsum("hgld,htd->hglt", q, keys) * self.scale
        future = torch.arange(keys.shape[1])[None, :] > positions[:, None]
        return scores.masked_fill(future, float("-inf")).softmax(-1)

    def take(self, request_id: str) -> dict[int, LayerRecord]:
        return self.records.pop(request_id, {})

    def forget(self, request_id: str) -> None:
        self.records.pop(request_id, None)
