"""Tiers below device memory (host, disk, remote) and the store that moves KV chunks among them.

See docs/tiers.md for the contract and the failure semantics, docs/storage-format.md for the
formats on disk and in Redis.
"""

from __future__ import annotations

from kvtier.lazy_exports import lazy_getattr

_EXPORTS = {
    "Chunk": "kvtier.tiers.store",
    "CorruptRecord": "kvtier.tiers.base",
    "DiskTier": "kvtier.tiers.disk",
    "HostTier": "kvtier.tiers.host",
    "Mover": "kvtier.tiers.mover",
    "Payload": "kvtier.tiers.payload",
    "Placement": "kvtier.tiers.store",
    "PlacementListener": "kvtier.tiers.store",
    "Prefetch": "kvtier.tiers.mover",
    "RedisTier": "kvtier.tiers.redis_tier",
    "RejectedRecord": "kvtier.tiers.base",
    "Sealer": "kvtier.tiers.crypto",
    "Signer": "kvtier.tiers.crypto",
    "SizeOnlyTier": "kvtier.tiers.sized",
    "TierBackend": "kvtier.tiers.base",
    "TierEntry": "kvtier.tiers.base",
    "TierError": "kvtier.tiers.base",
    "TierStats": "kvtier.tiers.base",
    "TieredStore": "kvtier.tiers.store",
    "chunk_id": "kvtier.tiers.store",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
