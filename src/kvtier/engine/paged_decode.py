"""Decode attention read straight from the block pool: no gather, no padded copy.

`PagedAttention`'s other decode path gathers every decoding sequence's K/V of a layer out of
the block-major pool into a contiguous padded copy and runs one SDPA call over it: at 8K
context that copy is 186 MB written and read again per token (docs/engine.md). The kernel in
`paged_decode.cpp` follows each sequence's block table instead and reads each key and value
row of the pool once for all the query heads that share its KV head.

Work is split into items of (sequence, piece of 512 keys); pieces sit at fixed absolute key
positions, each computes its own softmax statistics in float32, and the pieces of a sequence
are merged by log-sum-exp in piece order. So what a sequence gets never depends on what else
is in the batch, how many threads run, or which thread took which item: bit for bit the same
(tests/engine/test_attention.py checks alone vs batched and 1 to 3 threads). bfloat16 pools
are widened to float32 by a 16-bit shift (exact); scores, softmax and the weighted sum of
values stay in float32 (the exponential is a fixed polynomial, the same for every key); the
caller rounds the output once to the pool's dtype.

The items run on OpenMP threads of torch's own runtime (`engine/native.py`): torch's workers
are awake between the model's matmuls and take them at once. An earlier version of this
kernel (numba, its helper threads beside torch's spinning workers) was faster than gather +
SDPA on attention alone but slower end to end
(benchmarks/records/2026-12-02-paged-decode-kernel.md).

The library is built by the system's C++ compiler on first use (under a second with g++ 12
here, then cached); without a compiler `available()` is False and decodes keep the gather.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvtier.engine import native

DIM = 64  # head_dim the kernel is compiled for (SmolLM2's); others take the gather path
PIECE = 512  # keys per work item (paged_decode.cpp); a multiple of every block size used

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.load(Path(__file__).with_name("paged_decode.cpp"))
    if lib is not None:
        lib.kvtier_paged_decode.restype = None
        lib.kvtier_paged_decode.argtypes = [
            _PTR, ctypes.c_int, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64,
            _PTR, ctypes.c_int,
        ]  # fmt: skip
    return lib


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return _library() is not None


def fits(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether a pool of this dtype and geometry is one the kernel reads."""
    return (
        dtype in (torch.bfloat16, torch.float32)
        and head_dim == DIM
        and block_size % 16 == 0  # scores are reduced 16 keys at a time
        and PIECE % block_size == 0
    )


def decode_attention(
    kv: torch.Tensor,
    layer: int,
    q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    threads: int,
) -> torch.Tensor:
    """One query per sequence against its first `context_lens[b]` (>= 1) keys of layer
    `layer` of the contiguous pool `kv` [blocks, layers, 2, kv_heads, block_size, D]
    (bfloat16 or float32, CPU): q [B, heads, D], block_tables [B, max_blocks] -> float32
    [B, heads, D], its items on `threads` OpenMP threads. Needs `available()`."""
    lib = _library()
    assert lib is not None and kv.is_contiguous()
    batch, heads = q.shape[:2]
    qs = (q.float() * scale).contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lengths = context_lens.to(torch.int64).contiguous()
    out = torch.empty(batch, heads, DIM)
    lib.kvtier_paged_decode(
        kv.data_ptr(), kv.dtype == torch.bfloat16, kv.shape[1], kv.shape[3], kv.shape[4], layer,
        qs.data_ptr(), heads, tables.data_ptr(), tables.shape[1], lengths.data_ptr(), batch,
        out.data_ptr(), threads,
    )  # fmt: skip
    return out
