"""Mover: spills never block, prefetches honour deadlines, failed copies retry then miss.

The failures here are the behaviour under test, so they come from a small wrapper around a real
host tier that can hold operations at a gate or fail the next N reads.
"""

from __future__ import annotations

import threading
import time

import torch

from kvtier.tiers import (
    Chunk,
    DiskTier,
    HostTier,
    Mover,
    Payload,
    TierBackend,
    TieredStore,
    TierError,
)


class GatedTier(TierBackend):
    """A real host tier whose puts (and gets of `slow` keys) wait for `gate`, and whose next
    `failing_gets` reads fail."""

    def __init__(self) -> None:
        super().__init__("host")
        self.inner = HostTier(1 << 20, slot_bytes=16 * 1024)
        self.gate = threading.Event()
        self.gate.set()
        self.slow: set[bytes] = set()
        self.failing_gets = 0

    @property
    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    def _put(self, key: bytes, payload: Payload, namespace: str) -> bool:
        self.gate.wait()
        return self.inner._put(key, payload, namespace)

    def _get(self, key: bytes, namespace: str, out: torch.Tensor | None) -> Payload | None:
        if key in self.slow:
            self.gate.wait()
        if self.failing_gets:
            self.failing_gets -= 1
            raise TierError("injected read failure")
        return self.inner._get(key, namespace, out)

    def _delete(self, key: bytes, namespace: str) -> None:
        self.inner._delete(key, namespace)

    def _contains(self, key: bytes, namespace: str) -> bool:
        return self.inner._contains(key, namespace)


def chunk(i: int) -> Chunk:
    return Chunk((bytes([i]) * 32,))


def test_spill_never_blocks_and_drops_what_the_queue_cannot_hold(make_payload) -> None:
    tier = GatedTier()
    store = TieredStore([tier])
    mover = Mover(store, spill_queue=2, spill_workers=1)
    tier.gate.clear()  # the worker stalls on its first put
    start = time.monotonic()
    futures = [mover.spill(chunk(i), make_payload(seed=i)) for i in range(10)]
    assert time.monotonic() - start < 0.1
    dropped = [f for f in futures if f.done()]
    assert all(f.result() is False for f in dropped)
    accepted = 10 - len(dropped)
    assert 2 <= accepted <= 3  # two queued, plus one in the worker's hands if it took it yet
    assert mover.counts["spills_dropped"] == len(dropped)

    tier.gate.set()
    mover.close(drain=True, timeout=5)
    assert all(f.done() for f in futures)
    assert sum(f.result() for f in futures) == accepted == len(store)


def test_prefetch_returns_what_arrived_by_the_deadline(make_payload, same) -> None:
    tier = GatedTier()
    store = TieredStore([tier])
    payloads = [make_payload(seed=i) for i in range(3)]
    for i, payload in enumerate(payloads):
        store.put(chunk(i), payload)
    mover = Mover(store, prefetch_workers=2)
    tier.slow.add(chunk(0).id)
    tier.gate.clear()

    start = time.monotonic()
    handle = mover.prefetch([chunk(i).id for i in range(3)])
    got = handle.result(timeout=0.3)
    assert 0.25 < time.monotonic() - start < 1.0
    assert got[0] is None  # still stuck at the gate: the caller recomputes it
    assert same(got[1], payloads[1]) and same(got[2], payloads[2])
    assert not handle.done()

    handle.cancel()
    tier.gate.set()
    mover.close(timeout=5)
    assert handle.done()


def test_a_failed_read_is_retried_then_becomes_a_miss(make_payload, same) -> None:
    tier = GatedTier()
    store = TieredStore([tier])
    payload = make_payload()
    store.put(chunk(0), payload)
    store.put(chunk(1), payload)
    mover = Mover(store, retries=2)

    tier.failing_gets = 2  # third attempt succeeds
    assert same(mover.prefetch([chunk(0).id]).result(timeout=5)[0], payload)
    assert tier.stats.errors == 2

    tier.failing_gets = 3  # every attempt fails
    assert mover.prefetch([chunk(1).id]).result(timeout=5) == [None]
    assert store.locate(chunk(1).id) is None  # forgotten: next time it is a plain miss
    assert mover.counts["prefetch_misses"] == 1
    mover.close()


