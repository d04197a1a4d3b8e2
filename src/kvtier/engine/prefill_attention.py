"""bfloat16 prefill attention on AVX512_BF16 dot products (`prefill_attention.cpp`).

torch's CPU flash attention (`attention._flash`) widens bf16 to float32 and runs at float32
speed; this kernel multiplies bf16 pairs with `vdpbf16ps` for both Q.K^T and P.V, accumulating
in float32, with a float32 online softmax (a fixed polynomial exponential) and the weights
rounded once to bf16 before they weigh the values. It returns what `_flash` returns, the
output (float32 here, not bf16) and the log-sum-exp per row, so `_prefill_split` can merge two
partial attentions the same way.

A row's bits depend only on its query and the keys it sees (key blocks at fixed offsets from
key 0, no arithmetic across rows, fixed reduction orders): not on how many rows share the call,
where the row sits among them, or the number of threads (tests/engine/test_prefill_attention.py).

`paged_attention` is deterministic mode's entry (`EngineConfig.deterministic`): every row of a
step, decodes and prefill chunks alike, against its own sequence's keys read from the block
pool through the block tables (tests/engine/test_paged_attention.py).

Built by the system's compiler with -march=native (`engine/native.py`); `available()` is False
without a compiler or on a CPU without AVX512_BF16, and callers keep `_flash`.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvtier.engine import native

DIM = 64  # head_dim the kernel is compiled for (SmolLM2's)

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _library() -> ctypes.CDLL | None:
    if "avx512_bf16" not in native.cpu_flags().split():
        return None
    lib = native.load(Path(__file__).with_name("prefill_attention.cpp"))
    if lib is not None:
        lib.kvtier_prefill_attention.restype = None
        lib.kvtier_prefill_attention.argtypes = [
            _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_int,
            ctypes.c_float,
            _PTR, _PTR, ctypes.c_int,
        ]  # fmt: skip
        lib.kvtier_paged_attention.restype = None
        lib.kvtier_paged_attention.argtypes = [
            _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64,
            ctypes.c_float, _PTR, ctypes.c_int,
        ]  # fmt: skip
    return lib


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return _library() is not None


def fits(q: torch.Tensor) -> bool:
    """Whether the kernel takes queries like `q` (bf16 on the CPU, head_dim 64)."""
    return q.dtype == torch.bfloat16 and q.shape[-1] == DIM and q.device.type == "cpu"


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal_m: int | None = None,
    q_offset: int = 0,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [kv_heads, rows, 64], k/v [kv_heads, n, 64], bf16 -> (output [kv_heads, rows, 64]
    float32, log-sum-exp [kv_heads, rows] float32).

    Unmasked when `causal_m` is None: every row sees all n keys. Otherwise the rows of a KV
    head are its query heads' `causal_m` rows each, stacked (head h = kv * group + g), and the
    row i of each sits at position `q_offset + i` and sees keys [0, q_offset + i]
    (q_offset + causal_m <= n). Needs `available()`."""
    lib = _library()
    assert lib is not None
    kv_heads, rows, dim = q.shape
    n = k.shape[1]
    assert dim == DIM and k.shape == v.shape == (kv_heads, n, DIM)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    if causal_m is not None:
        assert rows % causal_m == 0 and q_offset + causal_m <= n
    # each head's rows contiguous; the heads may lie apart (a slice of a longer cache)
    q = q.contiguous()
    k = k if k.stride()[1:] == (DIM, 1) else k.contiguous()
    v = v if v.stride()[1:] == (DIM, 1) else v.contiguous()
    out = torch.empty(kv_heads, rows, DIM)
    lse = torch.empty(kv_heads, rows)
    lib.kvtier_prefill_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), kv_heads, rows,
        causal_m or rows, n, q_offset, causal_m is not None, scale,
        out.data_ptr(), lse.data_ptr(), threads or torch.get_num_threads(),
    )  # fmt: skip
    return out, lse


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    tables: torch.Tensor,
    row_start: torch.Tensor,
    first_pos: torch.Tensor,
    scale: float,
    threads: int | None = None,
) -> torch.Tensor:
    """Every row of a step against its own sequence's keys [0, its position], read from the
    pool: q [rows, heads, 64] bf16; `kv` the contiguous bf16 pool [blocks, layers, 2, kv_heads,
    block_size, 64]; sequence s owns rows row_start[s] .. row_start[s + 1] (int64, [S + 1]),
    the first at position first_pos[s] ([S]), its blocks tables[s] ([S, width] int64) ->
    float32 [rows, heads, 64].

    A row's bits depend on its query and those keys only (for every row: pieces of 512 keys
    from key 0, each in blocks of 64 keys with its own softmax, folded in key order): not on
    the rows beside it, the sequence's other rows, where its chunk starts, or the thread
    count. Needs `available()`."""
    lib = _library()
    assert lib is not None and kv.is_contiguous() and kv.dtype == torch.bfloat16
    rows, heads, dim = q.shape
    kv_heads, block_size = kv.shape[3], kv.shape[4]
    assert dim == DIM == kv.shape[5] and q.dtype == torch.bfloat16 and block_size % 16 == 0
    q = q.contiguous()
    tables = tables.to(torch.int64).contiguous()
    row_start = row_start.to(torch.int64).contiguous()
    first_pos = first_pos.to(torch.int64).contiguous()
    assert row_start.shape[0] == first_pos.shape[0] + 1 == tables.shape[0] + 1
    assert int(row_start[-1]) == rows
    out = torch.empty(rows, heads, DIM)
    lib.kvtier_paged_attention(
        q.data_ptr(), heads, kv_heads, kv.data_ptr(), kv.shape[1], layer, block_size,
        tables.data_ptr(), tables.shape[1], row_start.data_ptr(), first_pos.data_ptr(),
        first_pos.shape[0], scale, out.data_ptr(), threads or torch.get_num_threads(),
    )  # fmt: skip
    return out
