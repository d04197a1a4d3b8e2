"""TieredStore: which tier each chunk lives in, and the moves between tiers.

A chunk is the unit of movement: the block keys of `chunk_tokens` consecutive tokens moved as
one payload, because one big copy or request runs near full bandwidth and many 16-token ones do
not. The store keeps one index, chunk id -> (tier, size, form, namespace), with exactly one tier
holding each chunk, and a recency order per tier. It:

- puts a chunk into a tier (the top one by default), first making room there by demoting that
  tier's least recently used chunks one tier down (or dropping them from the last tier);
- demotes (host -> disk -> remote) on request or to make room;
- promotes: loads a chunk back for the caller, into the caller's buffer when given;
- stores each tier's chunks in that tier's form (`forms`, e.g. {"disk": "int8"}), converting
  a payload on its way in with the owner's `recode` (the engine connector quantizes there),
  on the thread that moves it: the mover's worker;
- deletes; and follows tiers that drop entries on their own (disk GC, Redis budget) through
  their `on_evict` hook;
- tells an optional `listener` each time a chunk enters or leaves a tier's place in the
  index (`PlacementListener`: stored on write, demotion, discovery, taking a copy;
  removed on demotion, drop, delete, failed read, a tier's own eviction);
- keeps a second copy of a tier's chunks in a tier below it where asked (`copy_to`, e.g.
  {"host": "disk"}: the host's chunks written through to a persistent disk tier, so they
  outlive the process). The index still names one tier per chunk, the upper one, which
  serves reads; a demotion into the copy's tier takes the copy and writes nothing.

It knows nothing about models, and reads only payload sizes, never payload bytes (`recode` is
the owner's), so the same code runs over size-only tiers in the simulator. Tier I/O runs
outside the store's lock, so spills and prefetches on different chunks overlap.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from time import perf_counter

import torch

from kvtier.tiers.base import EvictListener, TierBackend
from kvtier.tiers.histogram import LatencyHistogram
from kvtier.tiers.payload import Payload
from kvtier.vocab import lossiest

log = logging.getLogger(__name__)

# recode(payload, form): the payload in `form`, or unchanged when it is already at most as
# precise; raises when it cannot read the payload.
Recode = Callable[[Payload, str], Payload]

# How long a discover() may hold up its caller (the engine admitting a request): two
# pipelined round trips to a Redis on the same network take about a millisecond.
DISCOVER_DEADLINE_S = 0.1
CALLER = "caller"  # the other end of puts and promotes (the engine's device memory)
DROPPED = "dropped"  # where a chunk demoted off the last tier goes

# listener(chunk id, tier it left or None, tier it entered or None): called under the store's
# lock, in the order the index changed, from whichever thread changed it (often the mover's
# worker), so it must be quick and must not call back into the store. Copies (`copy_to`) are
# not placements: the index names the tier that serves a chunk's reads.
PlacementListener = Callable[[bytes, str | None, str | None], None]


def chunk_id(block_keys: Sequence[bytes]) -> bytes:
    """A chunk's key: a hash of its block keys, stable across processes (like the block keys)."""
    return prefix_chunk_ids(block_keys)[-1]


def prefix_chunk_ids(block_keys: Sequence[bytes]) -> list[bytes]:
    """The ids of the chunks made of the first 1, 2, ..., all of `block_keys`, hashed once."""
    digest = hashlib.blake2b(digest_size=32, person=b"kvtier.chunk")
    ids = []
    for key in block_keys:
        digest.update(len(key).to_bytes(2, "little"))
        digest.update(key)
        ids.append(digest.copy().digest())
    return ids or [digest.digest()]


@dataclass(frozen=True, slots=True)
class Chunk:
    """Block keys moved together as one payload, in the tenant namespace they were made in."""

    keys: tuple[bytes, ...]
    namespace: str = ""
    id: bytes = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", chunk_id(self.keys))


@dataclass(slots=True)
class Placement:
    """Where a chunk is and what it weighs: one index entry. `copy`: where its copy in a
    lower tier is (`TieredStore`'s `copy_to`), None without one."""

    tier: str
    nbytes: int
    form: str
    namespace: str
    copy: Placement | None = None


