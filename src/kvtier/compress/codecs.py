"""Quantized block codecs for tier boundaries: a block leaves the device as INT8 / INT4.

A `BlockCodec` (kvtier.engine.hooks) turns one pool block [layers, 2, kv_heads, block_size,
head_dim] into a payload and back. These follow KIVI's axes (see `quant.py`): keys are
quantized per channel over the block's tokens, values per token over `value_group` channels.
The payload is one flat uint8 tensor (codes, then float16 minimums and steps), so a tier
stores and moves it like any other bytes; a demoted block costs about 1/3.6 (INT4) or 1/1.9
(INT8) of its bfloat16 size.
"""

from __future__ import annotations

import torch

from kvtier.compress.quant import Quantized, check_bits, dequantize, quantize


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
        layers, _, heads, tokens, dim = shape
        half = torch.Size((layers, heads, tokens, dim))
        offset = 0
        out = []
        for group, axis in ((tokens, 2), (min(self.value_group, dim), 3)):
            template = quantize(torch.zeros(half), self.bits, group, axis)  # shapes only
            pieces = []
            for t in (template.codes, template.minimum, template.step):
                nbytes = t.numel() * t.element_size()
                raw = payload[offset : offset + nbytes]
                pieces.append(raw.view(t.dtype).reshape(t.shape))
                offset += nbytes
            q = Quantized(*pieces, bits=self.bits, dim=axis, length=half[axis], shape=half)
            out.append(dequantize(q, dtype))
        return torch.stack(out, dim=1)


class Int8Codec(IntCodec):
    def __init__(self, value_group: int = 64) -> None:
        super().__init__(8, value_group)


class Int4Codec(IntCodec):
    def __init__(self, value_group: int = 64) -> None:
        super().__init__(4, value_group)
