"""The packed KV pool (EngineConfig.kv_quant): what it stores, what attention reads back.

Pool-level tests write K/V through the same calls the model makes (plan_writes, then
write_slots per layer) and read them through gather, against the group-wise quantizer of
compress/quant.py as the reference.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.compress.quant import dequantize, quantize
from kvtier.engine.hooks import IdentityCodec
from kvtier.engine.kv_pool import KVPool
from kvtier.engine.quant_pool import PackedBlockCodec, QuantizedKVPool
from kvtier.errors import KvtierError

LAYERS, HEADS, DIM, BS = 2, 3, 64, 16


def make_pool(kv_quant: str = "int4", blocks: int = 12, staging: int = 4) -> QuantizedKVPool:
    probe = QuantizedKVPool(
        LAYERS, HEADS, DIM, BS, torch.float32, "cpu", 1 << 30, kv_quant, staging_blocks=staging
    )
    budget = probe.staging_bytes + blocks * probe.bytes_per_block
    return QuantizedKVPool(
        LAYERS, HEADS, DIM, BS, torch.float32, "cpu", budget, kv_quant, staging_blocks=staging
    )


def kv_for(num_tokens: int, seed: int) -> torch.Tensor:
    """[layers, 2, tokens, heads, dim] with an outlier key channel, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(LAYERS, 2, num_tokens, HEADS, DIM, generator=g)
    x[:, 0, :, :, 3] *= 15
    return x


