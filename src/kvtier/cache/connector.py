"""TieredConnector: the engine's device blocks moving through host / disk / remote tiers.

In the spirit of vLLM's KV connector, the engine calls it at fixed points:

- `on_block_evicted` (a BlockEventListener): the pool is about to reuse an idle cached block.
  When spilling is on, the block's whole chunk (`chunk_tokens` of one sequence, on the fixed
  grid from its first block) is copied out as one payload (one gather into host memory: the
  only part the engine thread pays) and queued on the mover, whose worker writes it into the
  top tier (and runs the store's cascade of demotions to make room); the other blocks of the
  chunk stay on device and later evictions find the chunk stored or in flight. With spilling
  off (`retain`, `recompute`) the block is simply dropped, unless it belongs to a preempted
  request (swap-out, `swap_on_preempt`).
- `on_preempted` (from the scheduler): the preempted request's computed blocks are marked
  for swap-out, so the pool spills them when it reuses them; re-admission restores them
  through `extend_prefix` like any resumed prefix.
- `on_request_added`: the prefix lookup a resumed turn will do, done early; loads of the
  stored chunks after the device hits start in the background (prefetch).
- `extend_prefix` (from the scheduler's admission): after the device-hit blocks, keep walking
  the key chain in the store; each chunk found is loaded (the prefetch, waited for until the
  deadline, else a synchronous load), checked, and written into fresh device blocks that are
  registered in the prefix cache. A missing, corrupt or late chunk ends the restored prefix;
  the rest is recomputed, so a failing tier costs time, never correctness.
- `on_admitted`: the prompt tokens' sources (device / host / disk / remote / recomputed)
  go onto the request's metrics and the connector's counters.
- `on_request_finished`: a session's block keys are remembered, chunked, for the policy
  runner and for eviction-time spills.
- `after_step`: finished background writes are accounted; the policy runner's timer and
  pressure checks (its moves, demotes and deletes are queued on the mover too).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from kvtier.cache.policy_runner import PolicyRunner
from kvtier.cache.writes import BackgroundWrites
from kvtier.engine.request import Request
from kvtier.tiers import Chunk, DiskTier, HostTier, Mover, Payload, RedisTier, Sealer, TieredStore
from kvtier.tiers.base import TierBackend

if TYPE_CHECKING:
    from kvtier.cache.config import TiersConfig
    from kvtier.engine.engine import Engine
    from kvtier.policy.base import RetentionPolicy
    from kvtier.policy.config import PolicyConfig
    from kvtier.tiers.mover import Prefetch

log = logging.getLogger(__name__)

SOURCES = ("device", "host", "disk", "remote", "recomputed")


class _ChunkOf(NamedTuple):
    """The chunk a cached block belongs to, and whether it was marked for swap-out."""

    keys: tuple[bytes, ...]
    namespace: str
    swap: bool = False


class TieredConnector:
    def __init__(self, engine: Engine) -> None:
        config = engine.config
        tiers_config = config.tiers
        assert tiers_config is not None
        self.engine = engine
        self.config = tiers_config
        self.block_pool = engine.block_pool
        self.kv_pool = engine.kv_pool
        self.block_size = config.block_size
        if tiers_config.chunk_tokens % self.block_size:
            from kvtier.errors import KvtierError

            raise KvtierError(
                f"tiers.chunk_tokens={tiers_config.chunk_tokens} must be a multiple of "
                f"block_size={self.block_size}"
            )
        self.blocks_per_chunk = tiers_config.chunk_tokens // self.block_size
        self.bytes_per_block = self.kv_pool.bytes_per_block
        self.store = TieredStore(
            self._build_tiers(),
            block_tokens=self.block_size,
            chunk_tokens=tiers_config.chunk_tokens,
        )
        self.mover = Mover(
            self.store, spill_queue=tiers_config.spill_queue, retries=tiers_config.retries
        )
        self.writes = BackgroundWrites(self.mover, self.store.order[0])
        self.runner = PolicyRunner(self, config.policy, config.policy_config)
        spill = tiers_config.spill_on_evict
        self.spill_on_evict = (
            spill if spill is not None else self.runner.policy_name not in ("retain", "recompute")
        )
        # block key -> its chunk in the latest finished (or preempted) sequence
        self._chunk_of: dict[bytes, _ChunkOf] = {}
        # keys of blocks restored from a tier and not yet counted at an admission -> tier
        self._restored_from: dict[bytes, str] = {}
        self._prefetches: dict[str, tuple[Prefetch, dict[bytes, int]]] = {}
        self._suppress_spill = False
        self._closed = False
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter({source: 0 for source in SOURCES})
        engine.scheduler.connector = self
        engine.add_block_listener(self)

    def _build_tiers(self) -> list[TierBackend]:
        c = self.config
        sealer = None
        if c.encrypt:
            sealer = Sealer(c.encrypt_key or os.urandom(32))
        tiers: list[TierBackend] = []
        if c.host_bytes:
            tiers.append(HostTier(c.host_bytes, slot_bytes=self.bytes_per_block))
        if c.disk_bytes and c.disk_dir is not None:
            tiers.append(DiskTier(c.disk_dir, c.disk_bytes, sealer=sealer))
        if c.redis_url:
            tiers.append(
                RedisTier(
                    c.redis_url,
                    c.redis_bytes,
                    prefix=c.redis_prefix,
                    timeout_s=c.redis_timeout_s,
                    sealer=sealer,
                )
            )
        return tiers

    # ----- chunks --------------------------------------------------------------------------

    @staticmethod
    def namespace_of(request: Request) -> str:
        return request.tenant or "default"

    def chunk_keys(self, keys: list[bytes] | tuple[bytes, ...]) -> list[tuple[bytes, ...]]:
        k = self.blocks_per_chunk
        return [tuple(keys[i : i + k]) for i in range(0, len(keys), k)]

    def locate(self, chunk_id: bytes) -> str | None:
        """The tier a chunk is in, or being written to; None when it is not (or is being
        deleted)."""
        staged = self.writes.staged(chunk_id)
        if staged is not None:
            return staged[1]
        if self.writes.deleting(chunk_id):
            return None
        placement = self.store.locate(chunk_id)
        return placement.tier if placement is not None else None

    def find_stored_chunk(
        self, keys: list[bytes], chunk_index: int, namespace: str, covering: int
    ) -> Chunk | None:
        """The longest stored chunk on the grid at `chunk_index` that covers block `covering`.

        A chunk stored by an earlier, shorter turn holds fewer keys than the grid allows, so
        lengths are tried from the longest down."""
        k = self.blocks_per_chunk
        first = chunk_index * k
        longest = min(k, len(keys) - first)
        for length in range(longest, covering - first, -1):
            chunk = Chunk(tuple(keys[first : first + length]), namespace)
            if self.locate(chunk.id) is not None:
                return chunk
        return None

    def _stored_chain(self, request: Request, start: int) -> list[Chunk]:
        """Stored chunks continuing the prefix from block `start` (no loads)."""
        keys = request.keys_of_full_blocks(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        namespace = self.namespace_of(request)
        chunks = []
        pos = start
        while pos < max_blocks:
            chunk = self.find_stored_chunk(keys, pos // self.blocks_per_chunk, namespace, pos)
            if chunk is None:
                break
            chunks.append(chunk)
            pos = (pos // self.blocks_per_chunk) * self.blocks_per_chunk + len(chunk.keys)
        return chunks

    def gather(self, block_ids: list[int]) -> Payload:
        """The blocks' KV as one contiguous payload ([n, *block_shape], one copy)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_pool.kv.device)
        data = self.kv_pool.kv.index_select(0, index)
        if data.device.type != "cpu":
            data = data.cpu()
        return Payload.of(data)

    # ----- block events --------------------------------------------------------------------

    def on_block_filled(self, block_id: int, key: bytes) -> None:
        pass

    def on_block_freed(self, block_id: int) -> None:
        pass

    def on_block_evicted(self, block_id: int, key: bytes) -> None:
        self._restored_from.pop(key, None)
        info = self._chunk_of.pop(key, None)
        if self._suppress_spill or not (self.spill_on_evict or (info is not None and info.swap)):
            self.counters["evicted_dropped"] += 1
            return
        if info is None:
            self.counters["evicted_unknown"] += 1
            return
        if self.locate(Chunk(info.keys, info.namespace).id) is not None:
            return  # already stored or in flight (an earlier block of the chunk spilled it)
        position = info.keys.index(key)
        ids: list[int] = []
        for chunk_key in info.keys:
            block = self.block_pool.lookup(chunk_key)
            if block is None:
                break
            ids.append(block)
        if len(ids) <= position:
            self.counters["evicted_dropped"] += 1  # a gap before it: unreachable anyway
            return
        chunk = Chunk(info.keys[: len(ids)], info.namespace)
        if self.locate(chunk.id) is not None:
            return
        # The gather is the copy out of the device block, so the pool may reuse the block as
        # soon as this returns; the tier write happens on the mover's worker.
        payload = self.gather(ids)
        kind = "swapped" if info.swap else "spilled"
        blocks = len(ids)

        def done(ok: bool) -> None:
            if ok:
                self.counters[f"{kind}_chunks"] += 1
                self.counters[f"{kind}_blocks"] += blocks
                self.counters[f"{kind}_bytes"] += payload.nbytes
            else:
                self.counters["spill_failures"] += 1  # dropped (queue full) or failed

        self.writes.put(chunk, payload, None, done)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every queued background write; False if some are still running after
        `timeout`. Serving never needs this (reads see writes in flight); tests and
        benchmarks use it to measure a settled state."""
        return self.writes.flush(timeout)

    def drop_device_blocks(self, keys: tuple[bytes, ...] | list[bytes]) -> int:
        """Evict these keys' idle device blocks without spilling them (a policy decided)."""
        ids = [b for b in (self.block_pool.lookup(k) for k in keys) if b is not None]
        self._suppress_spill = True
        try:
            return self.block_pool.drop_cached(ids)
        finally:
            self._suppress_spill = False

    # ----- requests ------------------------------------------------------------------------

    def on_request_added(self, request: Request) -> None:
        if not self.config.prefetch or self.config.restore == "recompute" or not len(self.store):
            return  # (chunks only staged are read from their bytes at admission)
        start = len(self.engine.kv_manager.find_cached_prefix(request))
        # chunks still being written are read from their staged bytes, not prefetched
        ids = [
            chunk.id
            for chunk in self._stored_chain(request, start)
            if self.writes.staged(chunk.id) is None
        ]
        if not ids:
            return
        handle = self.mover.prefetch(ids)
        self._prefetches[request.request_id] = (handle, {cid: i for i, cid in enumerate(ids)})
        self.counters["prefetched_chunks"] += len(ids)

    def extend_prefix(self, request: Request, cached: list[int]) -> list[int]:
        """Device-hit blocks `cached`, extended with blocks restored from the tiers."""
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        start = len(cached)
        if start >= max_blocks or self.config.restore == "recompute" or not self._anything_stored():
            return cached
        chunks = self._stored_chain(request, start)
        if not chunks or (
            self.config.restore == "plan" and not self._plan_says_load(chunks, start)
        ):
            self._forget_prefetch(request.request_id)
            return cached
        deadline = _now() + self.config.restore_deadline_s
        keys = request.keys_of_full_blocks(bs)
        pool = self.block_pool
        pool.touch(cached)  # the device hits must survive the allocations below
        restored: list[int] = []
        try:
            pos = start
            for chunk in chunks:
                first = (pos // self.blocks_per_chunk) * self.blocks_per_chunk
                end = min(first + len(chunk.keys), max_blocks)
                need = end - pos
                if need <= 0 or need > pool.num_allocatable:
                    break
                payload, tier = self._load(request.request_id, chunk, deadline)
                tensor = self._check(payload, len(chunk.keys))
                if tensor is None or tier is None:
                    self.counters["restore_failures"] += 1
                    break
                ids = pool.allocate(need)
                restored.extend(ids)
                for j, block_id in zip(range(pos, end), ids, strict=True):
                    with torch.inference_mode():
                        self.kv_pool.kv[block_id].copy_(tensor[j - first])
                    if pool.cache_block(block_id, keys[j]):
                        self._restored_from[keys[j]] = tier
                self.counters["restored_chunks"] += 1
                self.counters["restored_blocks"] += need
                self.counters[f"restored_blocks_{tier}"] += need
                pos = end
                if pos < first + self.blocks_per_chunk:
                    break  # a short chunk ends what is stored on this grid
        finally:
            pool.release(restored[::-1])
            pool.release(cached[::-1])
            self._forget_prefetch(request.request_id)
        if not restored:
            return cached
        return self.engine.kv_manager.find_cached_prefix(request)

    def _anything_stored(self) -> bool:
        return bool(len(self.store)) or self.writes.staging

    def _plan_says_load(self, chunks: list[Chunk], start: int) -> bool:
        from kvtier.policy.restore import plan_restore
        from kvtier.policy.view import ChunkView

        views = []
        pos = start
        for chunk in chunks:
            first = (pos // self.blocks_per_chunk) * self.blocks_per_chunk
            end = first + len(chunk.keys)
            views.append(
                ChunkView(
                    index=first // self.blocks_per_chunk,
                    token_start=pos * self.block_size,
                    token_end=end * self.block_size,
                    tier=self.locate(chunk.id),
                    size_bytes=len(chunk.keys) * self.bytes_per_block,
                )
            )
            pos = end
        plan = plan_restore(views, self.runner.cost_model)
        self.counters[f"restore_plan_{plan.kind}"] += 1
        return plan.kind != "recompute"

    def _load(
        self, request_id: str, chunk: Chunk, deadline: float
    ) -> tuple[Payload | None, str | None]:
        """The chunk's payload and the tier it counts as restored from.

        In order: its prefetch (waited for until the deadline), the staged bytes of a write
        still in flight (no waiting for the tier), a load now (retried `retries` times)."""
        prefetch = self._prefetches.get(request_id)
        if prefetch is not None and chunk.id in prefetch[1]:
            handle, index = prefetch
            placement = self.store.locate(chunk.id)
            results = handle.result(timeout=max(0.0, deadline - _now()))
            payload = results[index[chunk.id]]
            if payload is None and not handle.done():
                self.counters["restore_late"] += 1
            if payload is not None:
                self.counters["restored_chunks_prefetched"] += 1
            return payload, placement.tier if placement is not None else None
        staged = self.writes.staged(chunk.id)
        if staged is not None:
            self.counters["restored_chunks_staged"] += 1
            return staged
        placement = self.store.locate(chunk.id)
        if placement is None:
            return None, None
        return self.store.promote(chunk.id, attempts=1 + self.config.retries), placement.tier

    def _check(self, payload: Payload | None, num_blocks: int) -> torch.Tensor | None:
        """The payload as [num_blocks, *block_shape] in the pool's dtype, or None."""
        if payload is None or payload.data is None or payload.form != "full":
            return None
        expected = (num_blocks, *self.kv_pool.block_shape)
        dtype = str(self.kv_pool.dtype).removeprefix("torch.")
        if tuple(payload.shape) != expected or payload.dtype != dtype:
            return None
        try:
            return payload.tensor().to(self.kv_pool.kv.device)
        except (ValueError, RuntimeError):
            return None

    def _forget_prefetch(self, request_id: str) -> None:
        prefetch = self._prefetches.pop(request_id, None)
        if prefetch is not None:
            prefetch[0].cancel()

    def on_admitted(self, request: Request) -> None:
        cached_blocks = (request.num_cached_tokens or 0) // self.block_size
        sources: Counter[str] = Counter()
        for key in request.block_keys[:cached_blocks]:
            sources[self._restored_from.pop(key, "device")] += self.block_size
        sources["recomputed"] = request.num_prompt_tokens - cached_blocks * self.block_size
        request.metrics.prompt_token_sources = {s: sources.get(s, 0) for s in SOURCES}
        self.tokens.update(sources)

    def on_request_finished(self, request: Request) -> None:
        self._forget_prefetch(request.request_id)
        keys = self._remember_chunks(request, swap=False)
        if keys and request.session_id is not None:
            self.runner.remember_session(
                request.session_id, tuple(keys), self.namespace_of(request)
            )

    def on_preempted(self, request: Request) -> None:
        """Called by the scheduler before it releases a preempted request's blocks: with
        `swap_on_preempt` they are spilled when the pool reuses them (swap-out), whatever
        the policy, and come back through `extend_prefix` at re-admission."""
        if self.config.swap_on_preempt:
            self._remember_chunks(request, swap=True)
            self.counters["preempted_requests"] += 1

    def _remember_chunks(self, request: Request, swap: bool) -> list[bytes]:
        """Map each computed full block's key to its chunk; returns those keys."""
        num_full = request.num_computed_tokens // self.block_size
        keys = request.keys_of_full_blocks(self.block_size)[:num_full]
        namespace = self.namespace_of(request)
        for chunk in self.chunk_keys(keys):
            for key in chunk:
                self._chunk_of[key] = _ChunkOf(chunk, namespace, swap)
        return keys

    def after_step(self) -> None:
        self.writes.reap()
        self.runner.after_step()

    # ----- reporting -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        self.writes.reap()
        snapshot = self.store.snapshot()
        tiers = {
            name: {
                key: tier[key]
                for key in (
                    "used_bytes",
                    "capacity_bytes",
                    "chunks",
                    "bytes_read",
                    "bytes_written",
                    "hits",
                    "misses",
                    "errors",
                )
                if key in tier
            }
            for name, tier in snapshot["tiers"].items()
        }
        moves = {
            name: {"ops": move["ops"], "bytes": move["bytes"], "failures": move["failures"]}
            for name, move in snapshot["moves"].items()
        }
        return {
            "policy": self.runner.policy_name,
            "tokens": dict(self.tokens),
            "decisions": dict(self.runner.decisions),
            "policy_runs": dict(self.runner.runs),
            "counters": dict(self.counters),
            "tiers": tiers,
            "moves": moves,
            "mover": {**self.mover.counts, "writes_in_flight": self.writes.in_flight},
        }

    def num_restore_errors(self) -> int:
        return sum(t.stats.errors for t in self.store.tiers.values())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.mover.close(drain=False, timeout=1.0)
        for tier in self.store.tiers.values():
            try:
                tier.close()
            except Exception:  # closing must not mask the caller's own error
                log.exception("closing tier %s failed", tier.name)


def _now() -> float:
    return time.monotonic()


def attach_connector(
    engine: Engine,
    tiers: TiersConfig | None,
    policy: str | RetentionPolicy = "retain",
    policy_config: PolicyConfig | None = None,
) -> TieredConnector | None:
    """Give an existing engine a fresh connector (or none), replacing the one it has.

    The engine's prefix cache is reset first, so no device block outlives the tiers it was
    spilled to. Benchmarks and tests use this to compare setups on one loaded model."""
    with engine.exclusive():
        if engine.has_unfinished_requests():
            raise RuntimeError("attach_connector needs an idle engine")
        old = engine.connector
        if old is not None:
            engine.remove_block_listener(old)
            old.close()
        engine.scheduler.connector = None
        engine.connector = None
        engine.block_pool.reset_prefix_cache()
        engine.config.tiers = tiers
        engine.config.policy = policy
        engine.config.policy_config = policy_config
        if tiers is not None:
            engine.connector = TieredConnector(engine)
        return engine.connector
