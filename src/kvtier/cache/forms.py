"""Chunk forms at tier boundaries: a chunk stored in full precision, INT8 or INT4.

A form is how a stored chunk's bytes represent its KV: "full" (the device pool's own dtype,
bit for bit) or a quantized code (`kvtier.compress.codecs`, KIVI's axes per 16-token block:
keys per channel, values per token). The store asks for a form when it puts a chunk into a
tier (`TiersConfig.forms`), on the mover's worker, so the engine thread never encodes; a
restore decodes back to the pool's dtype, on a prefetch worker when the load was prefetched.

Precision only goes down along a chunk's way: a form is never re-encoded to a more precise
one (INT4 stored as INT8 would cost bytes and bring nothing back), so `recode` to a form at
least as precise as the payload's leaves it as it is.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import NamedTuple

import torch

from kvtier.compress.codecs import Int4Codec, Int8Codec, IntCodec, warm_up_fused
from kvtier.tiers import Payload
from kvtier.vocab import FORM_PRECISION as PRECISION
from kvtier.vocab import FULL, INT4, lossiest

__all__ = ["CODECS", "ChunkForms", "Restored", "lossiest"]

CODECS: dict[str, IntCodec] = {codec.form: codec for codec in (Int8Codec(), Int4Codec())}


class Restored(NamedTuple):
    """A chunk back in the pool's dtype, [blocks, *block_shape], and the form it came from."""

    blocks: torch.Tensor
    form: str


class ChunkForms:
    """Encodes chunk payloads of one pool's blocks into a form, and decodes them back.

    A quantized payload keeps the full chunk's dtype and shape ([blocks, *block_shape]) as its
    logical tensor: its bytes are the codec's, so `Payload.tensor()` does not apply to it.
    """

    def __init__(self, block_shape: torch.Size, dtype: torch.dtype) -> None:
        self.block_shape = torch.Size(block_shape)
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")

    def prepare(self, forms: Collection[str]) -> threading.Thread | None:
        """Get ready to decode chunks stored in these forms: the INT4 kernels into bfloat16
        (`compress/fused.py`) compile, or load from numba's cache, on the thread returned
        (a second or less, once per process), not on the first restore's path."""
        if INT4 in forms and self.dtype == torch.bfloat16:
            return warm_up_fused()
        return None

    def recode(self, payload: Payload, form: str) -> Payload:
        """`payload` in `form`, or unchanged when it is already at most as precise (or has no
        bytes: a size-only payload)."""
        if lossiest(payload.form, form) == payload.form or payload.data is None:
            return payload
        restored = self.restore(payload)
        if restored is None:
            raise ValueError(f"cannot read a {payload.form} payload of shape {payload.shape}")
        blocks = restored.blocks
        codes = CODECS[form].encode(blocks.reshape(self._folded(blocks.shape[0])))
        return Payload(codes, codes.numel(), form, self.dtype_name, tuple(blocks.shape))

    def nbytes(self, num_blocks: int, form: str) -> int:
        """Bytes a chunk of `num_blocks` blocks takes in `form`."""
        if form == FULL:
            return num_blocks * self.block_shape.numel() * self.dtype.itemsize
        return CODECS[form].encoded_nbytes(self._folded(num_blocks))

    def restore(self, payload: Payload | None) -> Restored | None:
        """The payload as this pool's blocks, or None when it is not a chunk of them (wrong
        form, dtype, shape or size: a miss, so the caller recomputes)."""
        if payload is None or payload.data is None or payload.form not in PRECISION:
            return None
        shape = tuple(payload.shape)
        if payload.dtype != self.dtype_name or len(shape) != 1 + len(self.block_shape):
            return None
        num_blocks = shape[0]
        if shape[1:] != tuple(self.block_shape) or payload.nbytes != self.nbytes(
            num_blocks, payload.form
        ):
            return None
        if payload.form == FULL:
            return Restored(payload.tensor(), FULL)
        folded = CODECS[payload.form].decode(payload.data, self._folded(num_blocks), self.dtype)
        return Restored(folded.view(num_blocks, *self.block_shape), payload.form)

    def _folded(self, num_blocks: int) -> torch.Size:
        """Blocks folded into the codec's layers axis: each block is coded on its own."""
        layers, *rest = self.block_shape
        return torch.Size((num_blocks * layers, *rest))
