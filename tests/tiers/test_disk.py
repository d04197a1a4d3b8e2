"""Disk tier: append-only segments that survive restarts and crashes and never serve bad bytes."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from kvtier.tiers import DiskTier, Payload, Sealer
from kvtier.tiers.segment import HEADER_BYTES


def segment_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


def bytes_on_disk(directory: Path) -> int:
    return sum(path.stat().st_size for path in segment_files(directory))


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_round_trip_and_restart_with_persist(tmp_path, make_payload, same, direct) -> None:
    payloads = {
        bytes([i]) * 32: make_payload(tokens=16, dtype=dtype, seed=i)
        for i, dtype in enumerate([torch.bfloat16, torch.float32, torch.bfloat16])
    }
    tier = DiskTier(tmp_path, 4 << 20, direct=direct, persist=True)
    for key, payload in payloads.items():
        assert tier.put(key, payload, namespace="t")
    for key, payload in payloads.items():
        assert same(tier.get(key, namespace="t"), payload)
    tier.close()

    again = DiskTier(tmp_path, 4 << 20, direct=direct, persist=True)
    assert {entry.key for entry in again.entries()} == set(payloads)
    for key, payload in payloads.items():
        assert same(again.get(key, namespace="t"), payload)
    assert again.used_bytes == bytes_on_disk(tmp_path)
    assert again.stats.errors == 0
    again.close()


def test_files_are_removed_on_close_without_persist(tmp_path, make_payload) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put(b"k", make_payload())
    assert segment_files(tmp_path)
    tier.close()
    assert not segment_files(tmp_path)


def test_leftovers_of_a_crashed_run_are_dropped_without_persist(tmp_path, make_payload) -> None:
    crashed = DiskTier(tmp_path, 1 << 20, persist=True)
    crashed.put(b"k", make_payload())
    crashed.close()
    fresh = DiskTier(tmp_path, 1 << 20)
    assert fresh.get(b"k") is None and fresh.used_bytes == 0 and not segment_files(tmp_path)
    fresh.close()


def test_o_direct_falls_back_where_the_filesystem_refuses(
    tmp_path, monkeypatch, make_payload, same
) -> None:
    real_open = os.open

    def refusing_open(path, flags, *args):
        # What tmpfs (before Linux 6.6), some overlays and FUSE mounts answer.
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    tier = DiskTier(tmp_path, 1 << 20, direct=True)
    assert not tier.direct
    payload = make_payload()
    assert tier.put(b"k", payload) and same(tier.get(b"k"), payload)
    tier.close()


def test_flipped_byte_in_a_body_is_a_miss_with_an_error_never_wrong_bytes(
    tmp_path, make_payload, same
) -> None:
    tier = DiskTier(tmp_path, 1 << 20, persist=True)
    good, bad = make_payload(seed=1), make_payload(seed=2)
    tier.put(b"good", good)
    tier.put(b"bad", bad)
    segment = segment_files(tmp_path)[0]
    data = bytearray(segment.read_bytes())
    data[-100] ^= 0x01  # inside the last record's body
    segment.write_bytes(data)

    assert tier.get(b"bad") is None
    assert tier.stats.errors == 1
    assert not tier.contains(b"bad")  # forgotten: the next lookup is a plain miss
    assert same(tier.get(b"good"), good)
    tier.close()


def test_corrupt_head_and_torn_tail_are_cut_at_restart(tmp_path, make_payload, same) -> None:
    tier = DiskTier(tmp_path, 1 << 20, persist=True)
    payloads = [make_payload(seed=i) for i in range(3)]
    for i, payload in enumerate(payloads):
        tier.put(bytes([i]), payload)
    tier.close()
    segment = segment_files(tmp_path)[0]
    size = segment.stat().st_size
    with open(segment, "r+b") as f:
        f.truncate(size - 1000)  # the last record is torn

    again = DiskTier(tmp_path, 1 << 20, persist=True)
    assert same(again.get(bytes([0])), payloads[0])
    assert same(again.get(bytes([1])), payloads[1])
    assert again.get(bytes([2])) is None
    assert again.used_bytes == bytes_on_disk(tmp_path) < size - 1000  # the torn tail is gone
    assert again.put(bytes([2]), payloads[2])  # appends go on after the cut
    assert same(again.get(bytes([2])), payloads[2])
    again.close()

    # Damage the head of the second record, the last of its segment: it is not indexed.
    data = bytearray(segment.read_bytes())
    second = data.index(b"KVTR", HEADER_BYTES + 10)
    data[second + 20] ^= 0xFF
    segment.write_bytes(data)
    third = DiskTier(tmp_path, 1 << 20, persist=True)
    assert same(third.get(bytes([0])), payloads[0])
    assert third.get(bytes([1])) is None
    assert third.stats.errors == 0  # not served, so not even an error: it was never indexed
    third.close()


def test_delete_survives_a_restart(tmp_path, make_payload) -> None:
    tier = DiskTier(tmp_path, 1 << 20, persist=True)
    tier.put(b"gone", make_payload())
    tier.put(b"kept", make_payload(seed=1))
    tier.delete(b"gone")
    tier.close()
    again = DiskTier(tmp_path, 1 << 20, persist=True)
    assert not again.contains(b"gone") and again.contains(b"kept")
    again.close()


def test_gc_drops_oldest_segments_and_reports_evictions(tmp_path, make_payload) -> None:
    capacity = 4 << 20
    tier = DiskTier(tmp_path, capacity, segment_bytes=512 * 1024)
    evicted: list[bytes] = []
    tier.on_evict = lambda key, namespace: evicted.append(key)
    for i in range(400):
        assert tier.put(i.to_bytes(2, "big"), make_payload(seed=i))  # 16 KiB each
        assert tier.used_bytes == bytes_on_disk(tmp_path) <= capacity
    assert evicted and evicted == sorted(evicted)  # oldest first
    assert all(not tier.contains(key) for key in evicted)
    assert tier.contains((399).to_bytes(2, "big"))
    assert tier.write_amplification < 1.05
    tier.close()


def test_gc_copies_forward_the_few_live_records_of_a_mostly_dead_segment(
    tmp_path, make_payload, same
) -> None:
    capacity = 1 << 20
    tier = DiskTier(tmp_path, capacity, segment_bytes=128 * 1024)  # 7 records a segment
    keeper = make_payload(seed=99)
    tier.put(b"keeper", keeper)
    for i in range(6):
        tier.put(bytes([i]), make_payload(seed=i))
    for i in range(6):
        tier.delete(bytes([i]))  # the first segment is now 1/7 live
    first = segment_files(tmp_path)[0]
    i = 10
    while first.exists():
        assert tier.put(bytes([i]), make_payload(seed=i))
        assert bytes_on_disk(tmp_path) <= capacity
        i += 1
    assert same(tier.get(b"keeper"), keeper)  # copied forward, not evicted
    assert tier.stats.evicted == 0
    tier.close()


def test_a_sealed_disk_needs_the_right_master_key(tmp_path, make_payload, same) -> None:
    key = os.urandom(32)
    tier = DiskTier(tmp_path, 1 << 20, persist=True, sealer=Sealer(key))
    payload = make_payload()
    tier.put(b"k", payload, namespace="tenant")
    assert same(tier.get(b"k", namespace="tenant"), payload)
    raw = b"".join(path.read_bytes() for path in segment_files(tmp_path))
    assert payload.data is not None and bytes(payload.data[:64].numpy()) not in raw
    tier.close()

    wrong = DiskTier(tmp_path, 1 << 20, persist=True, sealer=Sealer(os.urandom(32)))
    assert wrong.get(b"k", namespace="tenant") is None and wrong.stats.errors == 1
    wrong.close()


def test_one_directory_one_tier(tmp_path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    with pytest.raises(RuntimeError, match="in use"):
        DiskTier(tmp_path, 1 << 20)
    tier.close()


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from kvtier.tiers import DiskTier, Payload
    tier = DiskTier(sys.argv[1], int(sys.argv[2]), segment_bytes=16 << 20, persist=True)
    data = torch.empty(8 << 20, dtype=torch.uint8)
    i = 0
    while True:
        # 8 MiB records, so most of the time is spent inside write(): a kill there tears
        # the record. Their bytes follow from their key, so a reader can check them.
        data.fill_(i % 251)
        tier.put(i.to_bytes(4, "big"), Payload.of(data))
        if i == 3:
            print("ready", flush=True)
        i += 1
    """
)