def write_sequence(pool: QuantizedKVPool, table: list[int], kv: torch.Tensor, chunks: list[int]):
    """Write tokens 0..n-1 of one sequence in steps of `chunks` tokens, as the runner does."""
    start = 0
    for n in chunks:
        pos = torch.arange(start, start + n)
        plan = pool.plan_writes(torch.tensor(table)[pos // BS], pos % BS)
        for layer in range(LAYERS):
            pool.write_slots(layer, plan, kv[layer, 0, pos], kv[layer, 1, pos])
        start += n


def reference(kv: torch.Tensor, bits: int, group: int = 32) -> torch.Tensor:
    """What a packed pool should read back: full blocks through quant.quantize (keys per
    channel over the block's tokens, values per token over `group` channels), the last
    partial block exact. -> [layers, 2, heads, tokens, dim]."""
    n = kv.shape[2]
    out = kv.permute(0, 1, 3, 2, 4).clone()  # [L, 2, H, T, D]
    for start in range(0, n - n % BS, BS):
        block = out[:, :, :, start : start + BS]
        keys, values = block[:, 0], block[:, 1]  # [L, H, bs, D]
        out[:, 0, :, start : start + BS] = dequantize(quantize(keys, bits, BS, 2))
        out[:, 1, :, start : start + BS] = dequantize(quantize(values, bits, group, 3))
    return out


def read_sequence(pool: QuantizedKVPool, table: list[int], n: int) -> torch.Tensor:
    layers = [torch.stack(pool.gather(layer, torch.tensor([table]))) for layer in range(LAYERS)]
    return torch.stack(layers)[:, :, 0, :, :n]  # [L, 2, H, T, D]


@pytest.mark.parametrize(("kv_quant", "bits"), [("int8", 8), ("int4", 4), ("int2", 2)])
def test_gather_reads_full_blocks_quantized_and_the_tail_exact(kv_quant, bits):
    pool = make_pool(kv_quant)
    kv = kv_for(53, seed=bits)  # 3 full blocks + 5 tokens
    table = [7, 2, 9, 4]
    write_sequence(pool, table, kv, [20, 1, 1, 25, 6])  # prefill chunks, decodes
    got = read_sequence(pool, table, 53)
    want = reference(kv, bits)
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    assert torch.equal(got[:, :, :, 48:], kv.permute(0, 1, 3, 2, 4)[:, :, :, 48:])
    assert [pool.is_staged(b) for b in table] == [False, False, False, True]


def test_how_a_sequence_is_chunked_does_not_change_what_is_stored():
    kv = kv_for(40, seed=3)
    reads = []
    for chunks in ([40], [1] * 40, [15, 2, 23]):
        pool = make_pool()
        write_sequence(pool, [1, 5, 3], kv, chunks)
        reads.append(read_sequence(pool, [1, 5, 3], 40))
    assert torch.equal(reads[0], reads[1]) and torch.equal(reads[0], reads[2])


@pytest.mark.parametrize("kv_quant", ["int8", "int4", "int2"])
def test_the_same_budget_holds_more_blocks(kv_quant):
    """Bytes per block measured from the allocated tensor, not from a formula."""
    budget = 64 << 20
    full = KVPool(30, 3, 64, 16, torch.bfloat16, "cpu", budget)
    packed = QuantizedKVPool(
        30, 3, 64, 16, torch.bfloat16, "cpu", budget, kv_quant, staging_blocks=8
    )
    measured = packed.packed.nbytes // packed.num_blocks
    assert measured == packed.bytes_per_block
    assert full.kv.nbytes // full.num_blocks == full.bytes_per_block == 368_640
    ratio = full.bytes_per_block / measured
    assert ratio > {"int8": 1.6, "int4": 2.8, "int2": 4.4}[kv_quant]
    # Budget = packed blocks + one full-precision tail per sequence (8 here).
    assert packed.staging.nbytes == 8 * full.bytes_per_block
    assert packed.packed.nbytes + packed.staging.nbytes <= budget
    assert packed.num_blocks == (budget - packed.staging.nbytes) // measured
    assert packed.num_blocks > full.num_blocks * ratio * 0.9


def test_compaction_round_trip_keeps_packed_blocks_and_stages_the_tail():
    pool = make_pool("int8")
    kv = kv_for(40, seed=5)
    write_sequence(pool, [0, 1, 2], kv, [40])
    slots = torch.tensor([0, 3, 17, 20, 33, 39]).expand(LAYERS, HEADS, -1)
    kept = pool.gather_tokens([0, 1, 2], slots)  # [L, 2, H, 6, D]
    full = read_sequence(pool, [0, 1, 2], 40)
    assert torch.equal(kept, full[:, :, :, [0, 3, 17, 20, 33, 39]])
    pool.write_tokens([8], kept)  # 6 tokens: one partial block, staged exactly
    assert pool.is_staged(8)
    assert torch.equal(read_sequence(pool, [8], 6), kept)


def test_stale_tails_of_released_blocks_are_reclaimed():
    pool = make_pool(staging=2)
    in_use = {0, 1}
    pool.block_in_use = lambda block_id: block_id in in_use
    write_sequence(pool, [0], kv_for(5, 1), [5])
    write_sequence(pool, [1], kv_for(5, 2), [5])
    in_use.discard(0)  # its request finished
    in_use.add(2)
    write_sequence(pool, [2], kv_for(3, 3), [3])
    assert pool.is_staged(2) and pool.is_staged(1) and not pool.is_staged(0)


def test_read_and_write_block_move_the_packed_bytes_as_they_are():
    pool = make_pool()
    write_sequence(pool, [3], kv_for(16, seed=8), [16])
    codec = PackedBlockCodec(pool)
    payload = pool.read_block(3, codec)
    assert payload.dtype == torch.uint8 and payload.numel() == pool.bytes_per_block
    pool.write_block(6, payload, codec)
    assert torch.equal(pool.packed[6], pool.packed[3])
    # A full-precision payload is quantized on the way in and reads back as stored.
    full = pool.read_block(3, IdentityCodec())
    assert torch.equal(codec.decode(payload, pool.block_shape, pool.dtype), full)
    pool.write_block(9, full)
    assert torch.equal(pool.packed[9], pool.packed[3])


def test_bad_settings_are_clear_errors():
    with pytest.raises(KvtierError, match="kv_quant must be one of"):
        QuantizedKVPool(2, 1, 64, 16, torch.float32, "cpu", 1 << 20, "int3")
    with pytest.raises(KvtierError, match="must divide head_dim"):
        QuantizedKVPool(2, 1, 64, 16, torch.float32, "cpu", 1 << 20, "int4", value_group=24)
    with pytest.raises(KvtierError, match="multiples of 4"):
        QuantizedKVPool(2, 1, 64, 6, torch.float32, "cpu", 1 << 20, "int2")
    with pytest.raises(KvtierError, match="lower max_num_seqs"):
        QuantizedKVPool(30, 3, 64, 16, torch.bfloat16, "cpu", 8 << 20, "int4", staging_blocks=64)
