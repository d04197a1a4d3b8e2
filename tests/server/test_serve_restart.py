"""A cache that survives restarts: the disk tier of `kvtier serve` keeps its chunks, and a
restarted server serves the first resumed turn from them. Encrypted with a key file, the same;
with another key, every chunk is a miss and the answer is still right. With the README's
example (a host tier above the disk), what left the device for the host is on disk too, and
what is still on the device is written there at a graceful shutdown."""

from __future__ import annotations

import signal
import stat
import time
from pathlib import Path

import httpx
import pytest

from tests.server.serve_process import (
    SMALL_POOL,
    TEXT,
    ServeProcess,
    Turn,
    chat,
    first_turn,
    metric,
    second_turn,
)

pytestmark = pytest.mark.slow


def disk_flags(tmp_path: Path, *extra: str) -> list[str]:
    directory = str(tmp_path / "kv")
    return [
        *SMALL_POOL,
        "--host-bytes",
        "0",
        "--disk-dir",
        directory,
        "--disk-bytes",
        "64MiB",
        *extra,
    ]


def run(log: Path, flags: list[str], turn, *args):
    server = ServeProcess(log, *flags).start()
    try:
        return turn(server.base_url, *args), server
    finally:
        server.stop()


def test_a_restarted_server_restores_the_session_from_disk(tmp_path: Path, reference):
    flags = disk_flags(tmp_path)
    first, _ = run(tmp_path / "before.log", flags, first_turn)
    second, after = run(tmp_path / "after.log", flags, second_turn, first)
    assert "recovered" in after.output  # the summary counts what the disk kept
    assert second.sources["disk"] >= 128, second.sources
    assert second.sources["device"] == 0  # a fresh device: everything came from disk
    assert (first.text, second.text) == (reference[0].text, reference[1].text)


def test_encrypted_chunks_come_back_with_the_key_file_and_never_with_another_key(
    tmp_path: Path, reference
):
    key = tmp_path / "keys" / "master.key"
    flags = disk_flags(tmp_path, "--encrypt", "--encrypt-key-file", str(key), "--create-key")
    first, before = run(tmp_path / "before.log", flags, first_turn)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert "sealed" in before.output
    written = key.read_text()

    second, _ = run(tmp_path / "after.log", flags, second_turn, first)
    assert key.read_text() == written  # --create-key keeps an existing key
    assert second.sources["disk"] >= 128, second.sources
    assert second.text == reference[1].text

    other = tmp_path / "other.key"
    wrong = disk_flags(tmp_path, "--encrypt", "--encrypt-key-file", str(other), "--create-key")
    third, _ = run(tmp_path / "wrong.log", wrong, second_turn, first)
    assert third.sources["disk"] == 0, third.sources  # unreadable: misses, recomputed
    assert third.text == reference[1].text


# About 440 tokens: a full chunk of 256 and most of another.
LONG = "Summarise this text in one line. " + " ".join(
    (TEXT / "declaration_of_independence.txt").read_text().split()[:600]
)


def readme_example(tmp_path: Path) -> list[str]:
    """README.md: `kvtier serve --host-bytes 1GiB --disk-dir out/kv-cache --policy cost`."""
    directory = str(tmp_path / "kv")
    return ["--threads", "1", "--host-bytes", "1GiB", "--disk-dir", directory, "--policy", "cost"]


def long_turn(server: ServeProcess, evict: bool) -> Turn:
    """One turn of the long prompt; with `evict`, its session then leaves the device (for the
    host tier: the admin API's evict spills what it drops)."""
    turn = chat(server.base_url, "a", [{"role": "user", "content": LONG}])
    if evict:
        url = server.base_url + "/admin/tenants/anonymous/sessions/a/evict"
        assert httpx.post(url, timeout=30).json()["evicted_blocks"] > 0
    return turn


def restarted_turn(tmp_path: Path) -> Turn:
    server = ServeProcess(tmp_path / "after.log", *readme_example(tmp_path)).start()
    try:
        return chat(server.base_url, "b", [{"role": "user", "content": LONG}])
    finally:
        server.stop()


def wait_for_copies(server: ServeProcess, timeout: float = 30) -> None:
    """Until the disk tier holds at least what the host does (the copies of the host's chunks
    have landed), or `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = server.metrics()
        host = metric(text, "kvtier:tier_used_bytes", tier="host")
        if metric(text, "kvtier:tier_used_bytes", tier="disk") >= host > 0:
            return
        time.sleep(0.2)


@pytest.mark.parametrize("evict", [True, False], ids=["evicted_to_host", "left_on_device"])
def test_the_readme_restart_example_keeps_the_cache_across_sigterm(tmp_path: Path, evict: bool):
    server = ServeProcess(tmp_path / "before.log", *readme_example(tmp_path)).start()
    try:
        first = long_turn(server, evict)
    finally:
        server.stop()
    second = restarted_turn(tmp_path)
    assert second.cached_tokens >= 256, second.sources
    assert second.sources["disk"] == second.cached_tokens
    assert second.text == first.text
    assert server.returncode == -signal.SIGTERM  # it still exits as SIGTERM'd, after the flush
    assert "wrote " in server.output and "to disk in" in server.output


def test_the_readme_restart_example_keeps_what_reached_disk_across_kill_9(tmp_path: Path):
    server = ServeProcess(tmp_path / "before.log", *readme_example(tmp_path)).start()
    try:
        first = long_turn(server, evict=True)
        wait_for_copies(server)  # the host's chunks are copied to disk as they come
    finally:
        server.kill()
    second = restarted_turn(tmp_path)
    assert second.cached_tokens >= 256, second.sources
    assert second.sources["disk"] == second.cached_tokens
    assert second.text == first.text