@pytest.mark.slow
def test_kill_9_mid_write_leaves_only_verified_records_and_the_budget_right(
    tmp_path, caplog
) -> None:
    capacity = 64 << 20  # GC is running by the time of the kill: ~7 records fit
    for round_ in range(4):
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path), str(capacity)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        time.sleep(0.1 + 0.1 * round_)
        writer.send_signal(signal.SIGKILL)
        writer.wait()

        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.segment"):
            tier = DiskTier(tmp_path, capacity, segment_bytes=16 << 20, persist=True)
        assert tier.used_bytes == bytes_on_disk(tmp_path) <= capacity
        entries = tier.entries()
        assert entries
        for entry in entries:
            got = tier.get(entry.key, namespace=entry.namespace)
            assert got is not None and got.data is not None
            assert bool((got.data == int.from_bytes(entry.key, "big") % 251).all())
        assert tier.stats.errors == 0
        tier.close()
        # A kill lands mid-write about half the time; stop once one did (and was cut off).
        if round_ >= 1 and "torn" in caplog.text:
            break


def test_record_bigger_than_the_budget_is_refused(tmp_path) -> None:
    tier = DiskTier(tmp_path, 64 * 1024)
    assert not tier.put(b"k", Payload.of(torch.zeros(128 * 1024, dtype=torch.uint8)))
    assert tier.stats.refused == 1 and tier.used_bytes == 0
    tier.close()
