"""KIVI: keys quantized per channel, values per token, recent tokens kept in full precision.

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024
(arXiv:2402.02750). Keys have outlier channels, so a key group runs along tokens within one
channel; values are grouped along channels within one token. The `residual` most recent
tokens stay in full precision (they get the most attention and have not filled a group).

In the engine today this press is applied as quantize-then-dequantize on the request's kept
KV, so its accuracy effect is real but the pool still stores full-precision bytes (a packed
quantized block store beside the pool is the missing step; see docs/compression.md).
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
