"""The tier backend contract: a byte-budgeted store of chunk payloads that never raises.

Every tier (host, disk, Redis, size-only) implements five small hooks, `_put`, `_get`,
`_delete`, `_contains` and the two budget properties. The public methods here wrap them once for
all tiers: they time the call, count bytes, ops, hits, misses and errors, and turn any failure
into a miss (`get` -> None) or a refusal (`put` -> False). A caller that gets None recomputes;
an outage or a corrupt record costs speed, never a wrong answer and never an exception.

Keys are the engine's content addresses (`bytes`); `namespace` is the tenant namespace the key
was made in. Tiers keep namespaces apart (a key written in one namespace is not found in
another) and use it to pick the per-tenant encryption key.
"""

from __future__ import annotations

import errno
import logging
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvtier.tiers.histogram import LatencyHistogram
from kvtier.tiers.payload import Payload

if TYPE_CHECKING:
    from kvtier.tiers.record import LayerCheck, RecordHead

log = logging.getLogger(__name__)

EvictListener = Callable[[bytes, str], None]
_WRITES = ("put", "delete")  # the operations that write (a durable delete appends a tombstone)


class TierError(Exception):
    """An operation failed in a way callers must see as a miss: I/O error, timeout, corrupt or
    tampered record, or a tier that is down. Raised inside backends, never out of them."""


class CorruptRecord(TierError):
    """A stored record fails the checks any reader can make (a head or body checksum, a length):
    torn, truncated or bit-flipped. No reader will ever serve it, so a tier may delete it."""


class RejectedRecord(TierError):
    """A record this reader does not accept although its checksums hold: it fails this reader's
    key (another master key, a forgery), names another key or namespace, or is protected
    otherwise than this tier is (sealed, signed, neither) or by a newer format. Others may
    read it, so it is a miss here and stays where it is: one misconfigured reader must not
    delete what the rest use."""


class LayerRead(NamedTuple):
    """One chunk's share of a layer read: its layered record's `head` (from `layer_heads`),
    `slabs`, where the layer's bytes go, one writable buffer per block in body order (the
    device blocks' slices of that layer), and `check`, what verifies them, the same one for
    every layer of one restore (`TierBackend.layer_check`: a signed record's signature, a sealed
    one's tag, spans all its layers)."""

    key: bytes
    namespace: str
    head: RecordHead
    slabs: list[memoryview]
    check: LayerCheck


@dataclass(frozen=True, slots=True)
class TierEntry:
    """One stored payload as a tier lists it after a restart (see `TierBackend.entries`)."""

    key: bytes
    namespace: str
    nbytes: int
    form: str


# errnos of a filesystem with no room left for a write (or a quota reached)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
ERROR_REASONS = ("no_space", "io", "corrupt", "rejected", "failed", "unexpected")


def error_reason(exc: BaseException) -> str:
    """Why a tier operation failed, in the words of the `tier_errors_total` metric's `reason`
    label: `no_space` (the filesystem is full), `io` (another OS error), `corrupt`,
    `rejected`, `failed` (another TierError: a tier down, a record gone) or `unexpected` (a
    bug: logged with its traceback)."""
    if isinstance(exc, CorruptRecord):
        return "corrupt"
    if isinstance(exc, RejectedRecord):
        return "rejected"
    if isinstance(exc, OSError):
        return "no_space" if exc.errno in _NO_SPACE else "io"
    return "failed" if isinstance(exc, TierError) else "unexpected"


class TierStats:
    """Counters of one tier; `snapshot()` is what metrics and benchmarks read."""

    _COUNTERS = (
        "reads",
        "writes",
        "deletes",
        "bytes_read",
        "bytes_written",
        "hits",
        "misses",
        "errors",
        "refused",
        "evicted",
        "corrupt",
        "rejected",
    )

    def __init__(self) -> None:
        self.reads = 0
        self.writes = 0
        self.deletes = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.hits = 0
        self.misses = 0
        self.errors = 0
        # puts turned down for lack of room (the store then makes room or gives up)
        self.refused = 0
        # entries the backend dropped on its own to stay within budget (disk GC, Redis)
        self.evicted = 0
        # reads that met a CorruptRecord (then dropped) or a RejectedRecord (then left in
        # place), and puts refused by a RejectedRecord (a value of another key or mode under
        # the name, left as it is); both are counted in `errors` too
        self.corrupt = 0
        self.rejected = 0
        # every error by `error_reason` (the metric's label)
        self.errors_by_reason: Counter[str] = Counter()
        self.get_latency = LatencyHistogram()
        self.put_latency = LatencyHistogram()
        self._lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def error(self, reason: str) -> None:
        """Count one failed operation, for `reason` (`error_reason`)."""
        with self._lock:
            self.errors += 1
            self.errors_by_reason[reason] += 1
            if reason in ("corrupt", "rejected"):
                setattr(self, reason, getattr(self, reason) + 1)

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            counters: dict[str, object] = {name: getattr(self, name) for name in self._COUNTERS}
            counters["errors_by_reason"] = dict(self.errors_by_reason)
        counters["get_latency"] = self.get_latency.snapshot()
        counters["put_latency"] = self.put_latency.snapshot()
        return counters


