"""What identifies a model's KV: a digest of the bytes that decide it.

Two folders may share a name, a config and weight files of the same sizes and still be two
models (a fine-tune, a LoRA merged in, a re-quantization): the KV one of them writes is wrong
for the other, and a cache keyed by anything less than the bytes would hand it over. So the
digest covers the content of every file that decides a token's KV or how text becomes
tokens: the weights, any adapter, the config and the tokenizer files.

Hashing a model's weights costs about a second per GB here, so each file's digest is kept in
`$KVTIER_CACHE/model-digests/`, keyed by the folder's resolved path and reused while the
file's stat signature (size, mtime, ctime, inode, device) is unchanged. A write to a file,
in place or by replacing it, changes its ctime or inode, which a user cannot set back; a
copy of the folder elsewhere is hashed once on its first load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from kvtier.paths import cache_dir

log = logging.getLogger(__name__)

# Files whose bytes decide the KV of a token sequence or the token sequence of a text.
# Generation settings and the chat template do not: they change which tokens are asked for,
# and the key is the tokens.
IDENTITY_PATTERNS = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.gguf",
    "config.json",
    "adapter_config.json",
    "tokenizer*",
    "vocab*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "*.model",
    "*.tiktoken",
)
_READ_BYTES = 8 << 20
_CACHE_VERSION = 1


def model_digest(model_dir: Path) -> str:
    """Hex digest (16 characters) of the identity files of `model_dir`, names and contents."""
    folder = model_dir.resolve()
    cached = _load_cache(folder)
    fresh: dict[str, dict[str, object]] = {}
    total = hashlib.sha256(f"kvtier-model-v{_CACHE_VERSION}".encode())
    hashed_bytes, started = 0, time.perf_counter()
    for path in identity_files(folder):
        signature = _signature(path)
        entry = cached.get(path.name)
        if entry is None or entry.get("signature") != signature:
            entry = {"signature": signature, "sha256": _file_sha256(path)}
            hashed_bytes += signature[0]  # its size
        fresh[path.name] = entry
        total.update(f"{path.name}\0{entry['sha256']}\0".encode())
    if hashed_bytes:
        log.info(
            "hashed %.0f MB of %s's weights and tokenizer in %.1f s (kept for later loads)",
            hashed_bytes / 1e6,
            folder.name,
            time.perf_counter() - started,
        )
    if fresh != cached:
        _store_cache(folder, fresh)
    return total.hexdigest()[:16]


def identity_files(folder: Path) -> list[Path]:
    """The files of `folder` (not its subfolders) that `model_digest` covers, sorted."""
    found = {p for pattern in IDENTITY_PATTERNS for p in folder.glob(pattern) if p.is_file()}
    return sorted(found, key=lambda p: p.name)


def _signature(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(_READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _cache_file(folder: Path) -> Path:
    name = hashlib.sha256(str(folder).encode()).hexdigest()[:24]
    return cache_dir() / "model-digests" / f"{name}.json"


def _load_cache(folder: Path) -> dict[str, dict[str, object]]:
    """The kept per-file digests of `folder`; empty when missing, stale or unreadable (a
    bad cache file costs one re-hash, never a wrong digest: signatures still have to match)."""
    try:
        data = json.loads(_cache_file(folder).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION:
        return {}
    if data.get("folder") != str(folder) or not isinstance(data.get("files"), dict):
        return {}
    return data["files"]


def _store_cache(folder: Path, files: dict[str, dict[str, object]]) -> None:
    """Written to a temporary file and renamed: two processes loading the same model at
    once each leave a whole file. Failing to write only costs a re-hash next time."""
    path = _cache_file(folder)
    body = json.dumps({"version": _CACHE_VERSION, "folder": str(folder), "files": files})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(body)
        temporary.replace(path)
    except OSError as exc:
        log.warning("cannot keep the model digest in %s: %s", path, exc)


def model_identity(model: str) -> str:
    """`model` as a key namespace: a local folder gets its digest appended (a changed weight
    is another namespace); any other name (a hub id resolved elsewhere) stays as given."""
    folder = Path(model).expanduser()
    if folder.is_dir() and (folder / "config.json").is_file():
        return f"{model}:{model_digest(folder)}"
    return model
