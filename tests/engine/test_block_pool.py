"""Block pool and KV pool: LRU of idle cached blocks, lifecycle events, stored forms."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.block_pool import BlockPool
from kvtier.engine.hooks import FULL_FORM
from kvtier.engine.kv_pool import KVPool
from kvtier.errors import KvtierError


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_block_filled(self, block_id: int, key: bytes) -> None:
        self.events.append(("filled", block_id, key))

    def on_block_freed(self, block_id: int) -> None:
        self.events.append(("freed", block_id))

    def on_block_evicted(self, block_id: int, key: bytes) -> None:
        self.events.append(("evicted", block_id, key))


def test_idle_cached_blocks_are_evicted_oldest_first_and_only_when_needed():
    pool = BlockPool(4)
    recorder = Recorder()
    pool.add_listener(recorder)
    a, b, c, d = pool.allocate(4)
    for block_id, key in ((a, b"A"), (b, b"B"), (c, b"C")):
        assert pool.cache_block(block_id, key)
    pool.release([b])
    pool.release([a])
    pool.release([d])  # never cached: straight back to the free queue
    assert pool.num_allocatable == 3 and pool.lookup(b"A") == a  # idle, still hittable

    (first,) = pool.allocate(1)
    assert first == d  # free blocks go before any cached one is evicted
    (second,) = pool.allocate(1)
    assert second == b and pool.lookup(b"B") is None  # the least recently freed goes first
    assert recorder.events == [
        ("filled", a, b"A"),
        ("filled", b, b"B"),
        ("filled", c, b"C"),
        ("freed", b),
        ("freed", a),
        ("evicted", b, b"B"),
    ]


def test_a_hit_revives_an_idle_block_and_protects_it_from_eviction():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"A")
    pool.release([a])
    pool.touch([a])
    assert pool.ref_counts[a] == 1 and pool.num_allocatable == 1
    with pytest.raises(RuntimeError):
        pool.allocate(2)


def test_duplicate_content_keeps_the_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, b"K")
    assert not pool.cache_block(b, b"K")
    pool.release([b])
    assert list(pool.free_block_ids) == [b]  # the duplicate is simply free again


def test_kv_pool_never_exceeds_its_budget():
    pool = KVPool(30, 3, 64, 16, torch.bfloat16, "cpu", budget_bytes=10 * 368_640 + 5)
    assert pool.bytes_per_block == 30 * 2 * 16 * 3 * 64 * 2 == 368_640
    assert pool.num_blocks == 10
    assert pool.kv.numel() * pool.kv.element_size() == pool.capacity_bytes <= 10 * 368_640 + 5
    with pytest.raises(KvtierError, match="smaller than one KV block"):
        KVPool(30, 3, 64, 16, torch.bfloat16, "cpu", budget_bytes=1000)


class HalfCodec:
    """A lossy stored form: float16 payload."""

    form = "fp16"

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        return block.to(torch.float16)

    def decode(self, payload: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return payload.reshape(shape).to(dtype)


def test_blocks_copy_out_and_in_through_a_codec():
    pool = KVPool(2, 1, 4, 4, torch.float32, "cpu", budget_bytes=3 * 2 * 2 * 4 * 4 * 4)
    pool.kv[1].normal_()
    full = pool.read_block(1)
    assert torch.equal(full, pool.kv[1]) and full.data_ptr() != pool.kv[1].data_ptr()
    pool.write_block(2, full)
    assert torch.equal(pool.kv[2], pool.kv[1])

    meta = BlockPool(3)
    payload = pool.read_block(1, HalfCodec())
    assert payload.dtype == torch.float16
    pool.write_block(0, payload, HalfCodec())
    meta.set_form(0, HalfCodec.form)
    assert torch.allclose(pool.kv[0], pool.kv[1], atol=1e-2)
    assert meta.forms[0] == "fp16"
    meta.allocate(1)  # a fresh owner recomputes the block: exact again
    assert meta.forms[0] == FULL_FORM


@pytest.mark.parametrize("ids", [[2, 3, 4], [5, 1, 2, 7], [6, 3]])
def test_write_blocks_fills_each_block_wherever_the_ids_point(ids):
    """Adjacent ids are copied as one run, scattered ones each on their own: either way
    block `ids[i]` receives `blocks[i]`, and no other block changes."""
    pool = KVPool(2, 1, 4, 4, torch.float32, "cpu", budget_bytes=8 * 2 * 2 * 4 * 4 * 4)
    pool.kv.normal_()
    before = pool.kv.clone()
    blocks = torch.randn(len(ids), *pool.block_shape)
    pool.write_blocks(ids, blocks)
    for i, block in enumerate(ids):
        assert torch.equal(pool.kv[block], blocks[i])
    untouched = [b for b in range(pool.num_blocks) if b not in ids]
    assert torch.equal(pool.kv[untouched], before[untouched])
    assert torch.equal(pool.read_blocks(ids), blocks)


def test_block_view_is_the_blocks_themselves_only_when_adjacent():
    pool = KVPool(2, 1, 4, 4, torch.float32, "cpu", budget_bytes=8 * 2 * 2 * 4 * 4 * 4)
    view = pool.block_view([3, 4, 5])
    assert view is not None and view.shape == (3, *pool.block_shape)
    view.fill_(7.0)  # writing the view is writing the pool
    assert bool((pool.kv[3:6] == 7.0).all()) and not bool((pool.kv[2] == 7.0).any())
    assert pool.block_view([3, 5]) is None
    assert pool.block_view([4, 3]) is None
    assert pool.block_view([]) is None


def test_a_steps_writes_land_in_their_slots_whole_blocks_as_slabs():
    """One step: two decodes, a chunk starting mid-block over adjacent blocks and one over
    scattered blocks. Every token's K/V of every layer lands at (block, offset), nothing
    else changes, and only the chunks' whole blocks take the slab path."""
    pool = KVPool(3, 2, 4, 4, torch.float32, "cpu", budget_bytes=16 * 3 * 2 * 2 * 4 * 4 * 4)
    pool.kv.normal_()
    before = pool.kv.clone()
    tables = {"d1": [9], "d2": [15, 0], "a": [1, 2, 3, 4], "b": [12, 7, 8, 11]}
    spans = [("d1", 2, 1), ("d2", 5, 1), ("a", 3, 12), ("b", 0, 13)]  # (table, start, n)
    slots = [(tables[t][p // 4], p % 4) for t, s, n in spans for p in range(s, s + n)]
    block_ids = torch.tensor([b for b, _ in slots])
    offsets = torch.tensor([o for _, o in slots])
    plan = pool.plan_writes(block_ids, offsets)
    # rows: d1 0, d2 1, a 2-13 (positions 3-14: blocks 2, 3 whole), b 14-26 (blocks 12, 7, 8)
    assert plan.runs == [(3, 2, 2), (14, 12, 1), (18, 7, 2)]
    written = []
    for layer in range(3):
        k, v = torch.randn(len(slots), 2, 4), torch.randn(len(slots), 2, 4)
        pool.write_slots(layer, plan, k, v)
        written.append((k, v))
    for layer, (k, v) in enumerate(written):
        for row, (block, offset) in enumerate(slots):
            assert torch.equal(pool.kv[block, layer, 0, :, offset], k[row])
            assert torch.equal(pool.kv[block, layer, 1, :, offset], v[row])
            before[block, layer, :, :, offset] = pool.kv[block, layer, :, :, offset]
    assert torch.equal(pool.kv, before)


def test_kept_blocks_are_reused_after_free_ones_and_before_the_lru_least_recent_first():
    """Blocks went idle in the order c, a, b; a policy then moved the content of b, and later
    of a, to a lower tier: their blocks are kept. The pool hands out the free block first,
    then the kept ones in the order they went idle (a before b, whatever the order they were
    kept in), and only then the LRU's idle cached block c; each reuse evicts the key."""
    pool = BlockPool(4)
    recorder = Recorder()
    pool.add_listener(recorder)
    a, b, c, d = pool.allocate(4)
    for block_id, key in ((a, b"A"), (b, b"B"), (c, b"C")):
        pool.cache_block(block_id, key)
    pool.release([c, a, b, d])  # LRU order c, a, b; d never cached
    assert pool.keep([b]) == 1 and pool.keep([a, d]) == 1  # d is free, not cached
    assert pool.num_kept == 2 and pool.num_allocatable == 4 and pool.num_cached_idle == 3
    assert pool.lookup(b"A") == a and pool.resident(b"A") is None  # hittable, not resident
    assert pool.resident(b"C") == c
    assert pool.allocate(3) == [d, a, b]
    assert pool.lookup(b"B") is None and pool.lookup(b"A") is None
    assert pool.lookup(b"C") == c and pool.num_kept == 0
    assert [e for e in recorder.events if e[0] == "evicted"] == [
        ("evicted", a, b"A"),
        ("evicted", b, b"B"),
    ]


def test_a_hit_takes_a_kept_block_back_and_only_idle_cached_blocks_can_be_kept():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"A")
    pool.cache_block(b, b"B")
    pool.release([a])
    assert pool.keep([a, b, c]) == 1  # b is in use, c holds no key
    pool.touch([a])  # a prefix hit on a's key
    assert pool.ref_counts[a] == 1 and pool.num_kept == 0 and pool.num_kept_hits == 1
    assert pool.resident(b"A") == a
    pool.release([a])  # idle again: back in the LRU, no longer kept
    assert pool.num_kept == 0 and pool.is_idle_cached(a)
    assert pool.keep([a]) == 1 and pool.drop_cached([a]) == 1 and pool.drop_cached([a]) == 0
    assert pool.lookup(b"A") is None and pool.num_kept == 0 and pool.num_allocatable == 1
    pool.release([b])
    pool.keep([b])
    assert pool.reset_prefix_cache() == 1 and pool.num_allocatable == 2  # c is still in use


def test_a_block_kept_again_after_a_hit_is_reused_by_its_new_idle_time():
    """a went idle before b and both were kept; a prefix hit took a back and it went idle
    again, now after b. Kept again, it is reused after b: its first stay is forgotten."""
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"A")
    pool.cache_block(b, b"B")
    pool.release([a, b, c])
    assert pool.keep([a, b]) == 2
    pool.touch([a])
    pool.release([a])
    assert pool.keep([a]) == 1 and pool.num_kept == 2
    assert pool.allocate(3) == [c, b, a]
