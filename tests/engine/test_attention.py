"""The paged decode kernel (engine/paged_decode.py) on a real `KVPool`: against attention
computed by hand from the pool's blocks, and holding each sequence to one answer whatever is
batched beside it and however many threads run; then through the whole engine
(`EngineConfig.paged_decode`)."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import Engine, EngineConfig, SamplingParams, paged_decode
from kvtier.engine.attention import PagedAttention
from kvtier.engine.kv_pool import KVPool
from kvtier.engine.quant_pool import QuantizedKVPool

LAYERS, HEADS, KV_HEADS, DIM, BS = 2, 9, 3, 64, 16
MIB = 1 << 20
SCALE = DIM**-0.5


def filled_pool(dtype: torch.dtype, blocks: int = 400, kv_heads: int = KV_HEADS) -> KVPool:
    block_bytes = LAYERS * 2 * kv_heads * BS * DIM * dtype.itemsize
    pool = KVPool(LAYERS, kv_heads, DIM, BS, dtype, "cpu", blocks * block_bytes)
    g = torch.Generator().manual_seed(0)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g) * 2)
    return pool


def shuffled_tables(pool: KVPool, lengths: list[int], seed: int) -> torch.Tensor:
    """One row of distinct, shuffled block ids per sequence, padded with zeros."""
    order = torch.randperm(pool.num_blocks, generator=torch.Generator().manual_seed(seed))
    width = max(-(-n // BS) for n in lengths)
    tables = torch.zeros(len(lengths), width, dtype=torch.long)
    used = 0
    for i, n in enumerate(lengths):
        count = -(-n // BS)
        tables[i, :count] = order[used : used + count]
        used += count
    return tables


def by_hand(pool: KVPool, layer: int, q: torch.Tensor, table: torch.Tensor, n: int):
    """Softmax attention of one sequence's query [heads, D] in float64, K/V read block by
    block out of `pool.kv`."""
    blocks = [pool.kv[int(b), layer].double() for b in table[: -(-n // BS)]]  # [2, H, bs, D]
    kv = torch.cat(blocks, dim=2)[:, :, :n]  # [2, kv_heads, n, D]
    group = q.shape[0] // kv.shape[1]
    keys = kv[0].repeat_interleave(group, 0)  # head h reads KV head h // group
    values = kv[1].repeat_interleave(group, 0)
    weights = ((keys @ q.double()[:, :, None])[..., 0] * SCALE).softmax(-1)
    return (weights[:, None, :] @ values)[:, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lengths", [[1], [16], [517], [1100, 7, 512, 1025]])
def test_the_kernel_is_attention_over_the_pool(dtype, lengths):
    pool = filled_pool(dtype)
    tables = shuffled_tables(pool, lengths, seed=len(lengths))
    q = torch.randn(len(lengths), HEADS, DIM).to(dtype)
    for layer in range(LAYERS):
        got = paged_decode.decode_attention(
            pool.kv, layer, q, tables, torch.tensor(lengths), SCALE, 2
        )
        assert got.dtype == torch.float32
        for i, n in enumerate(lengths):
            want = by_hand(pool, layer, q[i], tables[i], n)
            torch.testing.assert_close(got[i].double(), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_more_query_heads_than_a_block_has_keys(dtype):
    # Llama-3.2-1B's geometry (32 query / 8 KV heads, head dim 64) in 16-token blocks: the
    # kernel's per-head scratch outgrows a block's worth of keys
    heads, kv_heads, lengths = 32, 8, [700, 33]
    pool = filled_pool(dtype, blocks=64, kv_heads=kv_heads)
    tables = shuffled_tables(pool, lengths, seed=5)
    q = torch.randn(len(lengths), heads, DIM).to(dtype)
    for layer in range(LAYERS):
        got = paged_decode.decode_attention(
            pool.kv, layer, q, tables, torch.tensor(lengths), SCALE, 2
        )
        for i, n in enumerate(lengths):
            want = by_hand(pool, layer, q[i], tables[i], n)
            torch.testing.assert_close(got[i].double(), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_sequence_gets_the_same_bits_alone_batched_and_on_any_thread_count(dtype):
    pool = filled_pool(dtype)
    lengths = [1500, 3, 700, 2049, 512]
    tables = shuffled_tables(pool, lengths, seed=7)
    q = torch.randn(len(lengths), HEADS, DIM).to(dtype)
    lens = torch.tensor(lengths)
    batched = {
        t: paged_decode.decode_attention(pool.kv, 1, q, tables, lens, SCALE, t) for t in (1, 2, 3)
    }
    assert torch.equal(batched[1], batched[2]) and torch.equal(batched[1], batched[3])
    for i, n in enumerate(lengths):
        own = tables[i : i + 1, : -(-n // BS)]  # its own table, not padded to the batch's
        for threads in (1, 2):
            alone = paged_decode.decode_attention(
                pool.kv, 1, q[i : i + 1], own, lens[i : i + 1], SCALE, threads
            )
            assert torch.equal(alone[0], batched[1][i])
    # a different neighbour changes nothing either
    swapped = [lengths[0], 100]
    pair = paged_decode.decode_attention(
        pool.kv, 1, q[:2], shuffled_tables(pool, swapped, seed=7), torch.tensor(swapped), SCALE, 2
    )
    assert torch.equal(pair[0], batched[1][0])


def test_decodes_take_the_kernel_only_where_it_applies():
    pool = filled_pool(torch.bfloat16)
    assert not PagedAttention(pool, HEADS, KV_HEADS, DIM).pages_decode  # off unless asked
    attention = PagedAttention(pool, HEADS, KV_HEADS, DIM, paged_decode=True)
    assert attention.pages_decode

    class Watcher:
        needs_weights = False

        def observe(self, *args) -> None:
            pass

    attention.observers.append(Watcher())
    assert not attention.pages_decode  # observers are handed the gathered keys
    half = KVPool(LAYERS, KV_HEADS, DIM, BS, torch.float16, "cpu", 1 << 24)
    assert not PagedAttention(half, HEADS, KV_HEADS, DIM, True).pages_decode
    wide = KVPool(LAYERS, KV_HEADS, 128, BS, torch.float32, "cpu", 1 << 24)
    assert not PagedAttention(wide, HEADS, KV_HEADS, 128, True).pages_decode
    small_blocks = KVPool(LAYERS, KV_HEADS, DIM, 8, torch.float32, "cpu", 1 << 24)
    assert not PagedAttention(small_blocks, HEADS, KV_HEADS, DIM, True).pages_decode
    wide_blocks = KVPool(LAYERS, KV_HEADS, DIM, 32, torch.bfloat16, "cpu", 1 << 24)
    assert PagedAttention(wide_blocks, HEADS, KV_HEADS, DIM, True).pages_decode
    packed = QuantizedKVPool(
        LAYERS, KV_HEADS, DIM, BS, torch.float32, "cpu", 1 << 26, "int4", staging_blocks=4
    )
    assert not PagedAttention(packed, HEADS, KV_HEADS, DIM, True).pages_decode


@pytest.fixture(scope="module")
def paged_engines():
    """The kernel through the whole engine, fp32 and bf16."""
    engines = {
        dtype: Engine(EngineConfig(dtype=dtype, kv_cache_bytes=64 * MIB, paged_decode=True))
        for dtype in ("float32", "bfloat16")
    }
    assert all(e.model.attention.pages_decode for e in engines.values())
    return engines


@pytest.mark.slow
def test_an_engine_decoding_through_the_kernel_generates_what_the_gather_path_does(
    paged_engines,
):
    """fp32: the same 48 greedy tokens as the gather + SDPA engine, five prompts batched
    together (test_generation.py holds the engine to transformers' `generate`)."""
    gather = Engine(EngineConfig(dtype="float32", kv_cache_bytes=64 * MIB, paged_decode=False))
    assert not gather.model.attention.pages_decode
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = ["The history of the printing press", "def fibonacci(n):", "Paris is", "1, 2, 3,"]
    prompts.append(" ".join(["a long prompt of many words"] * 120))  # 720+ tokens: 2 pieces
    want = gather.generate(prompts, greedy)
    got = paged_engines["float32"].generate(prompts, greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.slow
def test_a_bf16_request_decodes_the_same_tokens_alone_and_batched(paged_engines):
    engine = paged_engines["bfloat16"]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    long_prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 80)
    (alone,) = engine.generate([long_prompt], greedy)
    engine.reset_prefix_cache()
    batched = engine.generate(["Tell me a story.", long_prompt, "Paris is"], greedy)
    assert batched[1].token_ids == alone.token_ids
