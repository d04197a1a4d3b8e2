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
