"""`PagedAttention` on a real block pool against attention written out by hand (float64):
decodes (query heads unfolded over shared KV heads, with or without a length mask) and a
bf16 prefill chunk over a cached past (the split path: unmasked past + causal chunk, merged
by log-sum-exp)."""

from __future__ import annotations

import pytest
import torch

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
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * HEAD_DIM**-0.5  # [heads, n, T]
    future = torch.arange(t)[None, :] > torch.arange(t - n, t)[:, None]
    weights = scores.masked_fill(future, float("-inf")).softmax(-1)
    return (weights @ v).transpose(0, 1)


def pool_of(dtype: torch.dtype) -> KVPool:
    pool = KVPool(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, dtype, "cpu", 1 << 20)
    # Slots nobody writes hold large values: attending to one would show.
    pool.kv.fill_(30.0)
    return pool


def decode_step(
    pool: KVPool, tables: list[list[int]], lengths: list[int], layer: int, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One decode step of every sequence (its last position new, the others already in the
    pool), with the metadata the runner builds; the output and, per sequence, the expected."""
    gen = torch.Generator().manual_seed(seed)
    expected, new_q, new_k, new_v, blocks, offsets = [], [], [], [], [], []
    for table, n in zip(tables, lengths, strict=True):
        past = torch.randn(LAYERS, 2, KV_HEADS, n - 1, HEAD_DIM, generator=gen)
        if n > 1:
            pool.write_tokens(table, past)
        q = torch.randn(HEADS, HEAD_DIM, generator=gen)
        k, v = torch.randn(2, KV_HEADS, HEAD_DIM, generator=gen)
        new_q.append(q)
        new_k.append(k)
        new_v.append(v)
        blocks.append(table[(n - 1) // BLOCK])
        offsets.append((n - 1) % BLOCK)
        keys = torch.cat([past[layer, 0], k[:, None]], dim=1)
        values = torch.cat([past[layer, 1], v[:, None]], dim=1)
        expected.append(reference(q[None], keys, values)[0])
    width = max(len(t) for t in tables)
    padded = torch.zeros(len(tables), width, dtype=torch.long)
    for i, table in enumerate(tables):
        padded[i, : len(table)] = torch.tensor(table)
    lens = torch.tensor(lengths)
    meta = AttentionMetadata(
        slot_index=pool.plan_writes(torch.tensor(blocks), torch.tensor(offsets)),
        num_decodes=len(tables),
        decode_request_ids=[f"r{i}" for i in range(len(tables))],
        decode_block_tables=padded,
        decode_context_lens=lens,
        decode_key_len=max(lengths),
    )
    if len(set(lengths)) > 1:  # as the runner does: a mask only for unequal lengths
        visible = torch.arange(width * BLOCK)[None, :] < lens[:, None]
        meta.decode_mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[
            :, None, None, :
        ]
    attention = PagedAttention(pool, HEADS, KV_HEADS, HEAD_DIM)
    assert attention.unfolds_decodes
    out = attention(layer, torch.stack(new_q), torch.stack(new_k), torch.stack(new_v), meta)
    return out.view(len(tables), HEADS, HEAD_DIM), expected


@pytest.mark.parametrize("layer", [0, 1])
def test_decodes_of_different_lengths_match_attention_by_hand(layer):
    # Scattered, interleaved block ids; lengths on and off block boundaries, one of 1.
    tables = [[7, 2, 11], [5], [3, 9, 0, 14, 6], [12, 1]]
    lengths = [10, 1, 20, 5]
    out, expected = decode_step(pool_of(torch.float32), tables, lengths, layer, seed=layer)
    for i, want in enumerate(expected):
        torch.testing.assert_close(out[i].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [9, 12])
def test_decodes_of_equal_lengths_need_no_mask(length):
    """No mask: the keys are cut to the context length, so the unwritten rest of the last
    block (off a block boundary: 9) is never attended."""
    tables = [[4, 8, 1], [13, 0, 6]]
    out, expected = decode_step(pool_of(torch.float32), tables, [length] * 2, 1, seed=length)
    for i, want in enumerate(expected):
        torch.testing.assert_close(out[i].double(), want, atol=1e-5, rtol=1e-5)


def test_the_new_token_is_written_to_its_slot_before_it_is_attended():
    """A sequence of one token attends to itself alone: the output is its own V per head."""
    pool = pool_of(torch.float32)
    out, _ = decode_step(pool, [[4]], [1], layer=1, seed=3)
    written = pool.kv[4, 1, 1, :, 0]  # block 4, layer 1, V, every KV head, slot 0
    torch.testing.assert_close(out[0], written.repeat_interleave(GROUP, 0))


@pytest.mark.parametrize("past", [0, 13, 24])
def test_bf16_prefill_chunk_over_a_cached_past_matches_by_hand(past):
    """bf16 takes the split path too; its error stays that of bf16 inputs (the partial
    outputs are rounded to bf16 before the merge)."""
    pool = pool_of(torch.bfloat16)
    n, layer, table = 11, 1, [9, 3, 14, 0, 7, 11, 2, 5, 10]
    gen = torch.Generator().manual_seed(past)
    keys, values = torch.randn(2, KV_HEADS, past + n, HEAD_DIM, generator=gen).bfloat16()
    if past:
        tokens = torch.zeros(LAYERS, 2, KV_HEADS, past, HEAD_DIM, dtype=torch.bfloat16)
        tokens[layer] = torch.stack([keys[:, :past], values[:, :past]])
        pool.write_tokens(table, tokens)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen).bfloat16()
    positions = torch.arange(past, past + n)
    meta = AttentionMetadata(
        slot_index=pool.plan_writes(torch.tensor(table)[positions // BLOCK], positions % BLOCK)
    )
    meta.prefills.append(
        PrefillSpan(
            request_id="r",
            token_start=0,
            token_end=n,
            block_table=torch.tensor([table[: -(-(past + n) // BLOCK)]]),
            context_len=past + n,
            chunks=[],
        )
    )
    attention = PagedAttention(pool, HEADS, KV_HEADS, HEAD_DIM)
    assert attention.splits_prefill
    own_k, own_v = keys[:, past:].transpose(0, 1), values[:, past:].transpose(0, 1)
    out = attention(layer, q, own_k.contiguous(), own_v.contiguous(), meta)
    want = reference(q, keys, values)
    assert out.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: outputs of magnitude ~1 are good to ~1e-2.
    torch.testing.assert_close(out.view(n, HEADS, HEAD_DIM).double(), want, atol=2e-2, rtol=2e-2)