class MoveStats:
    """Ops, bytes, failures and latency of one direction of movement (e.g. host->disk)."""

    def __init__(self) -> None:
        self.ops = 0
        self.bytes = 0
        self.failures = 0
        self.latency = LatencyHistogram()
        self._lock = threading.Lock()

    def record(self, nbytes: int, seconds: float, ok: bool) -> None:
        with self._lock:
            if ok:
                self.ops += 1
                self.bytes += nbytes
            else:
                self.failures += 1
        self.latency.observe(seconds)

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            counts: dict[str, object] = {
                "ops": self.ops,
                "bytes": self.bytes,
                "failures": self.failures,
            }
        counts["latency"] = self.latency.snapshot()
        return counts


class TieredStore:
    def __init__(
        self,
        tiers: Sequence[TierBackend],
        *,
        block_tokens: int = 16,
        chunk_tokens: int = 256,
        forms: Mapping[str, str] | None = None,
        recode: Recode | None = None,
        copy_to: Mapping[str, str] | None = None,
    ) -> None:
        """tiers: top (fastest) first, e.g. [host, disk, remote]; names must differ.
        forms: tier name -> the form its chunks are stored in (unlisted: as they come);
        recode converts payloads into a form (needed when forms or a put's form is given).
        copy_to: tier name -> a tier below it that gets a copy of every chunk placed in it,
        written right after it (the cost: those bytes written twice)."""
        if not tiers or len({tier.name for tier in tiers}) != len(tiers):
            raise ValueError("the store needs at least one tier, each with its own name")
        if chunk_tokens % block_tokens:
            raise ValueError("chunk_tokens must be a multiple of block_tokens")
        self.forms = dict(forms or {})
        if self.forms and recode is None:
            raise ValueError("tier forms need a recode function")
        self.recode = recode
        self.tiers = {tier.name: tier for tier in tiers}
        self.order = [tier.name for tier in tiers]
        self.copy_to = dict(copy_to or {})
        for upper, lower in self.copy_to.items():
            if lower not in self.order or self.order.index(lower) <= self.order.index(upper):
                raise ValueError(f"copy_to: {lower!r} is not a tier below {upper!r}")
        # copies per tier (they are not in `_recency`: the index names the upper tier)
        self._copies: Counter[str] = Counter()
        self._copy_bytes: Counter[str] = Counter()
        self.block_tokens = block_tokens
        self.chunk_tokens = chunk_tokens
        self._index: dict[bytes, Placement] = {}
        self._recency: dict[str, OrderedDict[bytes, None]] = {
            name: OrderedDict() for name in self.order
        }
        self._busy: set[bytes] = set()  # chunks being demoted: not picked again meanwhile
        self._lock = threading.RLock()
        self.moves: dict[str, MoveStats] = {}
        self.recodes: dict[str, MoveStats] = {}  # "full->int8": conversions, input bytes, time
        self.misses = 0  # promotes of chunks the index does not have
        self.discovered = 0  # chunks found in a shared tier that this process never indexed
        self._discovering = False  # a discover() look-up is running
        self.listener: PlacementListener | None = None
        for tier in tiers:
            tier.on_evict = self._evict_listener(tier.name)

    # -- chunks and lookups --------------------------------------------------------------

    def chunks(self, block_keys: Sequence[bytes], namespace: str = "") -> list[Chunk]:
        """A sequence's block keys cut into chunks on the fixed grid (the last may be short)."""
        per_chunk = self.chunk_tokens // self.block_tokens
        return [
            Chunk(tuple(block_keys[i : i + per_chunk]), namespace)
            for i in range(0, len(block_keys), per_chunk)
        ]

    def locate(self, chunk: bytes) -> Placement | None:
        """Where the chunk with this id lives, or None."""
        with self._lock:
            return self._index.get(chunk)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def shared_tiers(self) -> list[TierBackend]:
        """The tiers other processes write too (Redis under several replicas), top first."""
        return [self.tiers[name] for name in self.order if self.tiers[name].shared]

    def discover(
        self,
        block_keys: Sequence[bytes],
        namespace: str = "",
        first_block: int = 0,
        deadline_s: float = DISCOVER_DEADLINE_S,
    ) -> int:
        """Index the chunks of a sequence that a shared tier (Redis under several replicas)
        holds and this index does not: written by another process, or before this one
        started. Candidates are the grid chunks from the one holding block `first_block` on,
        at every length (an earlier, shorter turn stores a short chunk); each shared tier is
        asked once, in one batch.

        The engine calls this while it admits a request, so it waits at most `deadline_s`:
        the look-up runs on its own thread, and one that comes back later still indexes what
        it found (for the next turn, or a prefetch). One look-up runs at a time, so a frozen
        tier holds one thread, not one per request. Returns how many were indexed in time."""
        shared = self.shared_tiers
        if not shared:
            return 0
        per_chunk = self.chunk_tokens // self.block_tokens
        start = first_block - first_block % per_chunk
        candidates = [
            cid
            for first in range(start, len(block_keys), per_chunk)
            for cid in prefix_chunk_ids(block_keys[first : first + per_chunk])
        ]
        with self._lock:
            unknown = [cid for cid in candidates if cid not in self._index]
            if not unknown or self._discovering:
                return 0
            self._discovering = True
        found = [0]
        done = threading.Event()

        def look_up() -> None:
            try:
                found[0] = self._find_in(shared, unknown, namespace)
            finally:
                with self._lock:
                    self._discovering = False
                done.set()

        threading.Thread(target=look_up, name="kvtier-discover", daemon=True).start()
        return found[0] if done.wait(deadline_s) else 0

    def _find_in(self, shared: Sequence[TierBackend], unknown: list[bytes], namespace: str) -> int:
        found = 0
        for tier in shared:
            if not unknown:
                break
            entries = tier.find(unknown, namespace=namespace)
            with self._lock:
                for cid, entry in zip(unknown, entries, strict=True):
                    if entry is not None and cid not in self._index:
                        placement = Placement(tier.name, entry.nbytes, entry.form, namespace)
                        self._index_put(cid, placement)
                        self.discovered += 1
                        found += 1
            unknown = [cid for cid, entry in zip(unknown, entries, strict=True) if entry is None]
        return found

    # -- movements -----------------------------------------------------------------------

    def put(
        self,
        chunk: Chunk,
        payload: Payload,
        *,
        tier: str | None = None,
        attempts: int = 1,
        form: str | None = None,
    ) -> bool:
        """Store a chunk's payload in `tier` (default: the top tier), making room there first.

        `form`: store it at most as precise as this (besides the tier's own form). False when
        every attempt failed or it cannot fit: the chunk is then simply not stored.
        """
        target = tier or self.order[0]
        return any(
            self._place(chunk.id, chunk.namespace, payload, target, CALLER, form)
            for _ in range(attempts)
        )

    def promote(
        self, chunk: bytes, *, out: torch.Tensor | None = None, attempts: int = 1
    ) -> Payload | None:
        """Load a chunk back for the caller (into `out` when given); it stays where it is.

        None when the store does not have it, or when `attempts` reads all failed (corrupt,
        timed out, tier down); the chunk is then forgotten (and deleted, but from a shared
        tier), and the caller recomputes it.
        """
        failures = 0
        while True:
            with self._lock:
                placement = self._index.get(chunk)
                if placement is None:
                    self.misses += 1
                    return None
            start = perf_counter()
            source = self.tiers[placement.tier]
            payload = source.get(chunk, namespace=placement.namespace, out=out)
            self._move(placement.tier, CALLER).record(
                placement.nbytes, perf_counter() - start, payload is not None
            )
            with self._lock:
                current = self._index.get(chunk)
                if payload is not None:
                    if current is placement:
                        self._recency[placement.tier].move_to_end(chunk)
                    return payload
                if current is not placement:
                    continue  # moved or replaced while we read: look again, not a failure
                failures += 1
                if failures < attempts:
                    continue
                self._unindex(chunk)
            # A shared tier's value is only forgotten: what fails this reader's check may be
            # another process's to serve (this one may be the misconfigured one), and damage
            # every reader sees that tier deletes on the read itself.
            self._delete_stored(chunk, placement, keep=placement.tier if source.shared else None)
            return None

    def demote(self, chunk: bytes, to: str | None = None, form: str | None = None) -> bool:
        """Move a chunk down to `to` (default: the next tier down; off the last tier it is
        dropped), at most as precise as `form` and the target's own form. False when the chunk
        is unknown, busy, or could not be placed (then dropped).
        """
        with self._lock:
            placement = self._index.get(chunk)
            if placement is None or chunk in self._busy:
                return False
            self._busy.add(chunk)
        return self._demote(chunk, placement, to, form)

    def delete(self, chunk: bytes) -> None:
        with self._lock:
            placement = self._unindex(chunk)
        if placement is not None:
            self._delete_stored(chunk, placement)

    def chunks_in(self, tier: str) -> list[bytes]:
        """The ids of the chunks the index places in `tier`, least recently used first."""
        with self._lock:
            return list(self._recency[tier])

    def copy_bytes(self, tier: str) -> int:
        """Bytes of the copies `tier` holds for chunks placed above it (`copy_to`): space a
        demotion into it takes without writing, and none a chunk needs."""
        with self._lock:
            return self._copy_bytes[tier]

    def recover(self) -> int:
        """Rebuild the index from what the tiers kept across a restart; returns the count.

        Bottom tier first, so where a chunk survived in two tiers the upper copy wins and the
        lower one is deleted.
        """
        for name in reversed(self.order):
            for entry in self.tiers[name].entries():
                with self._lock:
                    lower = self._unindex(entry.key)
                    self._index_put(
                        entry.key, Placement(name, entry.nbytes, entry.form, entry.namespace)
                    )
                if lower is not None:
                    self.tiers[lower.tier].delete(entry.key, namespace=lower.namespace)
        return len(self._index)

    # -- internals -----------------------------------------------------------------------

    def _place(
        self,
        chunk: bytes,
        namespace: str,
        payload: Payload,
        target: str,
        src: str,
        form: str | None = None,
    ) -> bool:
        stored = self._write(chunk, namespace, payload, target, self._move(src, target), form)
        if stored is None:
            return False
        placed = Placement(target, stored.nbytes, stored.form, namespace)
        with self._lock:
            # a chunk written again where it already was stays placed there: no event
            stale = self._unindex(chunk, notify=False)
            if stale is not None and stale.tier != target:
                self._notify(chunk, stale.tier, None)
            self._index_put(chunk, placed, notify=stale is None or stale.tier != target)
        if stale is not None:
            # One copy per chunk: the index now points at the new one.
            self._delete_stored(chunk, stale, keep=target)
        lower = self.copy_to.get(target)
        if lower is not None:
            self._copy(chunk, placed, stored, lower)
        return True

    def _write(
        self,
        chunk: bytes,
        namespace: str,
        payload: Payload,
        target: str,
        move: MoveStats,
        form: str | None,
    ) -> Payload | None:
        """Convert the payload to `form` and the target's own form, make room and put it;
        the payload as stored, or None when it was not."""
        tier = self.tiers[target]
        try:
            for wanted in (form, self.forms.get(target)):
                if wanted is not None and wanted != payload.form:
                    payload = self._recode(payload, wanted)
        except Exception:  # an unreadable payload is not stored, like a failed put
            log.exception("converting chunk %s to %s failed", chunk.hex()[:16], wanted)
            move.record(payload.nbytes, 0.0, False)
            return None
        if payload.nbytes > tier.capacity_bytes:
            return None
        self._make_room(tier, payload.nbytes)
        start = perf_counter()
        ok = tier.put(chunk, payload, namespace=namespace)
        move.record(payload.nbytes, perf_counter() - start, ok)
        return payload if ok else None

    def _copy(self, chunk: bytes, placed: Placement, payload: Payload, lower: str) -> None:
        """Write the copy of a chunk just placed, and note it in its index entry; when the
        chunk has moved or gone meanwhile, the copy is deleted again."""
        move = self._move(placed.tier, f"{lower}:copy")
        stored = self._write(chunk, placed.namespace, payload, lower, move, None)
        if stored is None:
            return  # a demotion will write it (a full or failing tier is counted there)
        with self._lock:
            current = self._index.get(chunk)
            if current is placed:
                placed.copy = Placement(lower, stored.nbytes, stored.form, placed.namespace)
                self._copies[lower] += 1
                self._copy_bytes[lower] += stored.nbytes
                return
            taken = current is not None and lower in (current.tier, _tier(current.copy))
        if not taken:
            self.tiers[lower].delete(chunk, namespace=placed.namespace)

    def _recode(self, payload: Payload, form: str) -> Payload:
        if self.recode is None:
            raise ValueError(f"no recode function to store a chunk as {form}")
        start = perf_counter()
        converted = self.recode(payload, form)
        if converted is not payload:
            name = f"{payload.form}->{converted.form}"
            stats = self.recodes.get(name)
            if stats is None:
                with self._lock:
                    stats = self.recodes.setdefault(name, MoveStats())
            stats.record(payload.nbytes, perf_counter() - start, True)
        return converted

    def _make_room(self, tier: TierBackend, nbytes: int) -> None:
        while not tier.fits(nbytes):
            with self._lock:
                victim = next((c for c in self._recency[tier.name] if c not in self._busy), None)
                if victim is None:
                    return  # nothing left to move; the put will be refused
                self._busy.add(victim)
                placement = self._index[victim]
            self._demote(victim, placement, None)

    def _demote(
        self, chunk: bytes, placement: Placement, to: str | None, form: str | None = None
    ) -> bool:
        """Move a chunk the caller marked busy; unmarks it."""
        source = placement.tier
        below = self.order.index(source) + 1
        target = to or (self.order[below] if below < len(self.order) else None)
        try:
            copy = placement.copy
            if (
                copy is not None
                and copy.tier == target
                and lossiest(form or copy.form, copy.form) == copy.form
            ):
                return self._take_copy(chunk, placement, copy)
            moved = False
            if target is not None:
                payload = self.tiers[source].get(chunk, namespace=placement.namespace)
                moved = payload is not None and self._place(
                    chunk, placement.namespace, payload, target, source, form
                )
            if not moved:
                with self._lock:
                    if self._index.get(chunk) is placement:
                        self._unindex(chunk)
                self._delete_stored(chunk, placement)
                self._move(source, DROPPED).record(placement.nbytes, 0.0, True)
            return moved
        finally:
            with self._lock:
                self._busy.discard(chunk)

    def _take_copy(self, chunk: bytes, placement: Placement, copy: Placement) -> bool:
        """Demote a chunk into the tier that holds its copy: the copy becomes the chunk's
        place and the upper one is freed; nothing is written."""
        with self._lock:
            if self._index.get(chunk) is not placement:
                return False
            self._unindex(chunk)
            self._index_put(chunk, copy)
        self.tiers[placement.tier].delete(chunk, namespace=placement.namespace)
        return True

    def _delete_stored(self, chunk: bytes, placement: Placement, keep: str | None = None) -> None:
        """Delete what `placement` (no longer indexed) names, its copy too, but in `keep`."""
        for where in (placement, placement.copy):
            if where is not None and where.tier != keep:
                self.tiers[where.tier].delete(chunk, namespace=where.namespace)

    def _index_put(self, chunk: bytes, placement: Placement, notify: bool = True) -> None:
        """Place an unindexed chunk (caller holds the lock)."""
        self._index[chunk] = placement
        self._recency[placement.tier][chunk] = None
        if notify:
            self._notify(chunk, None, placement.tier)

    def _unindex(self, chunk: bytes, notify: bool = True) -> Placement | None:
        placement = self._index.pop(chunk, None)
        if placement is not None:
            self._recency[placement.tier].pop(chunk, None)
            self._forget_copy(placement)
            if notify:
                self._notify(chunk, placement.tier, None)
        return placement

    def _notify(self, chunk: bytes, left: str | None, entered: str | None) -> None:
        listener = self.listener
        if listener is None:
            return
        try:
            listener(chunk, left, entered)
        except Exception:  # a listener's bug must not break a move (it costs its events)
            log.exception("the store's placement listener failed")

    def _forget_copy(self, placement: Placement) -> None:
        copy = placement.copy
        if copy is not None:
            self._copies[copy.tier] -= 1
            self._copy_bytes[copy.tier] -= copy.nbytes

    def _evict_listener(self, tier_name: str) -> EvictListener:
        def evicted(key: bytes, namespace: str) -> None:
            with self._lock:
                placement = self._index.get(key)
                if placement is None:
                    return
                copy = placement.copy
                if placement.tier == tier_name:
                    self._unindex(key)
                    if copy is not None:  # the copy below carries on as the chunk
                        self._index_put(key, copy)
                elif copy is not None and copy.tier == tier_name:
                    self._forget_copy(placement)
                    placement.copy = None

        return evicted

    def _move(self, src: str, dst: str) -> MoveStats:
        name = f"{src}->{dst}"
        stats = self.moves.get(name)
        if stats is None:
            with self._lock:
                stats = self.moves.setdefault(name, MoveStats())
        return stats

    # -- reporting -----------------------------------------------------------------------

    def snapshot(self) -> dict[str, object]:
        """Budgets and counters of every tier and every direction of movement."""
        with self._lock:
            chunks = {name: len(recency) for name, recency in self._recency.items()}
            copies = {name: self._copies[name] for name in self.order}
            misses, discovered = self.misses, self.discovered
        return {
            "tiers": {
                name: {
                    "used_bytes": tier.used_bytes,
                    "capacity_bytes": tier.capacity_bytes,
                    "chunks": chunks[name],
                    "copies": copies[name],
                    **tier.stats.snapshot(),
                }
                for name, tier in self.tiers.items()
            },
            "moves": {name: stats.snapshot() for name, stats in sorted(self.moves.items())},
            "recodes": {name: stats.snapshot() for name, stats in sorted(self.recodes.items())},
            "misses": misses,
            "discovered": discovered,
        }


def _tier(placement: Placement | None) -> str | None:
    return placement.tier if placement is not None else None
