"""Paged attention over the block pool with `scaled_dot_product_attention`.

Per layer: the step's new K/V are written into their pool slots, then each query attends to
its sequence's blocks. All decodes (one query each) go through ONE padded SDPA call with a
length mask; each prefill chunk is its own call, split along the query axis so that query
rows never multiply against keys that lie in their future (a causal mask alone still pays
for those products).

Grouped-query attention is folded rather than repeated: the query heads sharing a KV head
are stacked along the query axis ([B, kv_heads, group * q_len, D]), so K/V are read once per
KV head instead of being copied `group` times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvtier.engine.hooks import AttentionObserver
from kvtier.engine.kv_pool import KVPool
from kvtier.engine.quant_pool import QuantizedKVPool, WritePlan


@dataclass
class QueryChunk:
    """Rows [start, end) of a prefill span attending to the first `key_len` positions."""

    start: int
    end: int
    key_len: int
    mask: torch.Tensor  # [group * (end - start), key_len] additive (0 / -inf), folded


@dataclass
class PrefillSpan:
    request_id: str
    token_start: int  # rows of the flat batch
    token_end: int
    block_table: torch.Tensor  # [1, num_blocks]
    context_len: int  # keys visible to the span's last query (its position + 1)
    chunks: list[QueryChunk]


@dataclass
class AttentionMetadata:
    """Where a step's tokens live in the pool and what each one attends to.

    Rows of the flat batch: first `num_decodes` single-token sequences, then prefill spans.
    Built once per step by the runner and shared by all layers.
    """

    # Where the new K/V go: from the pool's `plan_writes` (KVPool: a vector index tensor;
    # QuantizedKVPool: a WritePlan), handed back to its `write_slots` untouched.
    slot_index: torch.Tensor | WritePlan
    num_decodes: int = 0
    decode_request_ids: list[str] = field(default_factory=list)
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks], padded
    decode_context_lens: torch.Tensor | None = None  # [B]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * bs] additive
    prefills: list[PrefillSpan] = field(default_factory=list)


class PagedAttention:
    def __init__(
        self, pool: KVPool | QuantizedKVPool, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.observers: list[AttentionObserver] = []

    @property
    def needs_weights(self) -> bool:
        return any(o.needs_weights for o in self.observers)

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [N, heads, D], k/v [N, kv_heads, D] -> attention output [N, heads * D]."""
        self.pool.write_slots(layer, meta.slot_index, k, v)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            key, value = self.pool.gather(layer, meta.decode_block_tables, meta.slot_index)
            q_dec = q[:nd].unsqueeze(1)
            o = self._attend(
                layer,
                meta.decode_request_ids,
                q_dec,
                key,
                value,
                meta.decode_mask,
                meta.decode_context_lens,
            )
            out[:nd] = o[:, 0]
        for span in meta.prefills:
            key, value = self.pool.gather(layer, span.block_table, meta.slot_index)
            # On the host: a per-layer copy to a GPU would synchronise (only observers read it).
            key_lens = torch.tensor([span.context_len])
            for chunk in span.chunks:
                rows = slice(span.token_start + chunk.start, span.token_start + chunk.end)
                o = self._attend(
                    layer,
                    [span.request_id],
                    q[rows].unsqueeze(0),
                    key[:, :, : chunk.key_len],
                    value[:, :, : chunk.key_len],
                    chunk.mask,
                    key_lens,
                )
                out[rows] = o[0]
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _attend(
        self,
        layer: int,
        request_ids: list[str],
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor,
        key_lens: torch.Tensor,
    ) -> torch.Tensor:
        """q [B, L, heads, D]; key/value [B, kv_heads, T, D]; mask folded -> [B, L, heads, D]."""
        b, length = q.shape[:2]
        # [B, L, kv_heads, group, D] -> [B, kv_heads, group * L, D]: head h = kv * group + g.
        qf = q.view(b, length, self.num_kv_heads, self.group, self.head_dim)
        qf = qf.permute(0, 2, 3, 1, 4).reshape(b, self.num_kv_heads, self.group * length, -1)
        weights = None
        if self.needs_weights:
            scores = (qf.float() @ key.float().transpose(-1, -2)) * self.scale
            weights = (scores + mask).softmax(-1)
            o = weights.to(value.dtype) @ value
        else:
            o = F.scaled_dot_product_attention(qf, key, value, attn_mask=mask)
        if self.observers:
            unfolded_q = q.permute(0, 2, 1, 3)
            unfolded_w = None if weights is None else weights.reshape(b, self.num_heads, length, -1)
            for observer in self.observers:
                observer.observe(
                    layer,
                    request_ids,
                    unfolded_q,
                    key,
                    unfolded_w if observer.needs_weights else None,
                    key_lens,
                )
        o = o.view(b, self.num_kv_heads, self.group, length, self.head_dim)
        return o.permute(0, 3, 1, 2, 4).reshape(b, length, self.num_heads, self.head_dim)
