"""TiersConfig: which tiers below the device an engine spills to, and how it restores."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvtier.errors import KvtierError
from kvtier.tiers.factory import DISK_BACKENDS, StorageConfig
from kvtier.tiers.vocab import FORM_PRECISION, FULL, LOWER_TIERS

if TYPE_CHECKING:
    from kvtier.policy.cost_model import CostProfile

RestoreMode = Literal["load", "plan", "recompute"]
RestorePipeline = Literal["chunk", "layer"]
WriteThrough = bool | Literal["selective"]
DiskCopy = Literal["on_write", "on_shutdown"]
Integrity = Literal["mac", "encrypt", "none"]

TIER_NAMES = LOWER_TIERS  # top first


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
    `write_through`: when a request finishes, copy its computed full chunks that no tier holds
    yet to the top tier right away (in the background, the device blocks staying cached), as
    LMCache does by default and SGLang HiCache's `write_through` policy; only where eviction
    spills (`spill_on_evict`). A later eviction or policy move of such a chunk then frees its
    device blocks with no copy; the price is the bytes written for every finished turn, also
    for sessions that never come back or stay on device until they do. `"selective"` copies
    only the chunks a request reused (its prompt found them on the device or in a tier, so
    they were computed for an earlier request: seen twice, as Dynamo's KVBM offloads to disk
    only blocks seen twice and SGLang HiCache's `write_through_selective` counts hits): a
    conversation's history is written once it has come back, and one that never returns
    writes nothing.
    `keep_moved`: a chunk a policy moves off the device keeps its device blocks, hittable,
    until the pool needs them (they are reused first, with no spill: a tier holds the chunk),
    as vLLM's prefix cache keeps a freed block; the policy sees them as free. Off, a move
    frees its blocks at once.
    `swap_on_preempt`: a request preempted for lack of blocks has its computed blocks spilled
    when the pool reuses them (swap-out), and restored at re-admission, instead of recomputed.
    Spills and writes down the cascade run on background workers: `spill_queue` bounds the
    chunks staged in host memory waiting for them (a spill that finds it full is dropped and
    the KV recomputed later); a failed copy is tried `retries` more times, then it is a miss.
    `forms`: the form each tier stores chunks in, e.g. {"disk": "int8", "remote": "int4"}
    ("full", "int8", "int4"; see docs/tiers.md "Forms"). A tier not listed keeps the form of
    the tier above it (the top tier: "full"); a tier may not be more precise than the one
    above it. Chunks are encoded on the mover's worker as they enter the tier.
    `restore_pipeline`: "chunk" restores every chunk whole before the forward that uses it;
    "layer" writes full-precision chunks to disk and Redis as layered records (one checksum
    per layer) and restores them a layer at a time while the forward runs (the forward waits
    for layer i, verified, before layer i's attention): docs/tiers.md (signed and
    sealed records too: each layer's checksum, the signature or the seal's tag with the last
    layer). Quantized forms, the host tier, O_DIRECT disk tiers and
    engines whose forward does not wait per layer (vLLM) keep the whole-chunk path.
    `disk_copy`, with a persistent disk tier (`disk_persist`) under a host tier: "on_write"
    copies each chunk the host tier takes to disk as well, right after it on the same worker,
    so it survives the process, a kill -9 included (SGLang HiCache's `write_through` from host
    to storage; LMCache writes its local disk backend on every store too); the host copy
    serves reads, and a demotion to disk takes the copy with no write. "on_shutdown" writes
    the host's chunks to disk only when they are demoted and at shutdown (HiCache's
    `write_back`): no second write of every spill, but a kill -9 loses the host's chunks.
    `shutdown_flush_s`: with a persistent disk tier, `close()` (a graceful shutdown) spends at
    most this long writing to disk what would be lost with the process: the writes still
    queued, the chunks of cached device blocks no tier holds, and the host's chunks without
    a copy on disk; 0 skips it.
    `encrypt` seals disk and remote records with `encrypt_key` (AES-GCM; a random per-process
    key without one). `integrity`, how the remote tier protects its values: "encrypt"
    (sealed), "mac" (signed with `encrypt_key`: readable, but nobody without the key can
    forge one), "none" (checksummed only; warned at start). None picks "encrypt" with
    `encrypt`, else "mac" when `encrypt_key` is set, else "none" (docs/storage-format.md,
    "Threat model").
    """

    host_bytes: int = 1 << 30
    disk_bytes: int = 0
    disk_dir: str | Path | None = None
    disk_persist: bool = False  # keep the disk tier's chunks across restarts (and recover them)
    disk_backend: str = "segments"  # an implementation of kvtier.tiers.factory.DISK_BACKENDS
    disk_copy: DiskCopy = "on_write"
    shutdown_flush_s: float = 10.0
    redis_url: str | None = None
    redis_bytes: int = 1 << 30
    redis_prefix: str = "kvt"
    redis_cluster: bool = False  # redis_url names one node of a Redis Cluster
    redis_timeout_s: float = 0.25
    chunk_tokens: int = 256
    encrypt: bool = False
    encrypt_key: bytes | None = None  # None with encrypt=True: a random per-process key
    integrity: Integrity | None = None
    restore: RestoreMode = "load"
    restore_deadline_s: float = 2.0  # wait this long for a queued request's loads
    restore_pipeline: RestorePipeline = "chunk"
    prefetch: bool = True  # start loads when a request is queued
    spill_on_evict: bool | None = None
    write_through: WriteThrough = False
    keep_moved: bool = False
    swap_on_preempt: bool = True
    spill_queue: int = 16
    retries: int = 2
    cost_profile: CostProfile | None = None
    forms: Mapping[str, str] = field(default_factory=dict)

    def tier_forms(self) -> dict[str, str]:
        """The form of each of host, disk and remote, unlisted ones filled in."""
        resolved, above = {}, FULL
        for name in TIER_NAMES:
            above = resolved[name] = self.forms.get(name, above)
        return resolved

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
        if not (isinstance(self.write_through, bool) or self.write_through == "selective"):
            raise KvtierError(
                f"tiers.write_through must be true, false or 'selective', got "
                f"{self.write_through!r}"
            )
        if not isinstance(self.keep_moved, bool):
            raise KvtierError(f"tiers.keep_moved must be true or false, got {self.keep_moved!r}")
        if self.restore not in ("load", "plan", "recompute"):
            raise KvtierError(f"tiers.restore must be load, plan or recompute: {self.restore!r}")
        if self.restore_pipeline not in ("chunk", "layer"):
            raise KvtierError(
                f"tiers.restore_pipeline must be chunk or layer: {self.restore_pipeline!r}"
            )
        if not self.restore_deadline_s >= 0:
            raise KvtierError("tiers.restore_deadline_s must be >= 0")
        if self.disk_copy not in ("on_write", "on_shutdown"):
            raise KvtierError(
                f"tiers.disk_copy must be on_write or on_shutdown, got {self.disk_copy!r}"
            )
        flush = self.shutdown_flush_s
        if isinstance(flush, bool) or not isinstance(flush, int | float) or not flush >= 0:
            raise KvtierError(f"tiers.shutdown_flush_s must be a number >= 0, got {flush!r}")
        if self.disk_backend not in DISK_BACKENDS:
            raise KvtierError(
                f"tiers.disk_backend: unknown {self.disk_backend!r}; "
                f"choose one of {', '.join(DISK_BACKENDS)}"
            )
        if self.disk_backend == "mmap" and (self.encrypt or self.disk_persist):
            raise KvtierError(
                "tiers.disk_backend='mmap' neither encrypts nor persists: use 'segments' "
                "with encrypt or disk_persist"
            )
        if self.disk_bytes and self.disk_dir is None:
            raise KvtierError("tiers.disk_bytes needs tiers.disk_dir")
        if not (self.host_bytes or (self.disk_bytes and self.disk_dir) or self.redis_url):
            raise KvtierError("tiers: configure at least one of host, disk, redis")
        self._check_forms()
        self._check_integrity()

    def storage(self, host_slot_bytes: int | None = None, layered: bool = False) -> StorageConfig:
        """What `kvtier.tiers.factory.build_tiers` needs to build these tiers (`layered`:
        disk and Redis write layered records, for a pipelined restore)."""
        return StorageConfig(
            host_bytes=self.host_bytes,
            host_slot_bytes=host_slot_bytes,
            disk_dir=self.disk_dir,
            disk_bytes=self.disk_bytes,
            disk_persist=self.disk_persist,
            disk_backend=self.disk_backend,
            seal_disk=self.encrypt,
            redis_url=self.redis_url,
            redis_bytes=self.redis_bytes,
            redis_prefix=self.redis_prefix,
            redis_cluster=self.redis_cluster,
            redis_timeout_s=self.redis_timeout_s,
            remote_integrity=self.remote_integrity(),
            key=self.encrypt_key,
            layered=layered,
        )

    def remote_integrity(self) -> Integrity:
        """How the remote tier protects its values (`integrity`, or the default it implies)."""
        if self.integrity is not None:
            return self.integrity
        if self.encrypt:
            return "encrypt"
        return "mac" if self.encrypt_key is not None else "none"

    def _check_integrity(self) -> None:
        if self.integrity not in (None, "mac", "encrypt", "none"):
            raise KvtierError(
                f"tiers.integrity must be mac, encrypt or none, got {self.integrity!r}"
            )
        if self.integrity == "mac" and self.encrypt_key is None:
            # A per-process key would make every other replica's and every earlier run's
            # values misses: signing needs the key the replicas share.
            raise KvtierError("tiers.integrity='mac' needs tiers.encrypt_key")
        if self.encrypt and self.integrity in ("mac", "none"):
            raise KvtierError(
                f"tiers.encrypt=True seals remote values; tiers.integrity={self.integrity!r} "
                "contradicts it (leave integrity unset or set it to 'encrypt')"
            )

    def _check_forms(self) -> None:
        if not isinstance(self.forms, Mapping):
            raise KvtierError(
                "tiers.forms must map tier names to forms, e.g. {'disk': 'int8'}, "
                f"got {self.forms!r}"
            )
        for tier, form in self.forms.items():
            if tier not in TIER_NAMES:
                raise KvtierError(
                    f"tiers.forms: unknown tier {tier!r}; the tiers are {', '.join(TIER_NAMES)}"
                )
            if form not in FORM_PRECISION:
                raise KvtierError(
                    f"tiers.forms[{tier!r}]: unknown form {form!r}; "
                    f"the forms are {', '.join(FORM_PRECISION)}"
                )
        above_name, above = "host", "full"
        for tier in TIER_NAMES:
            form = self.forms.get(tier, above)
            if FORM_PRECISION[form] > FORM_PRECISION[above]:
                raise KvtierError(
                    f"tiers.forms: {tier} stores {form}, more precise than {above} in {above_name} "
                    f"above it; precision lost higher up cannot come back, so give {tier} "
                    f"{above} or a less precise form"
                )
            above_name, above = tier, form
