"""Local disk / NVMe tier: append-only segment files under a byte budget.

Layout and recovery are in `segment.py` and `record.py`. The budget counts the bytes of the
segment files on disk, dead records, padding and segment headers included, so the directory
never holds more than `capacity_bytes`. Before an append would pass it, the oldest segment
goes: if few of its records are still live (at most `compact_below` of its bytes) and there is
room, they are copied forward into the active segment first; otherwise they are evicted (the
store is told, and recomputes them if they are asked for again). Oldest-first keeps writes
sequential and makes the tier a FIFO cache at segment granularity, the way log-structured flash
caches work (CacheLib's BlockCache, Kangaroo).

With `persist=True` the files outlive `close()` and are scanned back into the index at the next
start (deletes write a small tombstone so they stay deleted); without it they are removed on
`close()` and any left by a crashed run are removed at start.

The budget must fit on the filesystem: at start a budget larger than the free space (plus what
the tier's own segments already take) is capped to it, with a warning, so the tier collects its
oldest segments instead of filling the filesystem. A write the filesystem still refuses (the
space taken by something else since) fails that put, and is logged and counted by reason
(`TierBackend._failed`); reads go on.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import torch

from kvtier.errors import KvtierError
from kvtier.tiers.base import CorruptRecord, LayerRead, TierBackend, TierEntry, TierError
from kvtier.tiers.crypto import Sealer, Signer
from kvtier.tiers.payload import Payload, aligned_bytes, as_buffer, empty_bytes
from kvtier.tiers.record import (
    FLAG_SEALED,
    LayerCheck,
    RecordCodec,
    RecordHead,
    align_up,
    deliver,
    parse_head,
)
from kvtier.tiers.segment import (
    DIRECT_ALIGN,
    HEADER_BYTES,
    SUFFIX,
    AlignedBuffer,
    Segment,
    record_align,
)

log = logging.getLogger(__name__)

_MAX_SEGMENT_BYTES = 256 * 2**20
_MIN_SEGMENTS = 8  # a budget holds at least this many segments (see `segment_bytes`)
_MIN_CAPACITY = 4 * HEADER_BYTES


@dataclass(slots=True)
class _Loc:
    segment: Segment
    offset: int
    head: RecordHead


class DiskTier(TierBackend):
    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        segment_bytes: int | None = None,
        direct: bool = False,
        persist: bool = False,
        sealer: Sealer | None = None,
        signer: Signer | None = None,
        compact_below: float = 0.25,
        layered: bool = False,
        name: str = "disk",
    ) -> None:
        """
        segment_bytes: target size of one segment file: 256 MiB by default and never more
            than capacity/8, so GC frees space in steps of at most an eighth of the budget.
        direct: write and read with O_DIRECT (page cache bypassed, 4 KiB-aligned records);
            falls back to buffered I/O, with a log line, where the filesystem refuses it.
        sealer, signer: encrypt and authenticate records (AES-GCM) or only authenticate them
            (GMAC); at most one. Tombstones are neither: a forged one can only delete.
        layered: write full-precision chunks as layered records (record.py), read back a
            layer at a time by the pipelined restore (signed and sealed ones too: a sealed
            layer is read into the slabs and decrypted there, in place); not under O_DIRECT
            (every iovec would have to be page-aligned in memory and length, which not every
            model's layer slices are: those tiers keep whole-record reads).
        """
        super().__init__(name)
        if capacity_bytes < _MIN_CAPACITY:
            raise ValueError("disk tier capacity must be at least 16 KiB")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._capacity = self._within_free_space(capacity_bytes)
        self.segment_bytes = max(
            2 * HEADER_BYTES,
            min(segment_bytes or _MAX_SEGMENT_BYTES, self._capacity // _MIN_SEGMENTS),
        )
        self.persist = persist
        self.compact_below = compact_below
        # Reentrant: used_bytes is read both by callers and from inside locked operations.
        self._lock = threading.RLock()
        self._bounce = AlignedBuffer()
        self._lock_file = self._take_directory_lock()
        self.direct = direct and _direct_io_works(self.directory, self._bounce)
        if direct and not self.direct:
            log.info("%s: O_DIRECT refused by the filesystem; using buffered I/O", self.directory)
        # layered records are read by buffered preadv only (see `layered` above)
        self._codec = RecordCodec(sealer, signer, layered=layered and not self.direct)
        self._segments: dict[int, Segment] = {}  # oldest first
        self._active: Segment | None = None
        self._index: dict[tuple[str, bytes], _Loc] = {}
        # Everything written to the files (records, padding, headers, tombstones, compaction
        # copies): divided by payload bytes put, this is the write amplification.
        self.device_bytes_written = 0
        if persist:
            self._recover()
        else:
            for path in self._segment_paths():
                path.unlink()

    # -- budget --------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(segment.size for segment in self._segments.values())

    @property
    def write_amplification(self) -> float:
        return self.device_bytes_written / max(1, self.stats.bytes_written)

    def fits(self, nbytes: int) -> bool:
        # Room is made by GC inside put; only a record bigger than the whole budget cannot fit.
        return align_up(nbytes + 512, DIRECT_ALIGN) + 2 * HEADER_BYTES <= self._capacity

    # -- contract ------------------------------------------------------------------------

    def _put(self, key: bytes, payload: Payload, namespace: str) -> bool:
        # Under O_DIRECT the head fills a page, so the body starts on a page of the file and an
        # aligned payload is written, and read back, without a bounce copy.
        head_bytes, body = self._codec.encode(key, namespace, payload, page_head=self.direct)
        head = parse_head(head_bytes)
        with self._lock:
            segment, offset = self._append([head_bytes, body], head.record_len)
            if segment is None:
                return False
            self._forget(namespace, key)
            self._index[(namespace, key)] = _Loc(segment, offset, head)
            segment.live[(namespace, key)] = None
            segment.live_bytes += segment.padded(head.record_len)
        return True

    def _get(self, key: bytes, namespace: str, out: torch.Tensor | None) -> Payload | None:
        with self._lock:
            loc = self._index.get((namespace, key))
            if loc is None:
                return None
            try:
                payload = self._read(loc, out)
            except TierError:
                # A record that fails its checks once always will: stop pointing at it.
                self._forget(namespace, key)
                raise
        return deliver(payload, out)

    def _read(self, loc: _Loc, out: torch.Tensor | None) -> Payload:
        head, segment = loc.head, loc.segment
        if head.flags & FLAG_SEALED:
            # Decryption is the copy: the ciphertext is read into scratch memory first (a
            # sealed layered body is decrypted from there into `dest`'s rows, block-major).
            dest = self._codec.body_into(head, out)
            raw = segment.read(loc.offset, head.record_len, self._bounce)
            _check_same(raw, head)
            return self._codec.decode(head, raw[head.head_len :], dest, in_place=False)
        if head.layered:
            # Stored layer-major: read into scratch, then laid out block-major into `dest`.
            dest = self._codec.body_into(head, out)
            scratch = empty_bytes(head.body_len)
            found, body_sum = segment.read_record(
                loc.offset, head.head_len, as_buffer(scratch), self._bounce
            )
            _check_same(found, head)
            return self._codec.decode(head, as_buffer(scratch), dest, False, body_sum)
        if segment.direct and (out is None or out.device.type != "cpu"):
            # A fresh buffer of our own: page-aligned, so O_DIRECT reads into it directly.
            dest = aligned_bytes(head.payload_nbytes, DIRECT_ALIGN)
        else:
            dest = self._codec.body_into(head, out)
        body = as_buffer(dest)
        found, body_sum = segment.read_record(loc.offset, head.head_len, body, self._bounce)
        _check_same(found, head)
        return self._codec.decode(head, body, dest, in_place=True, body_sum=body_sum)

    def _delete(self, key: bytes, namespace: str) -> None:
        with self._lock:
            if self._forget(namespace, key) and self.persist:
                # Without a tombstone the next start's scan would bring the record back.
                tombstone = self._codec.tombstone(key, namespace)
                self._append([tombstone], len(tombstone))

    def _contains(self, key: bytes, namespace: str) -> bool:
        return (namespace, key) in self._index

    @property
    def layered(self) -> bool:
        return self._codec.layered

    def layer_heads(self, keys: Sequence[tuple[bytes, str]]) -> list[RecordHead | None]:
        with self._lock:
            locs = [self._index.get((namespace, key)) for key, namespace in keys]
        heads = [
            loc.head
            if loc is not None and not loc.segment.direct and self._codec.accepts(loc.head)
            else None
            for loc in locs
        ]
        found = sum(head is not None for head in heads)
        self.stats.add(reads=found, hits=found)
        return heads

    def layer_check(self, head: RecordHead) -> LayerCheck:
        return self._codec.layer_check(head)

    def read_layer(self, items: Sequence[LayerRead], layer: int) -> list[bool]:
        return [self._read_layer(item, layer) for item in items]

    def _read_layer(self, item: LayerRead, layer: int) -> bool:
        """One preadv of the layer's contiguous range straight into the item's slabs (the
        device blocks), then its checksum (and, sealed, its decryption in place), under the
        tier's lock (GC may not unlink the segment meanwhile)."""
        start = perf_counter()
        try:
            with self._lock:
                loc = self._index.get((item.namespace, item.key))
                if loc is None or loc.head is not item.head:  # the index's own head object
                    raise TierError("record gone or rewritten since its head was read")
                offset, length = item.head.layer_span(layer)
                if sum(len(slab) for slab in item.slabs) != length:
                    raise TierError("layer slabs do not match the record's layer")
                try:
                    loc.segment.read_into(loc.offset + item.head.head_len + offset, item.slabs)
                    item.check.verify(layer, item.slabs)
                except TierError:
                    self._forget(item.namespace, item.key)
                    raise
        except Exception as exc:  # see TierBackend.get: never raises
            self._failed("layer read", item.key, exc)
            return False
        self.stats.get_latency.observe(perf_counter() - start)
        self.stats.add(bytes_read=length)
        return True

    def entries(self) -> list[TierEntry]:
        with self._lock:
            locs = sorted(self._index.values(), key=lambda loc: (loc.segment.id, loc.offset))
        return [
            TierEntry(
                loc.head.key,
                loc.head.namespace,
                loc.head.payload_nbytes,
                Payload.from_meta(None, 0, loc.head.meta).form,
            )
            for loc in locs
        ]

    def close(self) -> None:
        with self._lock:
            for segment in self._segments.values():
                segment.close()
                if not self.persist:
                    segment.path.unlink(missing_ok=True)
            self._segments.clear()
            self._index.clear()
            self._active = None
            if self._lock_file >= 0:
                if not self.persist:
                    (self.directory / "LOCK").unlink(missing_ok=True)
                os.close(self._lock_file)  # releases the flock
                self._lock_file = -1

    # -- segments and GC (all under self._lock) ------------------------------------------

    def _append(self, pieces: list, length: int) -> tuple[Segment | None, int]:
        """Append one record, collecting old segments first if the budget needs it."""
        padded = align_up(length, record_align(self.direct))
        if padded + HEADER_BYTES > self._capacity:
            return None, 0
        while True:
            roll = self._active is None or (
                self._active.size + padded > self.segment_bytes and self._active.size > HEADER_BYTES
            )
            needed = padded + (HEADER_BYTES if roll else 0)
            if self.used_bytes + needed <= self._capacity:
                break
            self._collect(next(iter(self._segments.values())))
        if roll:
            self._roll()
        assert self._active is not None
        offset = self._active.append(pieces, length, self._bounce)
        self.device_bytes_written += padded
        return self._active, offset

    def _roll(self) -> None:
        seg_id = max(self._segments, default=0) + 1
        self._active = Segment.create(self.directory, seg_id, self.direct, self._bounce)
        self._segments[seg_id] = self._active
        self.device_bytes_written += HEADER_BYTES

    def _collect(self, victim: Segment) -> None:
        """Remove the oldest segment, copying its few live records forward when that pays."""
        survivors = self._survivors(victim)
        for namespace, key in list(victim.live):
            self._forget(namespace, key)
            if (namespace, key) not in survivors:
                self._evicted(key, namespace)
        victim.close()
        victim.path.unlink(missing_ok=True)
        del self._segments[victim.id]
        if victim is self._active:
            self._active = None
        for (namespace, key), (head, raw) in survivors.items():
            if self._active is None:
                self._roll()
            assert self._active is not None
            offset = self._active.append([raw], len(raw), self._bounce)
            self.device_bytes_written += self._active.padded(len(raw))
            self._index[(namespace, key)] = _Loc(self._active, offset, head)
            self._active.live[(namespace, key)] = None
            self._active.live_bytes += self._active.padded(len(raw))

    def _survivors(self, victim: Segment) -> dict[tuple[str, bytes], tuple[RecordHead, bytes]]:
        """The live records of a mostly dead segment, read into memory before it is removed.

        Read first and written after the unlink, so the copy needs no headroom in the budget;
        at most `compact_below` of a segment is held in memory. A crash in between loses them,
        which for a cache is a few misses.
        """
        if victim is self._active or victim.live_bytes > self.compact_below * victim.size:
            return {}
        align = record_align(self.direct)
        needed = HEADER_BYTES if self._active is None else 0
        survivors = {}
        for entry in victim.live:
            loc = self._index[entry]
            raw = bytes(victim.read(loc.offset, loc.head.record_len, self._bounce))
            survivors[entry] = (loc.head, raw)
            needed += align_up(len(raw), align)
        if self.used_bytes - victim.size + needed > self._capacity:
            return {}
        return survivors

    def _forget(self, namespace: str, key: bytes) -> bool:
        """Drop a key from the index; its record becomes dead bytes until GC removes them."""
        loc = self._index.pop((namespace, key), None)
        if loc is None:
            return False
        loc.segment.live.pop((namespace, key), None)
        loc.segment.live_bytes -= loc.segment.padded(loc.head.record_len)
        return True

    # -- start-up ------------------------------------------------------------------------

    def _segment_paths(self) -> list[Path]:
        return sorted(self.directory.glob(f"*{SUFFIX}"))

    def _recover(self) -> None:
        for path in self._segment_paths():
            opened = Segment.open_existing(path, self.direct)
            if opened is None:
                path.unlink(missing_ok=True)
                continue
            segment, records = opened
            self._segments[segment.id] = segment
            for offset, head in records:
                self._forget(head.namespace, head.key)
                if not head.tombstone:
                    self._index[(head.namespace, head.key)] = _Loc(segment, offset, head)
                    segment.live[(head.namespace, head.key)] = None
                    segment.live_bytes += segment.padded(head.record_len)
        # Appends go to a fresh segment (created on the first put), never after old data.
        while self._segments and self.used_bytes > self._capacity:
            self._collect(next(iter(self._segments.values())))
        log.info(
            "%s: recovered %d records in %d segments (%d bytes)",
            self.directory,
            len(self._index),
            len(self._segments),
            self.used_bytes,
        )

    def _within_free_space(self, budget: int) -> int:
        """`budget`, or what the filesystem can hold when that is less: its free space plus
        the segments here now (recovered, or removed at start), less one filesystem block per
        segment file for the rounding of file sizes. A budget past that would have the tier
        count room that is not there: the filesystem fills and every write fails, where a
        smaller budget makes GC collect the oldest segment and go on caching."""
        fs = os.statvfs(self.directory)
        held = sum(path.stat().st_size for path in self._segment_paths())
        free = fs.f_bavail * fs.f_frsize
        files = _MIN_SEGMENTS + (free + held) // _MAX_SEGMENT_BYTES + 2
        room = (free + held - files * fs.f_frsize) // DIRECT_ALIGN * DIRECT_ALIGN
        if budget <= room:
            return budget
        if room < _MIN_CAPACITY:
            raise KvtierError(
                f"disk tier {self.directory}: its filesystem has {_mib(free)} free, less than "
                f"the {_mib(_MIN_CAPACITY)} a disk tier needs; free some space or choose "
                "another directory"
            )
        log.warning(
            "%s: the disk budget of %s is more than its filesystem can hold (%s free, %s in "
            "this tier's segments): capped to %s",
            self.directory,
            _mib(budget),
            _mib(free),
            _mib(held),
            _mib(room),
        )
        return room

    def _take_directory_lock(self) -> int:
        """One tier per directory: a second writer would interleave appends and corrupt both."""
        fd = os.open(self.directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RuntimeError(f"{self.directory} is in use by another disk tier") from exc
            raise
        return fd


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _check_same(found: memoryview, expected: RecordHead) -> None:
    if not expected.matches(found):
        raise CorruptRecord("record on disk differs from the index (stale or overwritten)")


def _direct_io_works(directory: Path, bounce: AlignedBuffer) -> bool:
    """Whether this filesystem takes O_DIRECT (tmpfs and some overlays refuse it)."""
    probe = directory / ".direct-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, bounce.view(DIRECT_ALIGN), 0)
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True
