"""Quantized block codecs for tier boundaries: a block leaves the device as INT8 / INT4.

A `BlockCodec` (kvtier.engine.hooks) turns one pool block [layers, 2, kv_heads, block_size,
head_dim] into a payload and back. These follow KIVI's axes (see `quant.py`): keys are
quantized per channel over the block's tokens, values per token over `value_group` channels.
The payload is one flat uint8 tensor (codes, then float16 minimums and steps), so a tier
stores and moves it like any other bytes; a demoted block costs about 1/3.6 (INT4) or 1/1.9
(INT8) of its bfloat16 size. Any number of blocks can be coded at once by folding them into
the leading (layers) axis: [blocks * layers, 2, kv_heads, block_size, head_dim].
"""

from __future__ import annotations

import math
import threading

import torch

from kvtier.compress.quant import Quantized, check_bits, dequantize_into, quantize
from kvtier.errors import KvtierError

# (dtype, shape) of the codes, minimums and steps of one quantized half (K or V)
_Layout = list[tuple[torch.dtype, tuple[int, ...]]]


class IntCodec:
    def __init__(self, bits: int, value_group: int = 64) -> None:
        check_bits(bits)
        self.bits = bits
        self.value_group = value_group
        self.form = f"int{bits}"

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        keys, values = block[:, 0], block[:, 1]  # [layers, heads, tokens, head_dim]
        parts = [
            quantize(keys, self.bits, keys.shape[2], dim=2),  # per channel, along tokens
            quantize(values, self.bits, min(self.value_group, values.shape[3]), dim=3),
        ]
        flat = []
        for q in parts:
            flat += [q.codes.reshape(-1), q.minimum.reshape(-1).view(torch.uint8)]
            flat.append(q.step.reshape(-1).view(torch.uint8))
        return torch.cat(flat)

    def decode(self, payload: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        keys, values = self.halves(payload, shape)
        out = torch.empty(shape, dtype=dtype)
        if self.bits == 4:
            from kvtier.compress import fused  # numba: imported by the first INT4 decode only

            if fused.fits(keys, values, out):
                fused.decode_into(keys, values, out)
                return out
        dequantize_into(keys, out[:, 0])
        dequantize_into(values, out[:, 1])
        return out

    def halves(self, payload: torch.Tensor, shape: torch.Size) -> tuple[Quantized, Quantized]:
        """The keys' and the values' codes, minimums and steps: views of `payload`."""
        if payload.numel() != self.encoded_nbytes(shape):
            raise KvtierError(
                f"{self.form} payload of {payload.numel()} bytes does not hold a block of "
                f"shape {tuple(shape)} ({self.encoded_nbytes(shape)} bytes)"
            )
        layers, _, heads, tokens, dim = shape
        half = torch.Size((layers, heads, tokens, dim))
        offset = 0
        halves = []
        for group, axis in self._groupings(shape):
            pieces = []
            for piece_dtype, piece_shape in self._layout(half, group, axis):
                nbytes = math.prod(piece_shape) * torch.empty((), dtype=piece_dtype).element_size()
                raw = payload[offset : offset + nbytes]
                pieces.append(raw.view(piece_dtype).reshape(piece_shape))
                offset += nbytes
            halves.append(
                Quantized(*pieces, bits=self.bits, dim=axis, length=half[axis], shape=half)
            )
        keys, values = halves
        return keys, values

    def encoded_nbytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        """Bytes `encode` returns for a block (or folded blocks) of this shape."""
        layers, _, heads, tokens, dim = shape
        half = (layers, heads, tokens, dim)
        return sum(
            math.prod(piece_shape) * torch.empty((), dtype=piece_dtype).element_size()
            for group, axis in self._groupings(shape)
            for piece_dtype, piece_shape in self._layout(half, group, axis)
        )

    def _groupings(self, shape: torch.Size | tuple[int, ...]) -> list[tuple[int, int]]:
        """(group size, axis of the half) for keys, then values: see `encode`."""
        return [(shape[3], 2), (min(self.value_group, shape[4]), 3)]

    def _layout(self, half: tuple[int, ...], group: int, axis: int) -> _Layout:
        """What `quantize(x of shape half, bits, group, axis)` returns, without running it."""
        moved = [n for i, n in enumerate(half) if i != axis]
        groups = -(-half[axis] // group)
        return [
            (torch.uint8, (*moved, groups, group * self.bits // 8)),
            (torch.float16, (*moved, groups, 1)),
            (torch.float16, (*moved, groups, 1)),
        ]


def warm_up_fused() -> threading.Thread:
    """Import `fused` (compiling the INT4 kernels, or loading them from numba's cache: about a
    second, or a fraction of one) on a daemon thread, so a restore that decodes INT4 does not
    wait for it: a connector whose tiers store INT4 calls this when it starts."""

    def run() -> None:
        from kvtier.compress import fused  # noqa: F401

    thread = threading.Thread(target=run, name="kvtier-int4-kernels", daemon=True)
    thread.start()
    return thread


class Int8Codec(IntCodec):
    def __init__(self, value_group: int = 64) -> None:
        super().__init__(8, value_group)


class Int4Codec(IntCodec):
    def __init__(self, value_group: int = 64) -> None:
        super().__init__(4, value_group)
