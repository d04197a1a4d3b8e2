"""Disk tier under O_DIRECT: bodies start on a page of the file, move without a bounce copy when
the memory is page-aligned, and are still verified on every read whatever path they took."""

from __future__ import annotations

import pytest
import torch

from kvtier.tiers import DiskTier, Payload
from kvtier.tiers.payload import aligned_bytes
from kvtier.tiers.record import FLAG_PAGE_HEAD, PAGE_BYTES, parse_head
from kvtier.tiers.segment import HEADER_BYTES

# Whole pages, a page and a bit, less than a page, and an odd size that leaves a partial tail.
SIZES = [PAGE_BYTES, 3 * PAGE_BYTES, 3 * PAGE_BYTES + 5, PAGE_BYTES - 1, 100_003]


def direct_tier(path, **kwargs) -> DiskTier:
    tier = DiskTier(path, 64 << 20, direct=True, **kwargs)
    if not tier.direct:
        tier.close()
        pytest.skip("this filesystem refuses O_DIRECT")
    return tier


def random_bytes(nbytes: int, seed: int, *, page_aligned: bool) -> torch.Tensor:
    # torch's own tensors are never page-aligned (64 bytes in); one byte in makes sure of it.
    if page_aligned:
        data = aligned_bytes(nbytes, PAGE_BYTES)
    else:
        data = torch.empty(nbytes + 1, dtype=torch.uint8)[1:]
    generator = torch.Generator().manual_seed(seed)
    data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator))
    return data


