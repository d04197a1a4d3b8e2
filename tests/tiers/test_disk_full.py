"""A disk tier on a filesystem that fills up: the budget is capped to what the filesystem can
hold, and a write it refuses all the same is logged once, counted by reason, and leaves the
reads working (a real tmpfs, mounted by the test)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvtier.tiers import DiskTier
from tests.small_filesystem import fill_up, small_filesystem

MIB = 1 << 20


def test_a_budget_larger_than_the_filesystem_is_capped_with_a_warning(
    tmp_path: Path, make_payload, caplog
) -> None:
    with small_filesystem(tmp_path / "fs", "4m") as fs:
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            tier = DiskTier(fs / "kv", 100 * MIB, persist=True)
        assert tier.capacity_bytes <= 4 * MIB
        assert "capped to" in caplog.text
        payloads = [make_payload(256, seed=i) for i in range(40)]  # 10 MiB of 256 KiB chunks
        assert all(tier.put(b"k%d" % i, p) for i, p in enumerate(payloads))
        # the budget held: GC made room, the filesystem never filled
        assert tier.used_bytes <= tier.capacity_bytes
        assert tier.stats.errors == 0 and tier.stats.evicted > 0
        assert os.statvfs(fs).f_bavail > 0
        tier.close()


def test_a_filesystem_filled_by_others_fails_writes_logged_once_while_reads_go_on(
    tmp_path: Path, make_payload, same, caplog
) -> None:
    with small_filesystem(tmp_path / "fs", "8m") as fs:
        tier = DiskTier(fs / "kv", 4 * MIB, persist=True)
        kept = {b"k%d" % i: make_payload(256, seed=i) for i in range(3)}
        assert all(tier.put(key, payload) for key, payload in kept.items())
        fill_up(fs / "filler")  # another program takes the rest of the filesystem

        with caplog.at_level(logging.INFO, logger="kvtier.tiers.base"):
            refused = [tier.put(b"new%d" % i, make_payload(256, seed=9)) for i in range(6)]
            assert refused == [False] * 6
            assert tier.stats.snapshot()["errors_by_reason"] == {"no_space": 6}
            failing = [r for r in caplog.records if "writes are failing" in r.message]
            assert len(failing) == 1 and failing[0].levelno == logging.WARNING
            for key, payload in kept.items():  # reads go on
                assert same(tier.get(key), payload)

            (fs / "filler").unlink()
            assert tier.put(b"after", make_payload(256, seed=10))
            assert "writes succeed again, after 6 failed" in caplog.text
        tier.close()

        again = DiskTier(fs / "kv", 4 * MIB, persist=True)  # what was written survives
        for key, payload in kept.items():
            assert same(again.get(key), payload)
        again.close()
