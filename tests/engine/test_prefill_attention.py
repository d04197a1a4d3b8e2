"""The bf16 prefill attention kernel (engine/prefill_attention.py): against float64 attention
(output and log-sum-exp, causal and unmasked, sizes that fill no block or tile evenly), and
holding a row to one answer whatever else shares its call: more or fewer rows, another offset,
more keys past its position, 1 or 2 threads."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import prefill_attention as pa

pytestmark = pytest.mark.skipif(
    not pa.available(), reason="needs a C++ compiler and a CPU with AVX512_BF16"
)

SCALE = 0.125
BF = torch.bfloat16


def rand(*shape: int, seed: int) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 1.5).to(BF)


def reference(q, k, v, causal_m=None, q_offset=0):
    """float64 softmax attention of the same bf16 inputs -> (output, log-sum-exp)."""
    s = (q.double() @ k.double().transpose(-1, -2)) * SCALE
    if causal_m is not None:
        pos = torch.arange(q.shape[1]) % causal_m + q_offset
        s = s.masked_fill(torch.arange(k.shape[1])[None] > pos[:, None], float("-inf"))
    return s.softmax(-1) @ v.double(), s.logsumexp(-1)


@pytest.mark.parametrize(
    ("kv_heads", "rows", "n", "causal_m", "q_offset"),
    [
        (3, 37, 1000, None, 0),  # unmasked, odd sizes
        (3, 3 * 37, 1000, 37, 0),  # causal square at the start of the keys
        (3, 3 * 37, 1000, 37, 900),  # causal rows late in the keys (a stretch's tail)
        (2, 2 * 5, 7, 5, 2),  # fewer keys than one block
    ],
)
def test_matches_float64_attention(kv_heads, rows, n, causal_m, q_offset):
    q = rand(kv_heads, rows, 64, seed=1)
    k, v = rand(kv_heads, n, 64, seed=2), rand(kv_heads, n, 64, seed=3)
    out, lse = pa.prefill_attention(q, k, v, SCALE, causal_m, q_offset)
    want, want_lse = reference(q, k, v, causal_m, q_offset)
    err = (out.double() - want).abs()
    # weights rounded to bf16 (8 bits) before they weigh the values: ~2^-9 relative per weight,
    # averaging out over keys; torch's flash attention is no closer on these inputs
    assert err.max() < 1e-2 and err.mean() < 1e-3
    assert (lse.double() - want_lse).abs().max() < 5e-3
    # and a wiring slip (each key weighing its neighbour's value) is far above that
    wrong, _ = reference(q, k, v.roll(1, 1), causal_m, q_offset)
    assert (out.double() - wrong).abs().max() > 0.05


def test_unmasked_row_is_the_same_in_any_call():
    q, k, v = rand(3, 200, 64, seed=4), rand(3, 1000, 64, seed=5), rand(3, 1000, 64, seed=6)
    out, lse = pa.prefill_attention(q, k, v, SCALE, threads=2)
    for lo, hi in ((0, 1), (37, 74), (150, 200), (5, 198)):
        part, part_lse = pa.prefill_attention(q[:, lo:hi], k, v, SCALE, threads=2)
        assert torch.equal(part, out[:, lo:hi]) and torch.equal(part_lse, lse[:, lo:hi])
    one, one_lse = pa.prefill_attention(q, k, v, SCALE, threads=1)
    assert torch.equal(one, out) and torch.equal(one_lse, lse)
    # keys read in place from a slice of a longer cache (heads apart) as from a copy
    sliced, sliced_lse = pa.prefill_attention(q, k[:, :600], v[:, :600], SCALE)
    copied, copied_lse = pa.prefill_attention(
        q, k[:, :600].contiguous(), v[:, :600].contiguous(), SCALE
    )
    assert torch.equal(sliced, copied) and torch.equal(sliced_lse, copied_lse)
    assert not torch.equal(sliced, out)


def test_causal_row_is_the_same_in_any_call():
    """A square of 100 rows against its 100 keys; its rows 63..99 again as a call of their
    own (offset 63), and the square again against 1000 keys (the extra ones in every row's
    future): the same bits, on 1 or 2 threads."""
    q, k, v = rand(3, 3 * 100, 64, seed=7), rand(3, 1000, 64, seed=8), rand(3, 1000, 64, seed=9)
    out, lse = pa.prefill_attention(q, k[:, :100], v[:, :100], SCALE, causal_m=100, threads=2)
    per_head = out.view(3, 3, 100, 64)
    tail_q = q.view(3, 3, 100, 64)[:, :, 63:].reshape(3, 3 * 37, 64)
    tail, tail_lse = pa.prefill_attention(tail_q, k[:, :100], v[:, :100], SCALE, 37, 63, 2)
    assert torch.equal(tail.view(3, 3, 37, 64), per_head[:, :, 63:])
    assert torch.equal(tail_lse.view(3, 3, 37), lse.view(3, 3, 100)[:, :, 63:])
    longer, longer_lse = pa.prefill_attention(q, k, v, SCALE, causal_m=100, threads=2)
    assert torch.equal(longer, out) and torch.equal(longer_lse, lse)
    one, one_lse = pa.prefill_attention(q, k[:, :100], v[:, :100], SCALE, 100, threads=1)
    assert torch.equal(one, out) and torch.equal(one_lse, lse)
