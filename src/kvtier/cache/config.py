"""TiersConfig: which tiers below the device an engine spills to, and how it restores."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from kvtier.errors import KvtierError
from kvtier.setting_doc import check_choices, setting
from kvtier.vocab import DISK_BACKEND_NAMES, FORM_PRECISION, FULL, LOWER_TIERS

if TYPE_CHECKING:
    from kvtier.policy.cost_model import CostProfile
    from kvtier.tiers.factory import StorageConfig

RestoreMode = Literal["load", "plan", "recompute"]
RestorePipeline = Literal["chunk", "layer"]
WriteThrough = bool | Literal["selective"]
DiskCopy = Literal["on_write", "on_shutdown"]
Integrity = Literal["mac", "encrypt", "none"]

TIER_NAMES = LOWER_TIERS  # top first


def default_host_bytes() -> int:
    """A tenth of the machine's memory, at most half of what is free now, whole MiB: the host
    tier is preallocated at start, so it must leave room for the model and everything else."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 30
    return max(0, min(total // 10, free // 2)) & ~((1 << 20) - 1)


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

    host_bytes: int = setting(
        default_factory=default_host_bytes,
        help="the host tier's budget, allocated up front; 0: no host tier "
        "([backends/host.md](../backends/host.md))",
        kind="size",
        default_text="a tenth of the machine's memory, at most half of what is free at start",
        flag=True,
    )
    disk_bytes: int = setting(
        0,
        help="the disk tier's budget, capped at start to what the filesystem can hold",
        kind="size",
        default_text="half the free space of `disk_dir`'s filesystem, at most 64 GiB",
        flag=True,
    )
    disk_dir: str | Path | None = setting(
        None,
        help="the disk tier's folder; a configured folder is persistent "
        "([backends/disk.md](../backends/disk.md))",
        kind="path",
        default_text="none (no disk tier)",
        flag=True,
    )
    # keep the disk tier's chunks across restarts (and recover them): set for a configured
    # disk_dir by the settings loader, so not a key of its own
    disk_persist: bool = False
    disk_backend: str = setting(
        "segments",
        help="`segments` (log-structured, durable) or `mmap` (the example backend: neither "
        "encrypts nor persists)",
        kind="string",
        choices=DISK_BACKEND_NAMES,
    )
    disk_copy: DiskCopy = setting(
        "on_write",
        help="over a persistent disk tier: `on_write` copies each chunk the host takes to disk; "
        "`on_shutdown` only when demoted and at shutdown",
        kind="string",
        choices=get_args(DiskCopy),
    )
    shutdown_flush_s: float = setting(
        10.0,
        help="seconds a graceful shutdown may spend writing memory's chunks to a persistent "
        "disk tier; 0: none",
        kind="number",
    )
    redis_url: str | None = setting(
        None,
        help="`redis://HOST:PORT/DB` ([backends/redis.md](../backends/redis.md))",
        kind="string",
        default_text="none (no remote tier)",
        flag=True,
        key="remote_url",
    )
    redis_bytes: int = setting(
        1 << 30,
        help="what this process may write to Redis; the global bound is Redis's `maxmemory`",
        kind="size",
        flag=True,
        key="remote_bytes",
    )
    redis_prefix: str = setting(
        "kvt",
        help="the first part of every Redis key; one per deployment",
        kind="string",
        key="remote_prefix",
    )
    redis_cluster: bool = setting(
        False,
        help="`remote_url` names one node of a Redis Cluster",
        kind="bool",
        flag=True,
        key="remote_cluster",
    )
    redis_timeout_s: float = setting(
        0.25,
        help="socket and connect timeout of a Redis call",
        kind="number",
        key="remote_timeout_s",
    )
    chunk_tokens: int = setting(
        256,
        help="tokens per chunk, the unit of movement (a multiple of the block size)",
        kind="int",
        flag=True,
    )
    encrypt: bool = setting(
        False,
        help="seal disk and Redis records (AES-256-GCM); needs `encrypt_key_file`",
        kind="bool",
        flag=True,
    )
    encrypt_key: bytes | None = None  # read from encrypt_key_file; None with encrypt=True: a
    # random per-process key
    integrity: Integrity | None = setting(
        None,
        help="how Redis values are protected: `encrypt` (sealed), `mac` (signed), `none` "
        "(checksummed) ([storage-format.md](../storage-format.md))",
        kind="string",
        default_text='`"encrypt"` with `encrypt`, else `"mac"` with a key, else `"none"`',
        choices=get_args(Integrity),
    )
    restore: RestoreMode = setting(
        "load",
        help="`load` every stored chunk, `plan` (load, recompute or both, by the restore "
        "planner) or `recompute`",
        kind="string",
        choices=get_args(RestoreMode),
    )
    restore_deadline_s: float = setting(
        2.0,
        help="how long a step waits for a queued request's loads before recomputing the rest",
        kind="number",
    )
    restore_pipeline: RestorePipeline = setting(
        "chunk",
        help="`chunk` (whole chunks before the forward) or `layer` (overlapped with it: "
        "[tiers.md](../tiers.md#layer-wise-pipelined-restore))",
        kind="string",
        choices=get_args(RestorePipeline),
        flag=True,
    )
    prefetch: bool = setting(True, help="start loads when a request is queued", kind="bool")
    spill_on_evict: bool | None = setting(
        None,
        help="copy blocks the device pool evicts into the top tier instead of dropping them",
        kind="bool",
        default_text="by policy: false for `retain` and `recompute`, else true",
    )
    write_through: WriteThrough = setting(
        False,
        help="copy a finished request's full chunks to the top tier at once (`selective`: "
        "only those a prompt reused)",
        kind='bool or `"selective"`',
        flag=True,
    )
    keep_moved: bool = setting(
        False,
        help="a chunk a policy moves off the device keeps its device blocks, hittable, until "
        "the pool needs them",
        kind="bool",
        flag=True,
    )
    swap_on_preempt: bool = setting(
        True,
        help="a preempted request's computed blocks are spilled and restored at re-admission",
        kind="bool",
    )
    spill_queue: int = setting(
        16,
        help="chunks waiting to be written; a spill that finds it full is dropped "
        "(recomputed later)",
        kind="int",
    )
    retries: int = setting(
        2, help="further tries of a failed tier copy before it is a miss", kind="int"
    )
    cost_profile: CostProfile | None = None  # the engine's measured prefill costs, from code
    forms: Mapping[str, str] = setting(
        default_factory=dict,
        help='the form each tier stores: `{disk = "int8", remote = "int4"}`; a tier not '
        "listed keeps the form above it",
        kind="table",
        default_text="`{}` (full precision)",
    )

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
        if not self.restore_deadline_s >= 0:
            raise KvtierError("tiers.restore_deadline_s must be >= 0")
        flush = self.shutdown_flush_s
        if isinstance(flush, bool) or not isinstance(flush, int | float) or not flush >= 0:
            raise KvtierError(f"tiers.shutdown_flush_s must be a number >= 0, got {flush!r}")
        if self.disk_backend not in DISK_BACKEND_NAMES:
            raise KvtierError(
                f"tiers.disk_backend: unknown {self.disk_backend!r}; "
                f"choose one of {', '.join(DISK_BACKEND_NAMES)}"
            )
        check_choices(self, "tiers")  # restore, restore_pipeline, disk_copy, integrity
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
        """What `kvtier.tiers.factory.build_backends` needs to build these tiers (`layered`:
        disk and Redis write layered records, for a pipelined restore)."""
        from kvtier.tiers.factory import StorageConfig  # the backends: torch, redis

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
