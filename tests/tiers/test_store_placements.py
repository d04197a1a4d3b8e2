"""TieredStore's placement listener: every change of where a chunk is served from is told, in
order, so a listener that replays the calls ends with the store's own index."""

from __future__ import annotations

from kvtier.tiers import Chunk, SizeOnlyTier, TieredStore

CHUNK = 16 * 1024  # make_payload(tokens=16)


def chunk(i: int) -> Chunk:
    return Chunk((i.to_bytes(4, "big") * 8,), "t")


class Replay:
    """The calls received, and where each chunk is after replaying them."""

    def __init__(self) -> None:
        self.calls: list[tuple[bytes, str | None, str | None]] = []
        self.where: dict[bytes, str] = {}

    def __call__(self, chunk_id: bytes, left: str | None, entered: str | None) -> None:
        self.calls.append((chunk_id, left, entered))
        if left is not None:
            assert self.where.pop(chunk_id) == left  # it left where it was said to be
        if entered is not None:
            assert chunk_id not in self.where  # one place per chunk
            self.where[chunk_id] = entered


def index_of(store: TieredStore) -> dict[bytes, str]:
    return {cid: tier for tier in store.order for cid in store.chunks_in(tier)}


def test_writes_demotions_drops_and_deletes_are_told_in_order(make_payload) -> None:
    host, disk = SizeOnlyTier("host", 2 * CHUNK), SizeOnlyTier("disk", 2 * CHUNK)
    store = TieredStore([host, disk])
    replay = Replay()
    store.listener = replay
    for i in range(5):  # host holds 2, disk 2: chunk 0 falls off the last tier
        assert store.put(chunk(i), make_payload(seed=i))
    assert replay.where == index_of(store)
    ids = [chunk(i).id for i in range(5)]
    assert (ids[0], None, "host") in replay.calls
    assert (ids[0], "host", "disk") not in replay.calls  # a move is a leave then an enter
    assert (ids[0], "host", None) in replay.calls and (ids[0], None, "disk") in replay.calls
    assert (ids[0], "disk", None) in replay.calls  # dropped to make room on disk
    assert ids[0] not in replay.where

    store.demote(ids[4])  # host -> disk, which drops its oldest
    store.delete(ids[3])
    assert replay.where == index_of(store)
    assert ids[3] not in replay.where and replay.where[ids[4]] == "disk"


def test_a_chunk_written_again_where_it_is_is_not_told_twice(make_payload) -> None:
    store = TieredStore([SizeOnlyTier("host", 4 * CHUNK)])
    replay = Replay()
    store.listener = replay
    store.put(chunk(1), make_payload())
    store.put(chunk(1), make_payload())
    assert replay.calls == [(chunk(1).id, None, "host")]


def test_a_tier_dropping_a_chunk_on_its_own_is_told(make_payload) -> None:
    host = SizeOnlyTier("host", 4 * CHUNK)
    store = TieredStore([host])
    replay = Replay()
    store.listener = replay
    store.put(chunk(1), make_payload())
    host.on_evict(chunk(1).id, "t")  # what a disk GC or Redis' own eviction calls
    assert replay.calls[-1] == (chunk(1).id, "host", None)
    assert replay.where == index_of(store) == {}


def test_a_failing_listener_costs_its_events_not_the_write(make_payload) -> None:
    store = TieredStore([SizeOnlyTier("host", 4 * CHUNK)])

    def broken(*_: object) -> None:
        raise RuntimeError("listener bug")

    store.listener = broken
    assert store.put(chunk(1), make_payload())
    assert store.locate(chunk(1).id) is not None
