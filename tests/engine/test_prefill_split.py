"""A bf16 prefill chunk over a cached past through `PagedAttention`'s split path (the chunk
over itself with `is_causal`, the past unmasked, merged by log-sum-exp) on a real block pool,
against causal attention written out by hand in float64."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvtier.engine import prefill_attention
from kvtier.engine.attention import AttentionMetadata, PagedAttention, PrefillSpan
from kvtier.engine.kv_pool import KVPool

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 2, 6, 2, 8, 4
GROUP = HEADS // KV_HEADS


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [n, heads, D] at the last n of the keys' positions, keys/values [kv_heads, T, D]
    -> causal attention [n, heads, D] in float64, KV repeated per query head."""
    n, t = q.shape[0], keys.shape[1]
    k = keys.double().repeat_interleave(GROUP, 0)
    v = values.double().repeat_interleave(GROUP, 0)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * q.shape[-1] ** -0.5  # [heads, n, T]
    future = torch.arange(t)[None, :] > torch.arange(t - n, t)[:, None]
    weights = scores.masked_fill(future, float("-inf")).softmax(-1)
    return (weights @ v).transpose(0, 1)


@pytest.mark.parametrize("past", [0, 13, 24])
def test_bf16_prefill_chunk_over_a_cached_past_matches_by_hand(past):
    """bf16 takes the split path; its error stays that of bf16 inputs (with `_flash` the
    partial outputs are rounded to bf16 before the merge; the prefill attention kernel keeps
    them float32). Past lengths on and off block boundaries."""
    pool = KVPool(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, torch.bfloat16, "cpu", 1 << 20)
    # Slots nobody writes (the rest of the last block) hold large values: attending to one
    # would show.
    pool.kv.fill_(30.0)
    n, layer, table = 11, 1, [9, 3, 14, 0, 7, 11, 2, 5, 10]  # `prefill` uses layer 1
    gen = torch.Generator().manual_seed(past)
    keys, values = torch.randn(2, KV_HEADS, past + n, HEAD_DIM, generator=gen).bfloat16()
    if past:
        tokens = torch.zeros(LAYERS, 2, KV_HEADS, past, HEAD_DIM, dtype=torch.bfloat16)
        tokens[layer] = torch.stack([keys[:, :past], values[:, :past]])
        pool.write_tokens(table, tokens)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen).bfloat16()
    # the past's queries are not used: its K/V are already in the pool
    whole_q = torch.cat([q.new_zeros(past, HEADS, HEAD_DIM), q])
    by_position = keys.transpose(0, 1).contiguous(), values.transpose(0, 1).contiguous()
    out = prefill(pool, whole_q, *by_position, table, [past, past + n])
    want = reference(q, keys, values)
    assert out.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: outputs of magnitude ~1 are good to ~1e-2.
    torch.testing.assert_close(out.view(n, HEADS, HEAD_DIM).double(), want, atol=2e-2, rtol=2e-2)


def prefill(
    pool: KVPool, q, keys, values, table: list[int], edges: list[int], prefill_kernel=True
) -> torch.Tensor:
    """Prefill positions [edges[0], edges[-1]) of one sequence in chunks cut at `edges`
    (positions before edges[0] already in the pool, as after a prefix hit), through
    `PagedAttention` on layer 1; the attention rows of those positions. q [T, heads, D],
    keys/values [T, kv_heads, D] of the whole prompt. `prefill_kernel`: the kernel of
    engine/prefill_attention.py where it fits (bf16, head_dim 64) and runs; False: torch's."""
    attention = PagedAttention(pool, HEADS, KV_HEADS, q.shape[-1], prefill_kernel=prefill_kernel)
    assert attention.splits_prefill
    rows = []
    for lo, hi in itertools.pairwise(edges):
        positions = torch.arange(lo, hi)
        meta = AttentionMetadata(
            slot_index=pool.plan_writes(torch.tensor(table)[positions // BLOCK], positions % BLOCK)
        )
        meta.prefills.append(
            PrefillSpan("r", 0, hi - lo, torch.tensor([table[: -(-hi // BLOCK)]]), hi, [])
        )
        rows.append(attention(1, q[lo:hi], keys[lo:hi], values[lo:hi], meta))
    return torch.cat(rows)


KERNEL_RUNS = prefill_attention.available()


@pytest.mark.parametrize(
    ("dtype", "head_dim", "prefill_kernel"),
    [
        (torch.bfloat16, HEAD_DIM, True),  # no kernel for head_dim 8: torch's flash attention
        (torch.float32, HEAD_DIM, True),
        # SmolLM2's head_dim, by each prefill attention (`EngineConfig.prefill_attention`);
        # torch's uses the AMX tiles on a CPU that has them
        (torch.bfloat16, prefill_attention.DIM, False),
        pytest.param(
            torch.bfloat16,
            prefill_attention.DIM,
            True,
            marks=pytest.mark.skipif(not KERNEL_RUNS, reason="needs AVX512_BF16 and g++"),
        ),
    ],
    ids=["bf16", "float32", "bf16-dim64-torch", "bf16-dim64-kernel"],
)
def test_a_position_gets_the_same_bits_however_its_chunk_starts(dtype, head_dim, prefill_kernel):
    """The split is cut at fixed 512-position stretches from position 0, not at chunk
    edges: a position's attention row is bitwise what the prompt prefilled in 512-token
    chunks gives whenever its chunk ends where that one does (the chunk after a prefix hit,
    one chunk over the whole prompt, a chunk starting mid-stretch)."""
    total = 1100
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(total, HEADS, head_dim, generator=gen).to(dtype)
    keys, values = torch.randn(2, total, KV_HEADS, head_dim, generator=gen).to(dtype)
    table = torch.randperm(400, generator=gen)[: -(-total // BLOCK)].tolist()

    def pool() -> KVPool:
        return KVPool(LAYERS, KV_HEADS, head_dim, BLOCK, dtype, "cpu", 1 << 24)

    def run(pool: KVPool, edges: list[int]) -> torch.Tensor:
        return prefill(pool, q, keys, values, table, edges, prefill_kernel)

    reference_pool = pool()
    want = run(reference_pool, [0, 512, 1024, total])
    assert torch.equal(run(pool(), [0, total]), want)
    assert torch.equal(run(pool(), [0, 512, total]), want)
    # Rows from 700 on: their chunk ends where the reference's does.
    got = run(pool(), [0, 700, 1024, total])
    assert torch.equal(got[700:], want[700:])
    # After a prefix hit at 1040 (a block edge inside the third stretch), the pool holding
    # the reference's K/V: the recomputed tail is the same bits.
    tail = run(reference_pool, [1040, total])
    assert torch.equal(tail, want[1040:])
    # What the split computes is attention: close to float64 by hand.
    by_hand = reference(q[1040:], keys.transpose(0, 1), values.transpose(0, 1))
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(
        tail.view(-1, HEADS, head_dim).double(), by_hand, atol=tolerance, rtol=tolerance
    )
