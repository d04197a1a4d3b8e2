"""Device copy strategies (engine/device_copy.py) on CPU, and the spill's wait for its bytes.

The CUDA strategy's tests are in test_cuda.py (skipped without a GPU)."""

from __future__ import annotations

import threading

import torch

from kvtier.engine.device_copy import CpuCopy, HostBlocks, device_index, for_device
from kvtier.engine.kv_pool import KVPool
from kvtier.tiers import Chunk, HostTier, Mover, Payload, TieredStore
from kvtier.tiers.record import PAGE_BYTES

KIB = 1 << 10


def small_pool() -> KVPool:
    pool = KVPool(2, 2, 8, 4, torch.float32, "cpu", 16 * 2 * 2 * 2 * 4 * 8 * 4)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(0)))
    return pool


def test_cpu_is_chosen_for_cpu_and_index_is_plain() -> None:
    assert isinstance(for_device(torch.device("cpu")), CpuCopy)
    index = device_index([3, 1, 2], torch.device("cpu"))
    assert index.dtype == torch.long and index.tolist() == [3, 1, 2]


def test_save_copies_blocks_into_page_aligned_memory_that_outlives_the_pool_blocks() -> None:
    pool = small_pool()
    expected = pool.kv[[5, 2, 9]].clone()
    saved = CpuCopy().save(pool, [5, 2, 9])
    assert isinstance(saved, HostBlocks)
    saved.ready()  # nothing in flight on CPU
    assert saved.blocks.data_ptr() % PAGE_BYTES == 0
    assert torch.equal(saved.blocks, expected)
    pool.kv[[5, 2, 9]] = 0  # the pool reuses the blocks: the copy keeps its bytes
    assert torch.equal(saved.blocks, expected)


def test_load_fills_exactly_the_given_blocks() -> None:
    pool = small_pool()
    before = pool.kv.clone()
    blocks = torch.randn((2, *pool.block_shape))
    CpuCopy().load(pool, [7, 0], blocks)
    assert torch.equal(pool.kv[7], blocks[0]) and torch.equal(pool.kv[0], blocks[1])
    untouched = [i for i in range(pool.num_blocks) if i not in (0, 7)]
    assert torch.equal(pool.kv[untouched], before[untouched])


def test_save_then_load_round_trips_through_other_blocks() -> None:
    pool = small_pool()
    copy = CpuCopy()
    saved = copy.save(pool, [1, 2, 3])
    copy.load(pool, [10, 11, 12], saved.blocks)
    assert torch.equal(pool.kv[10:13], pool.kv[1:4])


def test_mover_runs_ready_before_the_tier_reads_the_bytes() -> None:
    """A spill's bytes may still be on their way (a GPU copy): the worker waits for them."""
    host = HostTier(64 * KIB, slot_bytes=4 * KIB)
    mover = Mover(TieredStore([host]))
    data = torch.zeros(8 * KIB, dtype=torch.uint8)
    arrived = torch.arange(8 * KIB, dtype=torch.int64).remainder(251).to(torch.uint8)
    release = threading.Event()

    def ready() -> None:
        # the copy "lands" only when the test lets it
        assert release.wait(10)
        data.copy_(arrived)

    chunk = Chunk((b"k" * 16,), "default")
    try:
        future = mover.spill(chunk, Payload.of(data), ready=ready)
        assert not future.done()  # the caller did not wait
        release.set()
        assert future.result(10) is True
        stored = mover.store.promote(chunk.id)
        assert stored is not None and torch.equal(stored.data, arrived)
    finally:
        mover.close()
