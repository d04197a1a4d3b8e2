"""A cache that survives restarts: the disk tier of `kvtier serve` keeps its chunks, and a
restarted server serves the first resumed turn from them. Encrypted with a key file, the same;
with another key, every chunk is a miss and the answer is still right."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tests.server.serve_process import SMALL_POOL, ServeProcess, first_turn, second_turn

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
