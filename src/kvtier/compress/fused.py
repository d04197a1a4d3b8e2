"""The INT4 codec's decode into bfloat16 in one pass per half: codes to bfloat16 bits directly.

`quant.dequantize_into` decodes with torch operations, four passes over each value (codes to
float32, scale, shift, cast to bfloat16): torch has no fused CPU operation for it, and
`torch.compile` would need a C++ compiler at run time. These kernels, compiled by numba
(LLVM, no C compiler) and cached on disk, read each packed byte once and write the bfloat16
bits of its two values, in loops LLVM vectorises: 4x faster than the torch passes per chunk
(benchmarks/records/2026-12-01-fused-int4-decode.md).

They take `IntCodec`'s INT4 layout of a chunk [blocks * layers, K|V, heads, tokens, dim]
written into a contiguous bfloat16 tensor, whose groups fill their axis (no padding):

- keys, grouped along tokens: codes [n, heads, dim, groups, group_bytes]; the 16 codes of 8
  bytes are read as one little-endian uint64 word, so a tile of (n, head) writes whole rows
  of `dim` values per token, contiguous;
- values, grouped along channels: codes [n, heads, tokens, groups, group_bytes]; the two
  codes of a byte are two adjacent bfloat16 values, written as one uint32.

Each value is `code * step + minimum` in float32 (the product is exact, as in `quant`), then
rounded to bfloat16 to nearest even, any NaN as torch's vectorised cast writes it (0xFFFF):
bit for bit what `quant.dequantize` returns (tests/compress/test_fused.py).

Compiling takes about a second the first time in an environment; numba's cache (next to this
file, or its per-user directory when that is not writable; none when neither is) makes later
imports load it in a fraction of that. A connector whose tiers may store INT4 imports this
module on a background thread when it binds (`ChunkForms.prepare`, `codecs.warm_up_fused`),
so no restore waits for the compiler.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from kvtier.compress.quant import Quantized
from kvtier.jit import compiled

# what torch's vectorised float32 -> bfloat16 cast writes for any NaN (at::vec)
_NAN_BF16 = 0xFFFF


@compiled("uint16(float32)", inline="always")
def _bf16_bits(value):  # pragma: no cover - compiled
    bits = np.float32(value).view(np.uint32)
    if value != value:
        return np.uint16(_NAN_BF16)
    return np.uint16((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16)


@compiled("void(uint64[:,:,:,:,::1], float32[:,:,:,::1], float32[:,:,:,::1], uint16[:,:,:,:,::1])")
def _keys(words, step, minimum, out):  # pragma: no cover - compiled
    """words [n, heads, dim, groups, words_per_group] (16 codes each); step and minimum
    [n, heads, groups, dim]; out: the chunk [n, K|V, heads, tokens, dim], keys written."""
    n_rows, heads, dim, groups, per_group = words.shape
    tile = np.empty(dim, np.uint64)  # one word of every channel: the inner loop reads it in order
    for n in range(n_rows):
        for h in range(heads):
            for g in range(groups):
                s = step[n, h, g]
                m = minimum[n, h, g]
                for w in range(per_group):
                    for d in range(dim):
                        tile[d] = words[n, h, d, g, w]
                    for t in range(16):
                        row = out[n, 0, h, (g * per_group + w) * 16 + t]
                        shift = np.uint64(4 * t)
                        for d in range(dim):
                            code = np.float32((tile[d] >> shift) & np.uint64(15))
                            row[d] = _bf16_bits(code * s[d] + m[d])


@compiled("void(uint8[:,:,:,:,::1], float32[:,:,:,::1], float32[:,:,:,::1], uint32[:,:,:,:,::1])")
def _values(codes, step, minimum, out):  # pragma: no cover - compiled
    """codes [n, heads, tokens, groups, group_bytes]; step and minimum [n, heads, tokens,
    groups]; out: the chunk [n, K|V, heads, tokens, dim / 2] as pairs of bfloat16, values
    written."""
    n_rows, heads, tokens, groups, group_bytes = codes.shape
    for n in range(n_rows):
        for h in range(heads):
            for t in range(tokens):
                row = out[n, 1, h, t]
                for g in range(groups):
                    s = step[n, h, t, g]
                    m = minimum[n, h, t, g]
                    byte_row = codes[n, h, t, g]
                    for j in range(group_bytes):
                        low = np.uint32(_bf16_bits(np.float32(byte_row[j] & 15) * s + m))
                        high = np.uint32(_bf16_bits(np.float32(byte_row[j] >> 4) * s + m))
                        row[g * group_bytes + j] = low | (high << 16)


def fits(keys: Quantized, values: Quantized, out: torch.Tensor) -> bool:
    """Whether the kernels decode this chunk: INT4 halves grouped as `IntCodec` groups them,
    with whole groups of whole uint64 words for keys, on the CPU of a little-endian machine,
    into a contiguous bfloat16 tensor."""
    return (
        sys.byteorder == "little"
        and keys.bits == values.bits == 4
        and (keys.dim, values.dim) == (2, 3)
        and out.dtype == torch.bfloat16
        and out.device.type == keys.codes.device.type == values.codes.device.type == "cpu"
        and out.is_contiguous()
        and out.dim() == 5
        and out.shape[1] == 2
        and keys.codes.shape[-1] % 8 == 0
        and _unpadded(keys)
        and _unpadded(values)
    )


def decode_into(keys: Quantized, values: Quantized, out: torch.Tensor) -> None:
    """Both halves of a chunk into `out` [n, 2, heads, tokens, dim]; `fits` must hold."""
    bits = out.view(torch.int16).numpy().view(np.uint16)
    words = keys.codes.numpy().view(np.uint64)
    if words.ctypes.data % words.itemsize:  # the payload's bytes are not 8-aligned here
        words = words.copy()
    step, minimum = (_scales(t.squeeze(-1).transpose(-1, -2)) for t in (keys.step, keys.minimum))
    _keys(words, step, minimum, bits)
    step, minimum = (_scales(t.squeeze(-1)) for t in (values.step, values.minimum))
    _values(values.codes.numpy(), step, minimum, bits.view(np.uint32))


def _scales(t: torch.Tensor) -> np.ndarray:
    """float16 steps or minimums as a contiguous float32 array, in one pass."""
    return torch.empty(t.shape, dtype=torch.float32).copy_(t).numpy()


def _unpadded(q: Quantized) -> bool:
    groups, group_bytes = q.codes.shape[-2:]
    return groups * group_bytes * 2 == q.length == q.shape[q.dim]
