"""The deterministic mode's attention kernel (`prefill_attention.paged_attention`): every row
of a step against its own sequence's keys, read from a real `KVPool` through block tables.
Against attention computed by hand, and bit for bit the same for a token whether it is
decoded alone, decoded beside others, or recomputed inside prefill chunks cut anywhere."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.engine import prefill_attention
from tests.engine.test_attention import filled_pool, shuffled_tables

HEADS, KV_HEADS, DIM, BS = 9, 3, 64, 16
SCALE = DIM**-0.5

pytestmark = pytest.mark.skipif(
    not prefill_attention.available(), reason="needs AVX512_BF16 and a C++ compiler"
)


def random_rows(n: int) -> torch.Tensor:
    return torch.randn(n, HEADS, DIM).to(torch.bfloat16)


def run(pool, layer, q, tables, spans, threads=None):
    """spans: (sequence index into tables, first position, rows) in row order."""
    row_start = torch.tensor([0, *torch.tensor([m for _, _, m in spans]).cumsum(0).tolist()])
    return prefill_attention.paged_attention(
        q,
        pool.kv,
        layer,
        tables[[s for s, _, _ in spans]],
        row_start,
        torch.tensor([p for _, p, _ in spans]),
        SCALE,
        threads,
    )


def test_rows_are_attention_over_their_keys():
    pool = filled_pool(torch.bfloat16, blocks=600)
    lengths = [700, 33]
    tables = shuffled_tables(pool, lengths, seed=1)
    q = random_rows(201)
    out = run(pool, 1, q, tables, [(0, 500, 200), (1, 32, 1)])
    for row, (seq, pos) in [(0, (0, 500)), (150, (0, 650)), (199, (0, 699)), (200, (1, 32))]:
        blocks = [pool.kv[int(b), 1].double() for b in tables[seq, : -(-(pos + 1) // BS)]]
        kv = torch.cat(blocks, dim=2)[:, :, : pos + 1]
        keys = kv[0].repeat_interleave(HEADS // KV_HEADS, 0)
        values = kv[1].repeat_interleave(HEADS // KV_HEADS, 0)
        w = ((keys @ q[row].double()[:, :, None])[..., 0] * SCALE).softmax(-1)
        want = (w[:, None, :] @ values)[:, 0]
        # bf16 dot products and bf16 weights: close to float64, not equal
        assert torch.allclose(out[row].double(), want, atol=3e-2, rtol=0)


def test_a_token_gets_the_same_bits_decoded_alone_batched_or_inside_any_prefill_chunk():
    pool = filled_pool(torch.bfloat16, blocks=600)
    length = 1300
    tables = shuffled_tables(pool, [length, 900, 77, 1500], seed=2)
    q = random_rows(length)
    whole = run(pool, 0, q, tables, [(0, 0, length)])
    rng = random.Random(3)
    # the prompt cut into chunks at random places, each chunk beside random companions
    cuts = sorted(rng.sample(range(1, length), 6))
    for lo, hi in zip([0, *cuts], [*cuts, length], strict=True):
        companions = [(rng.choice([1, 2, 3]), rng.randrange(1, 70), 1) for _ in range(3)]
        spans = [*companions[:2], (0, lo, hi - lo), companions[2]]
        q_step = torch.cat([random_rows(2), q[lo:hi], random_rows(1)])
        out = run(pool, 0, q_step, tables, spans, threads=rng.choice([1, 2]))
        assert torch.equal(out[2 : 2 + hi - lo], whole[lo:hi]), (lo, hi)
    # decoded one token at a time, alone and in a batch
    for pos in [0, 15, 16, 63, 64, 511, 512, 1299]:
        alone = run(pool, 0, q[pos : pos + 1], tables, [(0, pos, 1)])
        assert torch.equal(alone[0], whole[pos])
        batch = torch.cat([q[pos : pos + 1], random_rows(31)])
        spans = [
            (0, pos, 1),
            *[(rng.choice([1, 2, 3]), rng.randrange(0, 76), 1) for _ in range(31)],
        ]
        order = list(range(32))
        rng.shuffle(order)
        batched = run(pool, 0, batch[order], tables, [spans[i] for i in order])
        assert torch.equal(batched[order.index(0)], whole[pos])
