"""MmapFileTier: one file per chunk, read back through a memory map: the smallest disk tier.

The example of docs/design.md ("a new tier is one file plus one registration line": its line
is in `factory.DISK_BACKENDS`). Volatile, like the host arena: it writes into a fresh folder
under `root` and removes it on close. A CRC32 trailer turns a damaged file into a miss.
"""

from __future__ import annotations

import mmap
import shutil
import tempfile
import threading
import zlib
from pathlib import Path

import torch

from kvtier.tiers.base import CorruptRecord, TierBackend
from kvtier.tiers.payload import Payload


class MmapFileTier(TierBackend):
    def __init__(self, root: str | Path, capacity_bytes: int, name: str = "disk") -> None:
        super().__init__(name)
        Path(root).mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix="kvtier-mmap-", dir=root))
        self._capacity = capacity_bytes
        self._held: dict[tuple[str, bytes], Payload] = {}  # metadata of each stored chunk
        self._used = 0
        self._lock = threading.Lock()  # the mover's workers and the engine thread both call

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def _path(self, key: bytes, namespace: str) -> Path:
        return self.folder / f"{zlib.crc32(namespace.encode()):08x}-{key.hex()}"

    def _put(self, key: bytes, payload: Payload, namespace: str) -> bool:
        body = payload.data.cpu().numpy().tobytes()
        with self._lock:
            old = self._held.get((namespace, key))
            if self._used - (old.nbytes if old else 0) + payload.nbytes > self._capacity:
                return False
            path = self._path(key, namespace)
            path.write_bytes(body + zlib.crc32(body).to_bytes(4, "little"))
            self._held[(namespace, key)] = payload.without_data()
            self._used += payload.nbytes - (old.nbytes if old else 0)
        return True

    def _get(self, key: bytes, namespace: str, out: torch.Tensor | None) -> Payload | None:
        meta = self._held.get((namespace, key))
        if meta is None:
            return None
        with (
            open(self._path(key, namespace), "rb") as f,
            mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m,
        ):
            body, crc = m[: meta.nbytes], m[meta.nbytes :]
        if len(body) != meta.nbytes or zlib.crc32(body).to_bytes(4, "little") != crc:
            raise CorruptRecord(f"{self.name}: chunk file damaged")  # counted, then a miss
        data = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        return meta.with_data(data if out is None else out[: meta.nbytes].copy_(data))

    def _delete(self, key: bytes, namespace: str) -> None:
        with self._lock:
            meta = self._held.pop((namespace, key), None)
            if meta is not None:
                self._used -= meta.nbytes
                self._path(key, namespace).unlink(missing_ok=True)

    def _contains(self, key: bytes, namespace: str) -> bool:
        return (namespace, key) in self._held

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
