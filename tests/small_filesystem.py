"""A small real filesystem that a test can fill up: a tmpfs mounted for the test.

Mounting needs root (CI runs as root); elsewhere, or in a container without the right to
mount, the test is skipped.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_filesystem(directory: Path, size: str) -> Iterator[Path]:
    """`directory` as the mount point of a tmpfs of `size` (e.g. "50m") for the block."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "--lazy", str(directory)], check=True)


def fill_up(path: Path) -> None:
    """Write `path` until the filesystem it is on has no room left (as another program would)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for piece in (bytes(1 << 20), bytes(4096)):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, piece)
        with pytest.raises(OSError) as full:
            os.write(fd, bytes(4096))
        assert full.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
