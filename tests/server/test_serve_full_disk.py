"""`kvtier serve` with a disk budget larger than its filesystem (a 50 MB tmpfs the test mounts):
the budget is capped at start with a warning; once something else fills the filesystem, the
failed writes are one warning and a count in /metrics, and the chunks on disk still restore."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.serve_process import (
    FLOODS,
    SMALL_POOL,
    ServeProcess,
    chat,
    first_turn,
    metric,
    second_turn,
)
from tests.small_filesystem import fill_up, small_filesystem

pytestmark = pytest.mark.slow

MIB = 1 << 20


def test_a_disk_that_fills_up_tells_and_keeps_serving_reads(tmp_path: Path, reference):
    with small_filesystem(tmp_path / "fs", "50m") as fs:
        flags = [*SMALL_POOL, "--host-bytes", "0", "--disk-dir", str(fs / "kv")]
        server = ServeProcess(tmp_path / "serve.log", *flags, "--disk-bytes", "100MiB").start()
        try:
            capacity = metric(server.metrics(), "kvtier:tier_capacity_bytes", tier="disk")
            first = first_turn(server.base_url)  # session a pushed off the device, to disk
            fill_up(fs / "filler")  # another program takes the rest of the filesystem
            for index, text in enumerate(FLOODS):  # their KV finds no room on disk
                chat(
                    server.base_url,
                    f"late-{index}",
                    [{"role": "user", "content": "Again. " + text}],
                )
            second = second_turn(server.base_url, first)
            metrics = server.metrics()
        finally:
            server.stop()
    assert "the disk budget of 100.0 MiB is more than its filesystem can hold" in server.output
    assert capacity <= 50 * MIB
    assert metric(metrics, "kvtier:tier_errors_total", tier="disk", reason="no_space") > 0
    assert server.output.count("disk: writes are failing (put: No space left on device)") == 1
    assert second.sources["disk"] >= 128, second.sources  # reads go on
    assert second.text == reference[1].text
