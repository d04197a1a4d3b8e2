"""One append-only segment file of the disk tier: a header block, then records back to back.

A segment is written only at its end and never rewritten in place, so a crash can damage at
most the record being appended. Other damage (a zeroed or rewritten region mid-file: a bad
sector, a stray write) can hit any record, so the start-up scan does not stop at a head that
does not check out: records are self-describing, so it searches forward, at the alignment
records start at, for the next magic whose head checksum verifies and whose body fits in the
file, and goes on from there. Records and tombstones after a damaged region still count; the
damaged bytes stay in the file as dead bytes until GC removes the segment. Only what follows
the last intact record (a torn tail) is truncated, so later appends never follow garbage.
Records (see
`record.py`) start at multiples of the segment's alignment: 4096 when it was written with
O_DIRECT, 64 otherwise; the alignment is stored in the segment header so a segment is read back
correctly whatever mode the tier runs in later.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from pathlib import Path

import numpy as np
import xxhash

from kvtier.tiers.base import TierError
from kvtier.tiers.payload import BytesLike
from kvtier.tiers.record import (
    FIXED_BYTES,
    HEAD_ALIGN,
    MAGIC,
    PAGE_BYTES,
    RecordHead,
    align_up,
    head_len,
    parse_head,
)

log = logging.getLogger(__name__)

HEADER_BYTES = PAGE_BYTES  # one page, so records after it are aligned for O_DIRECT
DIRECT_ALIGN = PAGE_BYTES
SUFFIX = ".seg"
_MAGIC = b"KVTSEG01"
_HEADER = struct.Struct("<8sIQd")  # magic, alignment, segment id, created (Unix seconds)
_SUM = struct.Struct("<Q")
# Buffered reads hash the body after reading it, while it is in the CPU cache: one preadv and
# one hash for a 256-token chunk (5.6 MiB), measured faster here than 0.5-4 MiB pieces (one
# syscall each); bigger bodies go in pieces that still fit in L3 next to other work.
_HASH_PIECE_BYTES = 8 << 20
_SEARCH_BYTES = 4 << 20  # read at a time while looking for the next record past damage


def record_align(direct: bool) -> int:
    """Where records start: page multiples for O_DIRECT, else 64 (see record.HEAD_ALIGN)."""
    return DIRECT_ALIGN if direct else HEAD_ALIGN


class AlignedBuffer:
    """A page-aligned scratch buffer (anonymous mmap) for O_DIRECT reads and writes."""

    def __init__(self, nbytes: int = 1 << 20) -> None:
        self._map = mmap.mmap(-1, align_up(nbytes, mmap.PAGESIZE))

    def view(self, nbytes: int) -> memoryview:
        if nbytes > len(self._map):
            # Grown rarely (a bigger chunk than seen so far) and never shrunk.
            self._map = mmap.mmap(-1, align_up(nbytes, mmap.PAGESIZE))
        return memoryview(self._map)[:nbytes]


class Segment:
    """An open segment file. `size` is where the next record goes and what the budget counts."""

    def __init__(self, path: Path, seg_id: int, align: int, fd: int, size: int) -> None:
        self.path = path
        self.id = seg_id
        self.align = align
        self.fd = fd
        self.size = size
        self.direct = align >= DIRECT_ALIGN
        # Maintained by the disk tier: which records here are still the current copy of a key.
        self.live: dict[tuple[str, bytes], None] = {}  # in write order
        self.live_bytes = 0

    @classmethod
    def create(cls, directory: Path, seg_id: int, direct: bool, bounce: AlignedBuffer) -> Segment:
        path = directory / f"{seg_id:012d}{SUFFIX}"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
        fd = os.open(path, flags, 0o600)
        align = record_align(direct)
        fields = _HEADER.pack(_MAGIC, align, seg_id, 0.0)
        header = fields + _SUM.pack(xxhash.xxh3_64_intdigest(fields))
        segment = cls(path, seg_id, align, fd, 0)
        try:
            segment.append([header], len(header), bounce, pad_to=HEADER_BYTES)
        except OSError:
            segment.close()
            path.unlink(missing_ok=True)
            raise
        return segment

    @classmethod
    def open_existing(
        cls, path: Path, direct: bool
    ) -> tuple[Segment, list[tuple[int, RecordHead]]] | None:
        """Open a segment left by an earlier run and list its intact records in order.

        None when the file is not a readable segment (the caller removes it). A damaged record
        is skipped (see the module doc); the file is truncated after the last intact record.
        """
        fd = os.open(path, os.O_RDWR)
        try:
            header = os.pread(fd, _HEADER.size + _SUM.size, 0)
            if len(header) < _HEADER.size + _SUM.size:
                raise TierError("segment header cut short")
            magic, align, seg_id, _ = _HEADER.unpack_from(header)
            (header_sum,) = _SUM.unpack_from(header, _HEADER.size)
            if magic != _MAGIC or header_sum != xxhash.xxh3_64_intdigest(header[: _HEADER.size]):
                raise TierError("segment header corrupt")
            records, end, skipped = _scan(fd, align, os.fstat(fd).st_size)
            if skipped:
                log.warning("%s: skipped %d damaged bytes between intact records", path, skipped)
            if os.fstat(fd).st_size > end:
                log.warning("%s: dropping a torn or corrupt tail after byte %d", path, end)
                os.ftruncate(fd, end)
        except (OSError, TierError) as exc:
            log.warning("%s: not a usable segment (%s); removing it", path, exc)
            os.close(fd)
            return None
        if direct and align >= DIRECT_ALIGN:
            # Reopen for O_DIRECT reads now that the buffered scan is done.
            os.close(fd)
            fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        return cls(path, seg_id, align, fd, end), records

    def append(
        self, pieces: list[BytesLike], length: int, bounce: AlignedBuffer, pad_to: int = 0
    ) -> int:
        """Write `pieces` (`length` bytes in all) at the end, zero-padded to the alignment;
        returns their offset.

        Buffered, the pieces go out as they are (one pwritev). O_DIRECT moves whole aligned
        blocks from aligned memory, so a piece goes out from its own memory when it starts at a
        page of the file and of memory (a payload after a page head, in page-aligned memory);
        the rest of the record (heads, unaligned memory, the last partial block, the padding) is
        copied into the aligned bounce buffer. A payload from torch's allocator is not page-
        aligned (see payload.aligned_bytes) and is copied whole, as before.
        """
        offset = self.size
        padded = align_up(max(length, pad_to), self.align)
        views = [memoryview(piece).cast("B") for piece in pieces]
        if self.direct:
            views = _stage_for_direct(views, padded - length, bounce)
        elif padded != length:
            views.append(memoryview(bytes(padded - length)))  # padding is written, not a hole
        _write_all(self.fd, views, offset)
        self.size = offset + padded
        return offset

    def read(self, offset: int, length: int, bounce: AlignedBuffer) -> memoryview:
        """`length` bytes at `offset`, through the aligned buffer when the file is O_DIRECT."""
        if self.direct:
            span = align_up(length, self.align)
            buf = bounce.view(span)
            _read_all(self.fd, [buf], offset)
            return buf[:length]
        buf = memoryview(bytearray(length))
        _read_all(self.fd, [buf], offset)
        return buf

    def read_into(self, offset: int, targets: list[memoryview]) -> None:
        """Fill `targets` in order from the bytes at `offset` (one preadv; buffered files)."""
        if self.direct:
            raise TierError("scattered reads need a buffered segment")
        _read_all(self.fd, targets, offset)

    def read_record(
        self, offset: int, head_len: int, body: memoryview, bounce: AlignedBuffer
    ) -> tuple[memoryview, int]:
        """Read a record whose body goes into `body`; returns its head (valid until the bounce
        buffer is used again) and the xxh3-64 of the body as it now lies in `body`.

        Buffered: one preadv of head and body straight into the caller's memory, then one hash
        pass while the bytes are still in the CPU cache (`_HASH_PIECE_BYTES` at a time for
        bodies bigger than that). O_DIRECT: straight into `body` as well when the body starts on
        a page of the file (a page head) and `body` on a page of memory; otherwise through the
        bounce buffer and one copy.
        """
        fd = self.fd
        if not self.direct:
            head = memoryview(bytearray(head_len))
            hasher = xxhash.xxh3_64()
            first = body[:_HASH_PIECE_BYTES]
            _read_all(fd, [head, first], offset)
            hasher.update(first)
            for start in range(len(first), len(body), _HASH_PIECE_BYTES):
                piece = body[start : start + _HASH_PIECE_BYTES]
                _read_all(fd, [piece], offset + head_len + start)
                hasher.update(piece)
            return head, hasher.intdigest()
        whole = len(body) // DIRECT_ALIGN * DIRECT_ALIGN
        if head_len % DIRECT_ALIGN or not whole or _address(body) % DIRECT_ALIGN:
            raw = self.read(offset, head_len + len(body), bounce)
            body[:] = raw[head_len:]
            return raw[:head_len], xxhash.xxh3_64_intdigest(body)
        # The last partial block lands in the bounce buffer after the head, then is copied.
        tail = len(body) - whole
        scratch = bounce.view(head_len + (DIRECT_ALIGN if tail else 0))
        targets = [scratch[:head_len], body[:whole]]
        if tail:
            targets.append(scratch[head_len:])
        _read_all(fd, targets, offset)
        if tail:
            body[whole:] = scratch[head_len : head_len + tail]
        return scratch[:head_len], xxhash.xxh3_64_intdigest(body)

    def padded(self, record_len: int) -> int:
        return align_up(record_len, self.align)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _scan(fd: int, align: int, file_size: int) -> tuple[list[tuple[int, RecordHead]], int, int]:
    """The intact records in file order, where the last of them ends, and how many bytes
    between intact records were skipped as damaged."""
    records: list[tuple[int, RecordHead]] = []
    offset = end = HEADER_BYTES
    skipped = 0
    while offset + FIXED_BYTES <= file_size:
        head = _intact_head(fd, offset, file_size)
        if head is None:
            found = _next_magic(fd, offset + align, align, file_size)
            if found is None:
                break  # nothing intact after: a torn tail (or damage up to the end)
            offset = found
            continue
        skipped += offset - end
        records.append((offset, head))
        # Padding may be missing after a torn final write; the next record then starts at
        # the aligned offset anyway (a hole, counted in the budget as if written).
        offset = end = align_up(offset + head.record_len, align)
    return records, min(end, file_size), skipped


def _intact_head(fd: int, offset: int, file_size: int) -> RecordHead | None:
    """The head at `offset` when it checks out and its body fits in the file, else None."""
    try:
        head = parse_head(os.pread(fd, head_len(os.pread(fd, FIXED_BYTES, offset)), offset))
    except TierError:
        return None
    return head if offset + head.record_len <= file_size else None


def _next_magic(fd: int, start: int, align: int, file_size: int) -> int | None:
    """The first multiple of `align` at or after `start` (itself one) where MAGIC is: where a
    record may start. Reads `_SEARCH_BYTES` (a multiple of any alignment) at a time, so an
    aligned position's magic never straddles two reads."""
    for pos in range(start, file_size, _SEARCH_BYTES):
        block = os.pread(fd, _SEARCH_BYTES, pos)
        at = block.find(MAGIC)
        while at != -1:
            if at % align == 0:
                return pos + at
            at = block.find(MAGIC, at + 1)
    return None


