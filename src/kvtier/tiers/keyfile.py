"""The master key of sealed and signed tiers, kept in a file so it outlives the process.

Without a key file every process draws a random key, so whatever it wrote to disk or Redis
is unreadable after a restart and by the other replicas. The file holds 32 random bytes as
64 hex digits (plus a newline): text, so an operator can copy it into a secret store. It is
created with mode 0600, atomically (two replicas starting together
end up with one key), and only when asked: a mistyped path must not silently start a new key.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from kvtier.errors import KvtierError

KEY_BYTES = 32


def read_key_file(path: str | os.PathLike[str], *, create: bool = False) -> bytes:
    """The master key in `path`; with `create`, a fresh one is written there first if the
    file does not exist. Refuses a file others can read or one that is not 64 hex digits."""
    path = Path(path)
    if create:
        _create(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        raise KvtierError(
            f"key file {path} does not exist (create one with --create-key, or "
            "create_key = true in [tiers])"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise KvtierError(f"cannot read key file {path}: {exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # A key others can read protects nothing; ssh refuses such keys for the same reason.
        raise KvtierError(
            f"key file {path} is readable by others (mode {stat.S_IMODE(mode):o}); chmod 600 {path}"
        )
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise KvtierError(f"key file {path} must hold {2 * KEY_BYTES} hex digits (32 bytes)")
    return key


def _create(path: Path) -> None:
    """Write a fresh key to `path` unless it exists. The key goes to a private temporary file
    first, then is hard-linked into place, so a replica starting at the same moment sees
    either no file or a whole key, never an empty one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        return  # the key of an earlier start (or of a replica that started first)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(os.urandom(KEY_BYTES).hex() + "\n")
        with contextlib.suppress(FileExistsError):  # another process won: its key is the key
            os.link(temporary, path)
    except OSError as exc:
        raise KvtierError(f"cannot create key file {path}: {exc.strerror or exc}") from None
    finally:
        temporary.unlink(missing_ok=True)