def records(path) -> list[tuple[int, object]]:
    """(offset, head) of every record in the tier's segments, parsed from the files."""
    found = []
    for segment in sorted(path.glob("*.seg")):
        data = segment.read_bytes()
        offset = HEADER_BYTES
        while offset < len(data) and data[offset : offset + 4] == b"KVTR":
            head = parse_head(data[offset:])
            found.append((offset, head))
            offset += -(-head.record_len // PAGE_BYTES) * PAGE_BYTES
    return found


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("page_aligned", [True, False], ids=["aligned", "torch"])
def test_every_read_path_returns_the_bytes_put(tmp_path, nbytes, page_aligned) -> None:
    tier = direct_tier(tmp_path)
    data = random_bytes(nbytes, seed=nbytes, page_aligned=page_aligned)
    assert tier.put(b"k", Payload.of(data), namespace="t")

    outs = {
        "fresh": None,
        "aligned out": aligned_bytes(nbytes, PAGE_BYTES),
        "unaligned out": torch.zeros(nbytes + 1, dtype=torch.uint8)[1:],
        "bigger aligned out": aligned_bytes(nbytes + PAGE_BYTES, PAGE_BYTES).fill_(7),
    }
    for name, out in outs.items():
        got = tier.get(b"k", namespace="t", out=out)
        assert got is not None and torch.equal(got.data, data), name
        if out is not None:
            assert got.data.data_ptr() == out.data_ptr(), name
    # A bigger caller buffer is not written past the payload (its tail is the caller's).
    assert bool((outs["bigger aligned out"][nbytes:] == 7).all())
    # Fresh outputs are page-aligned, so a later O_DIRECT write of them needs no bounce either.
    assert tier.get(b"k", namespace="t").data.data_ptr() % PAGE_BYTES == 0
    assert tier.stats.errors == 0
    tier.close()


def test_bodies_start_on_a_page_of_the_file(tmp_path) -> None:
    tier = direct_tier(tmp_path)
    for i, nbytes in enumerate(SIZES):
        tier.put(bytes([i]), Payload.of(random_bytes(nbytes, seed=i, page_aligned=i % 2 == 0)))
    found = records(tmp_path)
    assert len(found) == len(SIZES)
    for offset, head in found:
        assert head.flags & FLAG_PAGE_HEAD and head.head_len == PAGE_BYTES
        assert (offset + head.head_len) % PAGE_BYTES == 0
    tier.close()


def test_page_heads_cost_at_most_one_page_per_record(tmp_path) -> None:
    tier = direct_tier(tmp_path)
    for i, nbytes in enumerate(SIZES):
        before = tier.device_bytes_written
        tier.put(bytes([i]), Payload.of(random_bytes(nbytes, seed=i, page_aligned=True)))
        written = tier.device_bytes_written - before - (HEADER_BYTES if i == 0 else 0)
        body_pages = -(-nbytes // PAGE_BYTES) * PAGE_BYTES
        # head page + body pages: for page-multiple bodies (every chunk of the embedded model)
        # exactly what the 64-byte head layout cost, since the record was padded to a page anyway.
        assert written == PAGE_BYTES + body_pages
    tier.close()


@pytest.mark.parametrize("where", ["first page", "middle", "last byte"])
def test_corruption_on_the_zero_copy_path_is_a_miss(tmp_path, where) -> None:
    nbytes = 5 * PAGE_BYTES + 123  # whole pages read in place, the tail through scratch
    tier = direct_tier(tmp_path, persist=True)
    good = random_bytes(nbytes, seed=1, page_aligned=True)
    bad = random_bytes(nbytes, seed=2, page_aligned=True)
    tier.put(b"good", Payload.of(good))
    tier.put(b"bad", Payload.of(bad))
    (_, _), (offset, head) = records(tmp_path)
    at = {"first page": 0, "middle": nbytes // 2, "last byte": nbytes - 1}[where]
    segment = sorted(tmp_path.glob("*.seg"))[0]
    with open(segment, "r+b") as f:
        f.seek(offset + head.head_len + at)
        flipped = f.read(1)[0] ^ 0x40
        f.seek(offset + head.head_len + at)
        f.write(bytes([flipped]))

    assert tier.get(b"bad", out=aligned_bytes(nbytes, PAGE_BYTES)) is None
    assert tier.stats.errors == 1 and not tier.contains(b"bad")
    got = tier.get(b"good", out=aligned_bytes(nbytes, PAGE_BYTES))
    assert got is not None and torch.equal(got.data, good)
    tier.close()


def test_non_zero_head_padding_ends_the_scan(tmp_path) -> None:
    tier = direct_tier(tmp_path, persist=True)
    tier.put(b"a", Payload.of(random_bytes(PAGE_BYTES, seed=1, page_aligned=True)))
    tier.put(b"b", Payload.of(random_bytes(PAGE_BYTES, seed=2, page_aligned=True)))
    tier.close()
    (_, _), (offset, head) = records(tmp_path)
    segment = sorted(tmp_path.glob("*.seg"))[0]
    data = bytearray(segment.read_bytes())
    data[offset + head.head_len - 1] = 1  # in the page head's padding, outside its checksum
    segment.write_bytes(data)

    again = direct_tier(tmp_path, persist=True)
    assert again.contains(b"a") and not again.contains(b"b")
    again.close()


@pytest.mark.parametrize("first", ["direct", "buffered"])
def test_segments_read_back_in_the_other_mode(tmp_path, first) -> None:
    """Page-head records in a buffered tier, 64-byte heads in an O_DIRECT one: both serve."""
    payloads = {
        bytes([i]): Payload.of(random_bytes(nbytes, seed=i, page_aligned=i % 2 == 0))
        for i, nbytes in enumerate(SIZES)
    }
    writer = (
        direct_tier(tmp_path, persist=True)
        if first == "direct"
        else DiskTier(tmp_path, 64 << 20, persist=True)
    )
    for key, payload in payloads.items():
        writer.put(key, payload)
    writer.close()

    reader = (
        DiskTier(tmp_path, 64 << 20, persist=True)
        if first == "direct"
        else direct_tier(tmp_path, persist=True)
    )
    for key, payload in payloads.items():
        for out in (None, aligned_bytes(payload.nbytes, PAGE_BYTES)):
            got = reader.get(key, out=out)
            assert got is not None and torch.equal(got.data, payload.data)
    assert reader.stats.errors == 0
    reader.close()
