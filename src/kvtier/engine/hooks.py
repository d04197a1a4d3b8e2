"""Small explicit interfaces that later parts plug into (presses, tiered store, metrics).

Nothing here patches the engine: the engine calls these at fixed points.

- `AttentionObserver`: sees each layer's attention (eviction presses score tokens from it).
- `BlockCodec`: the stored form of a block when it leaves or re-enters the device pool
  (quantized, pruned, ...); `IdentityCodec` ("full") is the default.
- `BlockEventListener`: block lifecycle (filled / freed / evicted) for the tiered store.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from kvtier.vocab import FULL

FULL_FORM = FULL  # the pool's own dtype, bit for bit


@runtime_checkable
class AttentionObserver(Protocol):
    """Called once per layer per attention call (the decode batch, or one prefill chunk).

    Shapes: `query` [B, num_heads, q_len, head_dim]; `key` [B, num_kv_heads, k_len, head_dim]
    (decode batches are padded to the longest context, `key_lens` [B] gives each real
    length); `attn_weights` [B, num_heads, q_len, k_len] softmax probabilities, exactly zero
    on padded and future positions, or None when `needs_weights` is False. Computing the
    weights costs a materialized attention matrix, so the engine only does it when some
    observer asks.
    """

    needs_weights: bool

    def observe(
        self,
        layer_idx: int,
        request_ids: list[str],
        query: torch.Tensor,
        key: torch.Tensor,
        attn_weights: torch.Tensor | None,
        key_lens: torch.Tensor,
    ) -> None: ...


class BlockCodec(Protocol):
    """Turns a block's full-precision slab into its stored form and back.

    `encode` gets the block as laid out in the pool ([num_layers, 2, block_size, num_kv_heads,
    head_dim]) and returns any tensor payload; `decode` must return a tensor of the given
    shape and dtype. Lossy codecs are fine: the pool records the form each block came from.
    """

    form: str

    def encode(self, block: torch.Tensor) -> torch.Tensor: ...

    def decode(
        self, payload: torch.Tensor, shape: torch.Size, dtype: torch.dtype
    ) -> torch.Tensor: ...


class IdentityCodec:
    """The full-precision form: the payload is a copy of the block."""

    form = FULL_FORM

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        return block.clone()

    def decode(self, payload: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return payload.reshape(shape).to(dtype)


class BlockEventListener(Protocol):
    """Lifecycle of device blocks, as the block pool sees it.

    - `on_block_filled`: a block became full and got its key (its KV is computed, so its
      payload can be copied out from now on).
    - `on_block_freed`: a cached block's refcount dropped to zero; it stays cached and can be
      hit until it is evicted.
    - `on_block_evicted`: a cached block's memory is being reused; its key no longer hits.
      Called before the new owner writes, so a listener may still copy the payload out.

    Every hook does nothing here: a listener subclasses this and overrides the ones it needs.
    """

    def on_block_filled(self, block_id: int, key: bytes) -> None:
        return None

    def on_block_freed(self, block_id: int) -> None:
        return None

    def on_block_evicted(self, block_id: int, key: bytes) -> None:
        return None