def _stage_for_direct(views: list[memoryview], pad: int, bounce: AlignedBuffer) -> list:
    """The iovecs for an O_DIRECT write of `views` and `pad` zero bytes: each piece that
    starts on a page of the file and of memory goes out from its own memory (its whole pages);
    everything else is copied into the bounce buffer, whose runs are all page multiples."""
    # Sized for the worst case, all of it staged; pages never touched cost no memory.
    buf = bounce.view(sum(len(view) for view in views) + pad)
    iov: list[memoryview] = []
    run_start = staged = 0
    for view in views:
        whole = len(view) // DIRECT_ALIGN * DIRECT_ALIGN
        if whole and staged % DIRECT_ALIGN == 0 and _address(view) % DIRECT_ALIGN == 0:
            if staged > run_start:
                iov.append(buf[run_start:staged])
            iov.append(view[:whole])
            view = view[whole:]
            run_start = staged
        buf[staged : staged + len(view)] = view
        staged += len(view)
    end = staged + pad  # a page multiple: the record and the pieces sent directly are
    buf[staged:end] = bytes(pad)
    if end > run_start:
        iov.append(buf[run_start:end])
    return iov


def _address(view: memoryview) -> int:
    """Where a buffer's bytes start in memory."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def _write_all(fd: int, views: list[memoryview], offset: int) -> None:
    views = list(views)
    while views:
        written = os.pwritev(fd, views, offset)
        if written <= 0:
            raise OSError("short write to segment")
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def _read_all(fd: int, targets: list[memoryview], offset: int) -> None:
    views = list(targets)
    while views:
        got = os.preadv(fd, views, offset)
        if got <= 0:
            raise TierError("record runs past the end of its segment")
        offset += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views.pop(0)
        if views and got:
            views[0] = views[0][got:]