class TierBackend(ABC):
    """A store of payloads under a byte budget. Public methods never raise (see module doc)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stats = TierStats()
        # Set by the store: told of every entry the backend drops by itself, so the store's
        # index follows. Called after the operation, outside the backend's locks.
        self.on_evict: EvictListener | None = None
        self._pending_evictions: list[tuple[bytes, str]] = []
        self._pending_lock = threading.Lock()
        # writes failed with an OS error since the last one that succeeded: an episode of a
        # full or failing filesystem, logged once when it starts and once when it ends
        self._failing_writes = 0
        self._failing_lock = threading.Lock()

    # -- what a backend implements -------------------------------------------------------

    @property
    @abstractmethod
    def capacity_bytes(self) -> int:
        """The budget: the most bytes this tier will ever hold (headers and padding included)."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes held now, counted the way `capacity_bytes` is."""

    @abstractmethod
    def _put(self, key: bytes, payload: Payload, namespace: str) -> bool:
        """Store the payload; False when there is no room. Raise on failure."""

    @abstractmethod
    def _get(self, key: bytes, namespace: str, out: torch.Tensor | None) -> Payload | None:
        """The payload, read into `out` when given; None when absent. Raise on failure."""

    @abstractmethod
    def _delete(self, key: bytes, namespace: str) -> None: ...

    @abstractmethod
    def _contains(self, key: bytes, namespace: str) -> bool: ...

    def fits(self, nbytes: int) -> bool:
        """Whether a put of `nbytes` would find room without the store evicting first.

        Tiers that reclaim space themselves (disk GC, Redis oldest-first) override this.
        """
        return self.used_bytes + nbytes <= self.capacity_bytes

    def entries(self) -> list[TierEntry]:
        """What survived a restart, oldest first; volatile tiers have nothing."""
        return []

    # A tier whose reads are memory copies (host DRAM): a restore reads it straight into the
    # device blocks when it needs the chunk, since a prefetch into a buffer of its own would
    # only add a copy.
    in_memory = False

    # A tier other processes write to as well (Redis shared by replicas): the store asks it
    # about chunks its own index does not have (`find`).
    shared = False

    def find(self, keys: Sequence[bytes], *, namespace: str = "") -> list[TierEntry | None]:
        """For each key, its entry if this tier holds it (written by any process), else None;
        one batched, timeout-bounded call. Never raises: a failure finds nothing. Tiers only
        this process writes have nothing to add to the store's index."""
        return [None] * len(keys)

    # -- layer reads (the layer-wise pipelined restore, docs/tiers.md) ----------------

    @property
    def layered(self) -> bool:
        """Whether this tier writes layered records (and so may serve `read_layer`)."""
        return False

    def layer_heads(self, keys: Sequence[tuple[bytes, str]]) -> list[RecordHead | None]:
        """For each (key, namespace), the head of its record when it is a layered record this
        tier can serve a layer at a time (`RecordCodec.accepts`), else None: read it whole.
        Tiers without layered records (host: a memory copy has nothing to overlap) have none."""
        return [None] * len(keys)

    def layer_check(self, head: RecordHead) -> LayerCheck:
        """What verifies one restore of `head` (from `layer_heads`) a layer at a time: give it
        to every `LayerRead` of that restore, layers in order."""
        raise TierError(f"{self.name} serves no layer reads")

    def read_layer(self, items: Sequence[LayerRead], layer: int) -> list[bool]:
        """Read layer `layer` of each item's record into its slabs and verify it with the
        item's `check` (its own checksum; a signed record's signature, or a sealed one's
        tag, with its last layer; a sealed layer is decrypted into the slabs);
        False where it is missing, short, damaged, forged or failed (the slabs may then hold
        anything and must not be used). Never raises."""
        return [False] * len(items)

    def close(self) -> None:  # noqa: B027 (optional hook: volatile tiers hold nothing to release)
        """Release files, memory and connections."""

    # -- the contract callers use --------------------------------------------------------

    def put(self, key: bytes, payload: Payload, *, namespace: str = "") -> bool:
        """Store `payload` under `key`; False when refused (full) or failed."""
        start = perf_counter()
        try:
            result: bool | BaseException = self._put(key, payload, namespace)
        except Exception as exc:  # a failing tier must cost a recompute, never an exception
            result = exc
        ok = self._record_put(key, payload, result, perf_counter() - start)
        self._deliver_evictions()
        return ok

    def put_many(
        self, items: Sequence[tuple[bytes, Payload]], *, namespace: str = ""
    ) -> list[bool]:
        """Store several payloads; backends with a batch path (Redis pipelines) override."""
        return [self.put(key, payload, namespace=namespace) for key, payload in items]

    def get(
        self, key: bytes, *, namespace: str = "", out: torch.Tensor | None = None
    ) -> Payload | None:
        """The payload under `key`, or None (absent, failed, timed out or failed its checksum).

        out: a 1-D uint8 tensor of at least the payload's size to read into (a device block's
            slab, a pinned staging buffer); the returned payload's data is then a view of it.
        """
        start = perf_counter()
        try:
            result: Payload | BaseException | None = self._get(key, namespace, out)
        except Exception as exc:  # see put
            result = exc
        return self._record_get(key, result, perf_counter() - start)

    def get_many(
        self,
        keys: Sequence[bytes],
        *,
        namespace: str = "",
        outs: Sequence[torch.Tensor | None] | None = None,
    ) -> list[Payload | None]:
        """`get` for several keys; backends with a batch path (Redis pipelines) override."""
        outs = outs if outs is not None else [None] * len(keys)
        return [
            self.get(key, namespace=namespace, out=out) for key, out in zip(keys, outs, strict=True)
        ]

    def delete(self, key: bytes, *, namespace: str = "") -> None:
        try:
            self._delete(key, namespace)
        except Exception as exc:  # see put
            self._failed("delete", key, exc)
        else:
            self.stats.add(deletes=1)
        self._deliver_evictions()  # a durable delete appends, and appending may collect

    def contains(self, key: bytes, *, namespace: str = "") -> bool:
        try:
            return self._contains(key, namespace)
        except Exception as exc:  # see put
            self._failed("contains", key, exc)
            return False

    # -- shared bookkeeping --------------------------------------------------------------

    def _record_put(
        self, key: bytes, payload: Payload, result: bool | BaseException, seconds: float
    ) -> bool:
        self.stats.put_latency.observe(seconds)
        if isinstance(result, BaseException):
            self._failed("put", key, result)
            return False
        if result:
            self._writes_recovered()
            self.stats.add(writes=1, bytes_written=payload.nbytes)
        else:
            self.stats.add(refused=1)
        return result

    def _record_get(
        self, key: bytes, result: Payload | BaseException | None, seconds: float
    ) -> Payload | None:
        self.stats.get_latency.observe(seconds)
        if isinstance(result, BaseException):
            self._failed("get", key, result)
            return None
        if result is None:
            self.stats.add(misses=1)
        else:
            self.stats.add(hits=1, reads=1, bytes_read=result.nbytes)
        return result

    def _failed(self, op: str, key: bytes, exc: BaseException) -> None:
        reason = error_reason(exc)
        self.stats.error(reason)
        if isinstance(exc, OSError) and op in _WRITES:
            self._write_failed(op, exc, reason)
        elif isinstance(exc, TierError | OSError):
            # Expected failures are counted, not logged one by one: an outage would flood the
            # log. Backends log their own state changes (Redis down/up) once.
            log.debug("%s %s %s failed: %s", self.name, op, key.hex()[:16], exc)
        else:
            log.error("%s %s %s failed unexpectedly", self.name, op, key.hex()[:16], exc_info=exc)

    def _write_failed(self, op: str, exc: OSError, reason: str) -> None:
        """A write the filesystem refused (full, read-only, failing): the operator must hear
        of it, but once per episode, not once per chunk."""
        with self._failing_lock:
            self._failing_writes += 1
            first = self._failing_writes == 1
        if first:
            log.warning(
                "%s: writes are failing (%s: %s); chunks are not stored until they succeed "
                "again, reads go on (counted as tier_errors_total{tier=%r, reason=%r})",
                self.name,
                op,
                exc.strerror or exc,
                self.name,
                reason,
            )

    def _writes_recovered(self) -> None:
        with self._failing_lock:
            failed, self._failing_writes = self._failing_writes, 0
        if failed:
            log.info("%s: writes succeed again, after %d failed", self.name, failed)

    def _evicted(self, key: bytes, namespace: str) -> None:
        """Called by backends (under their own locks) for each entry they drop by themselves."""
        with self._pending_lock:
            self._pending_evictions.append((key, namespace))
        self.stats.add(evicted=1)

    def _deliver_evictions(self) -> None:
        with self._pending_lock:
            pending, self._pending_evictions = self._pending_evictions, []
        if self.on_evict is not None:
            for key, namespace in pending:
                self.on_evict(key, namespace)
