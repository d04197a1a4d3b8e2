"""TiersConfig: which tiers below the device an engine spills to, and how it restores."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvtier.errors import KvtierError

if TYPE_CHECKING:
    from kvtier.policy.cost_model import CostProfile

RestoreMode = Literal["load", "plan", "recompute"]


@dataclass
class TiersConfig:
    """Tiers under the device pool, fastest first: host (DRAM), disk, remote (Redis).

    A tier with a zero budget (host, disk) or no location (disk_dir, redis_url) is left out;
    at least one must remain. `chunk_tokens` is the unit of movement (a multiple of the
    engine's block size). `restore`: "load" restores every stored block of a resumed prefix,
    "plan" asks `kvtier.policy.restore.plan_restore` (with `cost_profile`, else the policy
    config's profile) and recomputes when it says that is faster, "recompute" never loads.
    `spill_on_evict`: demote cached blocks the device pool reuses instead of dropping them;
    None follows the policy (`retain` and `recompute` drop, others cascade).
    `swap_on_preempt`: a request preempted for lack of blocks has its computed blocks spilled
    when the pool reuses them (swap-out), and restored at re-admission, instead of recomputed.
    Spills and writes down the cascade run on background workers: `spill_queue` bounds the
    chunks staged in host memory waiting for them (a spill that finds it full is dropped and
    the KV recomputed later); a failed copy is tried `retries` more times, then it is a miss.
    """

    host_bytes: int = 1 << 30
    disk_bytes: int = 0
    disk_dir: str | Path | None = None
    redis_url: str | None = None
    redis_bytes: int = 1 << 30
    redis_prefix: str = "kvt"
    redis_timeout_s: float = 0.25
    chunk_tokens: int = 256
    encrypt: bool = False
    encrypt_key: bytes | None = None  # None with encrypt=True: a random per-process key
    restore: RestoreMode = "load"
    restore_deadline_s: float = 2.0  # wait this long for a queued request's loads
    prefetch: bool = True  # start loads when a request is queued
    spill_on_evict: bool | None = None
    swap_on_preempt: bool = True
    spill_queue: int = 16
    retries: int = 2
    cost_profile: CostProfile | None = None

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes", "redis_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise KvtierError(f"tiers.{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise KvtierError(f"tiers.chunk_tokens must be >= 1, got {self.chunk_tokens!r}")
        for name in ("spill_queue", "retries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise KvtierError(f"tiers.{name} must be an integer >= 0, got {value!r}")
        if self.spill_queue < 1:
            raise KvtierError("tiers.spill_queue must be >= 1")
        if self.restore not in ("load", "plan", "recompute"):
            raise KvtierError(f"tiers.restore must be load, plan or recompute: {self.restore!r}")
        if not self.restore_deadline_s >= 0:
            raise KvtierError("tiers.restore_deadline_s must be >= 0")
        if self.disk_bytes and self.disk_dir is None:
            raise KvtierError("tiers.disk_bytes needs tiers.disk_dir")
        if not (self.host_bytes or (self.disk_bytes and self.disk_dir) or self.redis_url):
            raise KvtierError("tiers: configure at least one of host, disk, redis")
