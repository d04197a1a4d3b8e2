"""KIVI: keys quantized per channel, values per token, recent tokens kept in full precision.

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024
(arXiv:2402.02750). Keys have outlier channels, so a key group runs along tokens within one
channel; values are grouped along channels within one token. The `residual` most recent
tokens stay in full precision (they get the most attention and have not filled a group).

Where the bytes really shrink is the engine's packed pool (`EngineConfig.kv_quant`,
engine/quant_pool.py): every full block stored as INT8/INT4/INT2 codes, the partial tail in
full precision. A pool's storage form is fixed when the engine starts, and this press is
chosen per request pipeline (`Engine.set_compression`), so it cannot switch the pool. On a
full-precision pool it stays a simulation: the request's kept KV is quantized and written
back dequantized (its accuracy effect is real, its bytes are not saved). On a packed pool
of the same bit width the engine drops it (the pool already does it), another width is an
error (see docs/compression.md).
"""

from __future__ import annotations

import torch

from kvtier.compress.quant import check_bits, dequantize, quantize
from kvtier.errors import KvtierError


class KiviPress:
    def __init__(self, bits: int = 4, group_size: int = 32, residual: int = 128) -> None:
        check_bits(bits)
        if group_size < 1 or residual < 0:
            raise KvtierError(
                f"kivi: group_size must be positive and residual >= 0, got {group_size}, {residual}"
            )
        self.bits = bits
        self.group_size = group_size
        self.residual = residual

    def num_quantized(self, num_tokens: int) -> int:
        """Leading tokens quantized: whole key groups, leaving at least `residual` tokens."""
        return max(0, num_tokens - self.residual) // self.group_size * self.group_size

    def apply(self, tokens: torch.Tensor) -> torch.Tensor:
        """[layers, 2, kv_heads, n, head_dim] -> the same, leading tokens as they would be
        reconstructed from their quantized form."""
        n = self.num_quantized(tokens.shape[3])
        if n == 0:
            return tokens
        out = tokens.clone()
        keys, values = tokens[:, 0, :, :n], tokens[:, 1, :, :n]
        value_group = min(self.group_size, values.shape[-1])
        out[:, 0, :, :n] = dequantize(quantize(keys, self.bits, self.group_size, 2), out.dtype)
        out[:, 1, :, :n] = dequantize(quantize(values, self.bits, value_group, 3), out.dtype)
        return out
