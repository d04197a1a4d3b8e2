"""TieredConnector: the engine's device blocks moving through host / disk / remote tiers.

In the spirit of vLLM's KV connector, the engine calls it at fixed points:

- `on_block_evicted` (a BlockEventListener): the pool is about to reuse an idle cached block.
  When spilling is on, the block's whole chunk (`chunk_tokens` of one sequence, on the fixed
  grid from its first block) is copied out as one payload into the top tier, unless the store
  already has it; the other blocks of the chunk stay on device and later evictions find the
  chunk stored. With spilling off (`retain`, `recompute`) the block is simply dropped.
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
- `after_step`: the policy runner's timer and pressure checks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from kvtier.cache.policy_runner import PolicyRunner
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
        self.mover = Mover(self.store, retries=0) if tiers_config.prefetch else None
        self.runner = PolicyRunner(self, config.policy, config.policy_config)
        spill = tiers_config.spill_on_evict
        self.spill_on_evict = (
            spill if spill is not None else self.runner.policy_name not in ("retain", "recompute")
        )
        # block key -> (the chunk's block keys, namespace) of the latest finished sequence
        self._chunk_of: dict[bytes, tuple[tuple[bytes, ...], str]] = {}
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
            if self.store.locate(chunk.id) is not None:
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
        if self._suppress_spill or not self.spill_on_evict:
            self.counters["evicted_dropped"] += 1
            return
        if info is None:
            self.counters["evicted_unknown"] += 1
            return
        keys, namespace = info
        if self.store.locate(Chunk(keys, namespace).id) is not None:
            return  # already stored (an earlier block of the chunk spilled it)
        position = keys.index(key)
        ids: list[int] = []
        for chunk_key in keys:
            block = self.block_pool.lookup(chunk_key)
            if block is None:
                break
            ids.append(block)
        if len(ids) <= position:
            self.counters["evicted_dropped"] += 1  # a gap before it: unreachable anyway
            return
        chunk = Chunk(keys[: len(ids)], namespace)
        if self.store.locate(chunk.id) is not None:
            return
        payload = self.gather(ids)
        if self.store.put(chunk, payload):
            self.counters["spilled_chunks"] += 1
            self.counters["spilled_blocks"] += len(ids)
            self.counters["spilled_bytes"] += payload.nbytes
        else:
            self.counters["spill_failures"] += 1

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
        if self.mover is None or self.config.restore == "recompute" or not len(self.store):
            return
        start = len(self.engine.kv_manager.find_cached_prefix(request))
        chunks = self._stored_chain(request, start)
        if not chunks:
            return
        ids = [chunk.id for chunk in chunks]
        handle = self.mover.prefetch(ids)
        self._prefetches[request.request_id] = (handle, {cid: i for i, cid in enumerate(ids)})
        self.counters["prefetched_chunks"] += len(ids)

    def extend_prefix(self, request: Request, cached: list[int]) -> list[int]:
        """Device-hit blocks `cached`, extended with blocks restored from the tiers."""
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        start = len(cached)
        if start >= max_blocks or self.config.restore == "recompute" or not len(self.store):
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
                placement = self.store.locate(chunk.id)
                payload = self._load(request.request_id, chunk, deadline)
                tensor = self._check(payload, len(chunk.keys))
                if tensor is None or placement is None:
                    self.counters["restore_failures"] += 1
                    break
                ids = pool.allocate(need)
                restored.extend(ids)
                for j, block_id in zip(range(pos, end), ids, strict=True):
                    with torch.inference_mode():
                        self.kv_pool.kv[block_id].copy_(tensor[j - first])
                    if pool.cache_block(block_id, keys[j]):
                        self._restored_from[keys[j]] = placement.tier
                self.counters["restored_chunks"] += 1
                self.counters["restored_blocks"] += need
                self.counters[f"restored_blocks_{placement.tier}"] += need
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

    def _plan_says_load(self, chunks: list[Chunk], start: int) -> bool:
        from kvtier.policy.restore import plan_restore
        from kvtier.policy.view import ChunkView

        views = []
        pos = start
        for chunk in chunks:
            first = (pos // self.blocks_per_chunk) * self.blocks_per_chunk
            placement = self.store.locate(chunk.id)
            end = first + len(chunk.keys)
            views.append(
                ChunkView(
                    index=first // self.blocks_per_chunk,
                    token_start=pos * self.block_size,
                    token_end=end * self.block_size,
                    tier=placement.tier if placement else None,
                    size_bytes=placement.nbytes if placement else 0,
                )
            )
            pos = end
        plan = plan_restore(views, self.runner.cost_model)
        self.counters[f"restore_plan_{plan.kind}"] += 1
        return plan.kind != "recompute"

    def _load(self, request_id: str, chunk: Chunk, deadline: float) -> Payload | None:
        prefetch = self._prefetches.get(request_id)
        if prefetch is not None and chunk.id in prefetch[1]:
            handle, index = prefetch
            results = handle.result(timeout=max(0.0, deadline - _now()))
            payload = results[index[chunk.id]]
            if payload is None and not handle.done():
                self.counters["restore_late"] += 1
            return payload
        return self.store.promote(chunk.id)

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
        num_full = request.num_computed_tokens // self.block_size
        if num_full == 0:
            return
        keys = request.keys_of_full_blocks(self.block_size)[:num_full]
        namespace = self.namespace_of(request)
        for chunk in self.chunk_keys(keys):
            for key in chunk:
                self._chunk_of[key] = (chunk, namespace)
        if request.session_id is not None:
            self.runner.remember_session(request.session_id, tuple(keys), namespace)

    def after_step(self) -> None:
        self.runner.after_step()

    # ----- reporting -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
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
            "mover": dict(self.mover.counts) if self.mover else {},
        }

    def num_restore_errors(self) -> int:
        return sum(t.stats.errors for t in self.store.tiers.values())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.mover is not None:
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
    with engine._lock:
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
