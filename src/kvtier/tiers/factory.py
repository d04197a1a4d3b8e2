"""build_backends: the tier backends a storage configuration names, fastest first.

Kept beside the backends (as LMCache keeps its backend factory), so a new tier is its own
module plus one branch here. The key handling lives here too: one master key seals disk and
remote records (AES-GCM) or signs remote ones (AES-GMAC), see docs/storage-format.md,
"Threat model".
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvtier.tiers.base import TierBackend
from kvtier.tiers.crypto import Sealer, Signer
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.mmap_file import MmapFileTier
from kvtier.tiers.redis_tier import RedisTier

RemoteIntegrity = Literal["mac", "encrypt", "none"]


def _segments(c: StorageConfig, sealer: Sealer | None) -> TierBackend:
    return DiskTier(
        c.disk_dir, c.disk_bytes, sealer=sealer, persist=c.disk_persist, layered=c.layered
    )


def _mmap_files(c: StorageConfig, sealer: Sealer | None) -> TierBackend:
    if sealer is not None or c.disk_persist:
        raise ValueError("the mmap disk backend neither encrypts nor persists; use 'segments'")
    return MmapFileTier(c.disk_dir, c.disk_bytes)


# Implementations of the disk tier, by name (`TiersConfig.disk_backend`): a new one is its
# own module plus one line here.
DISK_BACKENDS: dict[str, Callable[[StorageConfig, Sealer | None], TierBackend]] = {
    "segments": _segments,  # log-structured segment files: durable, O_DIRECT (tiers/disk.py)
    "mmap": _mmap_files,  # one file per chunk, read through mmap: the example tier
}


@dataclass(frozen=True)
class StorageConfig:
    """Where the tiers are and how big; a zero budget or no location leaves a tier out. Built
    by `TiersConfig.storage()` alone: the settings' defaults live there, none here.

    `host_slot_bytes`: the host arena's slot (one block in the host's form, so a chunk of
    whole blocks wastes nothing). `key`: the master key; None with sealing or signing asked
    for means a random per-process key (nothing written survives the process)."""

    host_bytes: int
    host_slot_bytes: int | None
    disk_dir: str | Path | None
    disk_bytes: int
    disk_persist: bool
    disk_backend: str
    seal_disk: bool
    redis_url: str | None
    redis_bytes: int
    redis_prefix: str
    redis_cluster: bool
    redis_timeout_s: float
    remote_integrity: RemoteIntegrity
    key: bytes | None
    layered: bool  # disk segments and Redis write layered records (record.py)


def build_backends(config: StorageConfig) -> list[TierBackend]:
    """The configured tiers, top first (host, disk, remote)."""
    c = config
    master = c.key or os.urandom(32)
    sealer = Sealer(master) if c.seal_disk or c.remote_integrity == "encrypt" else None
    tiers: list[TierBackend] = []
    if c.host_bytes:
        slot = {} if c.host_slot_bytes is None else {"slot_bytes": c.host_slot_bytes}
        tiers.append(HostTier(c.host_bytes, **slot))
    if c.disk_bytes and c.disk_dir is not None:
        tiers.append(DISK_BACKENDS[c.disk_backend](c, sealer if c.seal_disk else None))
    if c.redis_url:
        tiers.append(
            RedisTier(
                c.redis_url,
                c.redis_bytes,
                prefix=c.redis_prefix,
                timeout_s=c.redis_timeout_s,
                cluster=c.redis_cluster,
                sealer=sealer if c.remote_integrity == "encrypt" else None,
                signer=Signer(master) if c.remote_integrity == "mac" else None,
                layered=c.layered,
            )
        )
    return tiers
