"""Decode attention read straight from the block pool: no gather, no padded copy.

`PagedAttention`'s other decode path gathers every decoding sequence's K/V of a layer out of
the block-major pool into a contiguous padded copy and runs one SDPA call over it: at 8K
context that copy is 186 MB written and read again per token (docs/engine.md). These
kernels (numba: LLVM, no C compiler) follow each sequence's block table instead and read
each key and value row of the pool once for all the query heads that share its KV head.

Work is split into items of (sequence, KV head, piece of `PIECE` keys); pieces sit at fixed
absolute key positions (keys [0, 512), [512, 1024), ...), each computes its own softmax
statistics in float32, and `_merge` combines a sequence's pieces by their log-sum-exp in
piece order. So what a sequence gets never depends on what else is in the batch, how many
threads run, or which thread took which item: bit for bit the same
(tests/engine/test_attention.py checks alone vs batched and 1 vs 2 threads).

bfloat16 pools are read as uint16 and widened to float32 by a 16-bit shift (exact); float32
pools are read as uint32 and shifted by 0, so one kernel body serves both. Scores, softmax and
the weighted sum of values stay in float32; the caller rounds the output once to the pool's
dtype. The dot products are compiled with reassociation allowed (so LLVM vectorises them
along head_dim): that changes the order of the additions from a left-to-right sum, but the
compiled code is the same for every key, so the result still depends only on the inputs.
The exponential is computed in `_exp_into` without fast-math, a polynomial LLVM vectorises
(numba's `math.exp` is a scalar libm call per element here: no SVML).

`decode_attention` can deal the items to several threads (its own and helper threads,
nogil); the engine calls it on one. Between the model's torch operations, torch's OpenMP
workers are still spinning when attention starts, so a helper thread competes with them for
the second core: with each layer's attention between two torch matmuls (one 8K sequence,
bfloat16, the shape of `benchmarks/decode_attention.py --between-matmuls`), two threads were
no faster than one, and end to end two threads gained nothing either (docs/engine.md).

Compiled once per environment, on first import (about 4 s of the compiler), then loaded
from numba's cache; `PagedAttention` imports this module only when a decode asks whether
it can take this path, so the CLI's light import path never sees numba.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvtier.jit import compiled

DIM = 64  # head_dim the kernels are compiled for (SmolLM2's); others take the gather path
PIECE = 512  # keys per work item; a multiple of every block size used (16 by default)

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split so that n * _LN2_HI is exact for |n| < 2**9
_LN2_LO = np.float32(-2.12194440e-4)
_LOWEST = np.float32(-87.0)  # exp below this underflows float32 normals: clamp (weight ~0)

# the pool as unsigned integers of its element's width: bfloat16 -> uint16, float32 -> uint32
_WORDS = ("uint16", "uint32")
# dot products along head_dim, vectorised: a fixed order of additions, not left to right
_VECTOR_SUMS = {"reassoc", "contract", "nsz"}


@compiled("void(float32[::1], int64, float32)")
def _exp_into(scores, n, peak):  # pragma: no cover - compiled
    """scores[:n] <- exp(scores[:n] - peak). Cody-Waite reduction to r in [-ln2/2, ln2/2]
    and a degree-6 Taylor polynomial (~1 ulp); IEEE operations only, no fast-math, so
    reassociation cannot undo the split of ln 2."""
    for t in range(n):
        x = max(scores[t] - peak, _LOWEST)
        k = np.floor(x * _LOG2E + np.float32(0.5))
        r = (x - k * _LN2_HI) - k * _LN2_LO
        p = np.float32(1.0 / 720.0)
        p = p * r + np.float32(1.0 / 120.0)
        p = p * r + np.float32(1.0 / 24.0)
        p = p * r + np.float32(1.0 / 6.0)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        p = p * r + np.float32(1.0)
        scores[t] = p * np.uint32(np.uint32(np.int32(k) + 127) << np.uint32(23)).view(np.float32)


@compiled(
    [f"void({word}[:,:,:,::1], int64, uint32, float32[:,:,:,::1])" for word in _WORDS],
    fastmath=_VECTOR_SUMS,
)
def _widen(block, n, shift, out):  # pragma: no cover - compiled
    """out[:, :, :n] <- the first n rows of one layer of one block, [K|V, kv_heads,
    block_size, D], as float32."""
    for kind in range(2):
        for h in range(block.shape[1]):
            for t in range(n):
                for d in range(DIM):
                    out[kind, h, t, d] = np.uint32(np.uint32(block[kind, h, t, d]) << shift).view(
                        np.float32
                    )


@compiled(
    [
        f"void({word}[:,:,:,:,:,::1], float32[:,::1], int64[::1], int64, int64, uint32, int64,"
        " float32[:,:,::1], float32[:,:,::1])"
        for word in _WORDS
    ],
    fastmath=_VECTOR_SUMS,
)
def _piece(kv, q, table, length, layer, shift, piece, stats, acc):  # pragma: no cover
    """One item: keys [piece * PIECE, min(length, (piece + 1) * PIECE)) of one sequence
    (`table`: its block ids), all heads; q [heads, D] float32, already scaled. Online softmax
    over the piece's blocks in order: writes stats[piece, head] = (max score, sum of exp)
    and acc[piece, head] = sum of exp * value rows, unnormalised. One pass over the pool: a
    block's K and V of one layer are one contiguous run (all KV heads), read once."""
    heads = q.shape[0]
    kv_heads = kv.shape[3]
    group = heads // kv_heads
    block_size = kv.shape[4]
    first = piece * PIECE
    n = min(length, first + PIECE) - first
    tile = np.empty((2, kv_heads, block_size, DIM), np.float32)
    scores = np.empty((heads, block_size), np.float32)
    peak = stats[piece, :, 0]
    total = stats[piece, :, 1]
    out = acc[piece]
    peak[:] = -np.inf
    total[:] = 0.0
    out[:] = 0.0
    for start in range(0, n, block_size):
        count = min(block_size, n - start)
        _widen(kv[table[(first + start) // block_size], layer], count, shift, tile)
        for row in range(heads):
            keys = tile[0, row // group]
            for t in range(count):
                s = np.float32(0.0)
                for d in range(DIM):
                    s += q[row, d] * keys[t, d]
                scores[row, t] = s
            new_peak = peak[row]
            for t in range(count):
                new_peak = max(new_peak, scores[row, t])
            if new_peak > peak[row]:  # rescale what the earlier blocks summed
                factor = np.float32(np.exp(peak[row] - new_peak))
                total[row] *= factor
                for d in range(DIM):
                    out[row, d] *= factor
                peak[row] = new_peak
            _exp_into(scores[row], count, new_peak)
            for t in range(count):
                total[row] += scores[row, t]
            values = tile[1, row // group]
            for t in range(count):
                w = scores[row, t]
                for d in range(DIM):
                    out[row, d] += w * values[t, d]


@compiled(
    [
        f"void({word}[:,:,:,:,:,::1], float32[:,:,::1], int64[:,::1], int64[::1], int64, uint32,"
        " float32[:,:,:,::1], float32[:,:,:,::1], int64, int64)"
        for word in _WORDS
    ]
)
def _items(kv, q, tables, lengths, layer, shift, stats, acc, first, step):  # pragma: no cover
    """Items first, first + step, ... of (sequence, piece), row-major; pieces past a
    sequence's length are skipped. stats [B, pieces, heads, 2], acc [B, pieces, heads, D]."""
    batch, pieces = stats.shape[:2]
    for item in range(first, batch * pieces, step):
        b = item // pieces
        piece = item % pieces
        if piece * PIECE < lengths[b]:
            _piece(kv, q[b], tables[b], lengths[b], layer, shift, piece, stats[b], acc[b])


@compiled("void(float32[:,:,:,::1], float32[:,:,:,::1], int64[::1], float32[:,:,::1])")
def _merge(stats, acc, lengths, out):  # pragma: no cover - compiled
    """out[b, head] = the pieces of (b, head) merged by log-sum-exp, in piece order."""
    batch, _, heads = stats.shape[:3]
    for b in range(batch):
        used = (lengths[b] + PIECE - 1) // PIECE
        for h in range(heads):
            peak = stats[b, 0, h, 0]
            for p in range(1, used):
                peak = max(peak, stats[b, p, h, 0])
            row = out[b, h]
            row[:] = 0.0
            total = np.float32(0.0)
            for p in range(used):
                w = np.float32(np.exp(stats[b, p, h, 0] - peak))
                total += w * stats[b, p, h, 1]
                for d in range(DIM):
                    row[d] += w * acc[b, p, h, d]
            for d in range(DIM):
                row[d] /= total


# helper threads for `decode_attention`, made for a thread count (the caller's thread is one)
_helpers: tuple[int, ThreadPoolExecutor] | None = None


def fits(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether a pool of this dtype and geometry is one these kernels read."""
    return dtype in (torch.bfloat16, torch.float32) and head_dim == DIM and PIECE % block_size == 0


def decode_attention(
    kv: torch.Tensor,
    layer: int,
    q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    threads: int,
) -> torch.Tensor:
    """One query per sequence against its first `context_lens[b]` keys of layer `layer` of
    the pool `kv` [blocks, layers, 2, kv_heads, block_size, D] (bfloat16 or float32, CPU):
    q [B, heads, D], block_tables [B, max_blocks] -> float32 [B, heads, D]. Items are dealt
    to `threads` threads round-robin (the caller's thread takes the first share)."""
    global _helpers
    batch, heads = q.shape[:2]
    lengths = context_lens.numpy()
    pieces = -(-int(lengths.max()) // PIECE)
    ints = kv.view(torch.int16 if kv.dtype == torch.bfloat16 else torch.int32).numpy()
    pool = ints.view(np.uint16 if kv.dtype == torch.bfloat16 else np.uint32)
    shift = np.uint32(16 if kv.dtype == torch.bfloat16 else 0)
    qs = (q.float() * scale).contiguous().numpy()
    tables = block_tables.contiguous().numpy()
    stats = np.empty((batch, pieces, heads, 2), np.float32)
    acc = np.empty((batch, pieces, heads, DIM), np.float32)
    args = (pool, qs, tables, lengths, layer, shift, stats, acc)
    if threads > 1:
        if _helpers is None or _helpers[0] != threads:
            if _helpers is not None:
                _helpers[1].shutdown(wait=False)
            _helpers = (threads, ThreadPoolExecutor(threads - 1, "kvtier-decode"))
        others = [_helpers[1].submit(_items, *args, i, threads) for i in range(1, threads)]
        _items(*args, 0, threads)
        for job in others:
            job.result()
    else:
        _items(*args, 0, 1)
    out = np.empty((batch, heads, DIM), np.float32)
    _merge(stats, acc, lengths, out)
    return torch.from_numpy(out)