def test_close_without_drain_cancels_queued_work(make_payload) -> None:
    tier = GatedTier()
    store = TieredStore([tier])
    mover = Mover(store, spill_queue=8, spill_workers=1)
    tier.gate.clear()
    futures = [mover.spill(chunk(i), make_payload(seed=i)) for i in range(4)]
    time.sleep(0.05)  # the worker has taken the first and waits at the gate
    threading.Timer(0.2, tier.gate.set).start()
    mover.close(drain=False, timeout=5)
    assert [f.result() for f in futures] == [True, False, False, False]
    assert mover.spill(chunk(9), make_payload()).result() is False  # closed: dropped


def test_a_queued_spill_the_caller_cancels_is_skipped(make_payload) -> None:
    tier = GatedTier()
    store = TieredStore([tier])
    mover = Mover(store, spill_workers=1)
    tier.gate.clear()
    first = mover.spill(chunk(0), make_payload())
    second = mover.spill(chunk(1), make_payload(seed=1))
    assert second.cancel()  # still queued: the caller may take it back
    tier.gate.set()
    mover.close(timeout=5)
    assert first.result() is True and second.cancelled()
    assert store.locate(chunk(1).id) is None


def test_spill_and_prefetch_through_real_tiers(tmp_path, make_payload, same) -> None:
    host = HostTier(64 * 1024, slot_bytes=16 * 1024)
    disk = DiskTier(tmp_path, 1 << 20)
    store = TieredStore([host, disk])
    mover = Mover(store)
    payloads = [make_payload(seed=i, dtype=torch.float32) for i in range(6)]  # 32 KiB each
    futures = [mover.spill(chunk(i), p) for i, p in enumerate(payloads)]
    assert all(f.result(timeout=5) for f in futures)
    assert {store.locate(chunk(i).id).tier for i in range(6)} == {"host", "disk"}
    got = mover.prefetch([chunk(i).id for i in range(6)]).result(timeout=5)
    assert all(same(g, p) for g, p in zip(got, payloads, strict=True))
    mover.close()
    disk.close()


def test_concurrent_spills_and_prefetches_serve_only_the_right_bytes(tmp_path) -> None:
    host = HostTier(128 * 1024, slot_bytes=16 * 1024)
    disk = DiskTier(tmp_path, 512 * 1024)
    store = TieredStore([host, disk])
    mover = Mover(store, spill_workers=2, prefetch_workers=2, spill_queue=16)

    def fill(i: int) -> Payload:
        return Payload.of(torch.full((16 * 1024,), i % 251, dtype=torch.uint8))

    wrong: list[int] = []

    def client(offset: int) -> None:
        for i in range(offset, offset + 60):
            mover.spill(chunk(i % 40), fill(i % 40))
            for j, got in enumerate(mover.prefetch([chunk(i % 40).id]).result(timeout=5)):
                if got is not None and not bool((got.data == (i % 40) % 251).all()):
                    wrong.append(j)

    threads = [threading.Thread(target=client, args=(k * 7,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    mover.close()
    assert not wrong
    assert host.used_bytes <= host.capacity_bytes and disk.used_bytes <= disk.capacity_bytes
    assert host.stats.errors == disk.stats.errors == 0
    disk.close()


def test_demotes_and_deletes_queue_behind_spills_without_blocking(tmp_path, make_payload, same):
    host = GatedTier()
    disk = DiskTier(tmp_path, 1 << 20)
    store = TieredStore([host, disk])
    mover = Mover(store, spill_workers=1)
    payload = make_payload()
    host.gate.clear()  # the first spill stalls: everything after it waits in the queue
    start = time.monotonic()
    spilled = [mover.spill(chunk(i), payload) for i in range(2)]
    demoted = mover.demote(chunk(0).id, "disk")
    deleted = mover.delete(chunk(1).id)
    assert time.monotonic() - start < 0.1
    assert not any(f.done() for f in (*spilled, demoted, deleted))
    host.gate.set()
    assert all(f.result(timeout=5) for f in (*spilled, demoted, deleted))
    # one worker runs them in queue order: chunk 0 landed, then went down; chunk 1 is gone
    assert store.locate(chunk(0).id).tier == "disk"
    assert same(store.promote(chunk(0).id), payload)
    assert store.locate(chunk(1).id) is None
    assert mover.counts["demotes"] == mover.counts["deletes"] == 1
    assert mover.counts["demotes_failed"] == mover.counts["deletes_failed"] == 0
    mover.close()
    disk.close()
