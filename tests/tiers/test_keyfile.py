"""The master key file: created once with mode 0600, read back the same, refused when others
can read it or it is not a key."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kvtier.errors import KvtierError
from kvtier.tiers.keyfile import KEY_BYTES, read_key_file


def test_created_once_private_and_read_back(tmp_path: Path):
    path = tmp_path / "conf" / "master.key"
    key = read_key_file(path, create=True)
    assert len(key) == KEY_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_key_file(path, create=True) == key  # a second start keeps it
    assert read_key_file(path) == key
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind


def test_a_missing_file_is_an_error_unless_creation_is_asked(tmp_path: Path):
    with pytest.raises(KvtierError, match=r"does not exist.*--create-key"):
        read_key_file(tmp_path / "nope.key")


def test_a_key_others_can_read_is_refused(tmp_path: Path):
    path = tmp_path / "master.key"
    read_key_file(path, create=True)
    path.chmod(0o644)
    with pytest.raises(KvtierError, match=r"readable by others.*chmod 600"):
        read_key_file(path)


@pytest.mark.parametrize("text", ["", "zz" * 32, "ab" * 16, "ab" * 33])
def test_anything_but_64_hex_digits_is_refused(tmp_path: Path, text: str):
    path = tmp_path / "master.key"
    path.write_text(text)
    path.chmod(0o600)
    with pytest.raises(KvtierError, match="64 hex digits"):
        read_key_file(path)
