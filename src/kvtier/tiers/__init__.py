"""Tiers below device memory (host, disk, remote) and the store that moves KV chunks among them.

See docs/tiers.md for the contract, the formats on disk and in Redis, and the failure semantics.
"""

from kvtier.tiers.base import (
    CorruptRecord,
    RejectedRecord,
    TierBackend,
    TierEntry,
    TierError,
    TierStats,
)
from kvtier.tiers.crypto import Sealer, Signer
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.mover import Mover, Prefetch
from kvtier.tiers.payload import Payload
from kvtier.tiers.redis_tier import RedisTier
from kvtier.tiers.sized import SizeOnlyTier
from kvtier.tiers.store import Chunk, Placement, TieredStore, chunk_id

__all__ = [
    "Chunk",
    "CorruptRecord",
    "DiskTier",
    "HostTier",
    "Mover",
    "Payload",
    "Placement",
    "Prefetch",
    "RedisTier",
    "RejectedRecord",
    "Sealer",
    "Signer",
    "SizeOnlyTier",
    "TierBackend",
    "TierEntry",
    "TierError",
    "TierStats",
    "TieredStore",
    "chunk_id",
]
