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
- `extend_prefix` (from the scheduler's admission): after the device-hit blocks, the stored
  chunks the restore will load (all, or the restore plan's) are found; those continuing the
  prefix are loaded now (the prefetch, waited for until the deadline, else a synchronous
  load), checked, and written into fresh device blocks registered in the prefix cache.
  Chunks after a recomputed run (a hole, the front of a bidirectional plan) stay pending.
- `restore_boundary` / `continue_restore` (from the scheduler, each step): the prefill stops
  where the next pending load starts; the load then fills the blocks after it. A missing,
  corrupt or late chunk is recomputed, so a failing tier costs time, never correctness.
- `on_admitted`: the prompt tokens' sources (device / host / disk / remote / recomputed)
  go onto the request's metrics and the connector's counters.
- `on_request_finished`: a session's block keys are remembered, chunked, for the policy
  runner and for eviction-time spills; with `write_through`, its full chunks no tier holds
  are gathered and queued for the top tier now, so evicting them later costs no copy.
- `after_step`: finished background writes are accounted; the policy runner's timer and
  pressure checks (its moves, demotes and deletes are queued on the mover too).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from kvtier.cache.forms import FULL, ChunkForms, Restored, lossiest
from kvtier.cache.policy_runner import PolicyRunner
from kvtier.cache.writes import BackgroundWrites
from kvtier.engine.hooks import BlockEventListener
from kvtier.engine.request import Request
from kvtier.tiers import (
    Chunk,
    DiskTier,
    HostTier,
    Mover,
    Payload,
    RedisTier,
    Sealer,
    Signer,
    TieredStore,
)
from kvtier.tiers.base import TierBackend
from kvtier.tiers.payload import aligned_bytes
from kvtier.tiers.record import PAGE_BYTES

if TYPE_CHECKING:
    from kvtier.cache.config import TiersConfig
    from kvtier.engine.engine import Engine
    from kvtier.policy.base import RetentionPolicy
    from kvtier.policy.config import PolicyConfig
    from kvtier.policy.restore import RestorePlan
    from kvtier.tiers.mover import Prefetch

log = logging.getLogger(__name__)

SOURCES = ("device", "host", "disk", "remote", "recomputed")


class _ChunkOf(NamedTuple):
    """The chunk a cached block belongs to, and whether it was marked for swap-out."""

    keys: tuple[bytes, ...]
    namespace: str
    swap: bool = False


class TieredConnector(BlockEventListener):
    def __init__(self, engine: Engine) -> None:
        config = engine.config
        tiers_config = config.tiers
        assert tiers_config is not None
        if getattr(config, "kv_quant", None) is not None:
            from kvtier.errors import KvtierError

            # a packed pool's blocks are quantized already; chunks here are gathered and
            # restored as full-precision blocks (EngineConfig refuses the same combination)
            raise KvtierError(
                "kv_quant with tiers is not supported yet: the tiered connector copies "
                "full-precision blocks; use kv_quant=None with tiers"
            )
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
        self.chunk_forms = ChunkForms(self.kv_pool.block_shape, self.kv_pool.dtype)
        tiers = self._build_tiers()
        # tier -> the quantized form its chunks are stored in (the worker encodes on the way in)
        self.tier_forms = {
            tier.name: form
            for tier in tiers
            if (form := tiers_config.tier_forms()[tier.name]) != FULL
        }
        self.store = TieredStore(
            tiers,
            block_tokens=self.block_size,
            chunk_tokens=tiers_config.chunk_tokens,
            forms=self.tier_forms,
            recode=self.chunk_forms.recode,
        )
        self.store.recover()  # what a persistent disk tier and Redis kept from earlier runs
        self.mover = Mover(
            self.store, spill_queue=tiers_config.spill_queue, retries=tiers_config.retries
        )
        self.writes = BackgroundWrites(self.mover, self.store.order[0])
        self.runner = PolicyRunner(self, config.policy, config.policy_config)
        spill = tiers_config.spill_on_evict
        self.spill_on_evict = (
            spill if spill is not None else self.runner.policy_name not in ("retain", "recompute")
        )
        self.write_through = tiers_config.write_through and self.spill_on_evict
        # block key -> its chunk in the latest finished (or preempted) sequence
        self._chunk_of: dict[bytes, _ChunkOf] = {}
        # keys of blocks restored from a tier and not yet counted at an admission -> tier
        self._restored_from: dict[bytes, str] = {}
        self._prefetches: dict[str, tuple[Prefetch, dict[bytes, int]]] = {}
        # request id -> loads after a recomputed run, (chunk, first block, end block)
        self._pending: dict[str, list[tuple[Chunk, int, int]]] = {}
        self._suppress_spill = False
        self._closed = False
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter({source: 0 for source in SOURCES})
        engine.scheduler.connector = self
        engine.add_block_listener(self)

    def _build_tiers(self) -> list[TierBackend]:
        c = self.config
        remote = c.remote_integrity()
        master = c.encrypt_key or os.urandom(32)
        sealer = Sealer(master) if c.encrypt or remote == "encrypt" else None
        tiers: list[TierBackend] = []
        if c.host_bytes:
            # a slot per block in the host's form, so a chunk of whole blocks wastes nothing
            slot = self.chunk_forms.nbytes(1, c.tier_forms()["host"])
            tiers.append(HostTier(c.host_bytes, slot_bytes=slot))
        if c.disk_bytes and c.disk_dir is not None:
            tiers.append(
                DiskTier(
                    c.disk_dir,
                    c.disk_bytes,
                    sealer=sealer if c.encrypt else None,
                    persist=c.disk_persist,
                )
            )
        if c.redis_url:
            tiers.append(
                RedisTier(
                    c.redis_url,
                    c.redis_bytes,
                    prefix=c.redis_prefix,
                    timeout_s=c.redis_timeout_s,
                    cluster=c.redis_cluster,
                    sealer=sealer if remote == "encrypt" else None,
                    signer=Signer(master) if remote == "mac" else None,
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
        where = self.locate_form(chunk_id)
        return where[0] if where is not None else None

    def locate_form(self, chunk_id: bytes) -> tuple[str, str] | None:
        """(tier, form) of a chunk stored or being written (the form it will have there)."""
        staged = self.writes.staged(chunk_id)
        if staged is not None:
            return staged.tier, lossiest(staged.form, self.tier_forms.get(staged.tier, FULL))
        if self.writes.deleting(chunk_id):
            return None
        placement = self.store.locate(chunk_id)
        return (placement.tier, placement.form) if placement is not None else None

    def form_of(self, block_ids: list[int]) -> str:
        """The least precise form among these device blocks (restored ones keep theirs)."""
        return lossiest(*(self.block_pool.forms[b] for b in block_ids))

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

    def gather(self, block_ids: list[int]) -> Payload:
        """The blocks' KV as one contiguous payload ([n, *block_shape], one copy).

        On CPU the copy lands in page-aligned memory: torch's own large tensors start 64
        bytes into a page, which would send every spill to an O_DIRECT disk tier through a
        bounce copy (docs/tiers.md)."""
        kv = self.kv_pool.kv
        index = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
        if kv.device.type != "cpu":
            return Payload.of(kv.index_select(0, index).cpu())
        shape = (len(block_ids), *kv.shape[1:])
        nbytes = math.prod(shape) * kv.element_size()
        staging = aligned_bytes(nbytes, PAGE_BYTES).view(kv.dtype).view(shape)
        torch.index_select(kv, 0, index, out=staging)
        return Payload.of(staging)

    # ----- block events --------------------------------------------------------------------

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
        form = self.form_of(ids)
        kind = "swapped" if info.swap else "spilled"
        blocks = len(ids)

        def done(ok: bool) -> None:
            if ok:
                self.counters[f"{kind}_chunks"] += 1
                self.counters[f"{kind}_blocks"] += blocks
                self.counters[f"{kind}_bytes"] += payload.nbytes
            else:
                self.counters["spill_failures"] += 1  # dropped (queue full) or failed

        self.writes.put(chunk, payload, None, done, form)

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
        # chunks of this prompt another replica (or an earlier run) put in a shared tier
        max_blocks = (request.num_tokens - 1) // self.block_size
        self.store.discover(
            request.keys_of_full_blocks(self.block_size)[:max_blocks],
            self.namespace_of(request),
            len(self.engine.kv_manager.find_cached_prefix(request)),
        )
        if not self.config.prefetch or self.config.restore == "recompute" or not len(self.store):
            return  # (chunks only staged are read from their bytes at admission)
        start = len(self.engine.kv_manager.find_cached_prefix(request))
        # chunks still being written are read from their staged bytes, not prefetched
        ids = [
            chunk.id
            for chunk, _, _ in self._restore_loads(request, start, for_prefetch=True)
            if self.writes.staged(chunk.id) is None
        ]
        if not ids:
            return
        # decoding a quantized chunk runs on the prefetch worker too
        handle = self.mover.prefetch(ids, then=self._restore)
        self._prefetches[request.request_id] = (handle, {cid: i for i, cid in enumerate(ids)})
        self.counters["prefetched_chunks"] += len(ids)

    def extend_prefix(self, request: Request, cached: list[int]) -> list[int]:
        """Device-hit blocks `cached`, extended with blocks restored from the tiers.

        Only the loads that continue the prefix happen here; loads after a run of blocks the
        plan recomputes (a hole, or the front of a bidirectional plan) wait in `_pending`
        until the prefill reaches them (`continue_restore`)."""
        self._pending.pop(request.request_id, None)
        max_blocks = (request.num_tokens - 1) // self.block_size
        start = len(cached)
        if start >= max_blocks or self.config.restore == "recompute":
            return cached
        loads = self._restore_loads(request, start)
        leading = []  # the loads that continue the prefix without a gap
        while loads and loads[0][1] == (leading[-1][2] if leading else start):
            leading.append(loads.pop(0))
        if loads:
            self._pending[request.request_id] = loads
        if not leading:
            if not loads:
                self._forget_prefetch(request.request_id)
            return cached
        pool = self.block_pool
        pool.touch(cached)  # the device hits must survive the allocations below
        restored: list[int] = []
        try:
            for i, (chunk, first, end) in enumerate(leading):
                ids = self._restore_chunk(request, chunk, first, end)
                if ids is None:  # recompute it; what follows waits for the prefill
                    loads[:0] = leading[i + 1 :]
                    if loads:
                        self._pending[request.request_id] = loads
                    break
                restored.extend(ids)
        finally:
            pool.release(restored[::-1])
            pool.release(cached[::-1])
            if request.request_id not in self._pending:
                self._forget_prefetch(request.request_id)
        if not restored:
            return cached
        return self.engine.kv_manager.find_cached_prefix(request)

    def restore_boundary(self, request: Request) -> int | None:
        """Token position where the request's next pending load starts: its prefill must stop
        there so the load, not the model, fills what follows."""
        pending = self._pending.get(request.request_id)
        return pending[0][1] * self.block_size if pending else None

    def continue_restore(self, request: Request) -> None:
        """Load the pending chunks that start where the request's prefill has got to, into
        fresh blocks appended to its block table, and move its `num_computed_tokens` past
        them. A failed load is skipped: its blocks are recomputed, and the loads after it
        wait for the prefill again."""
        pending = self._pending.get(request.request_id)
        if not pending:
            return
        bs = self.block_size
        kv = self.engine.kv_manager
        while pending and pending[0][1] * bs == request.num_computed_tokens:
            chunk, first, end = pending.pop(0)
            ids = self._restore_chunk(request, chunk, first, end)
            if ids is None:
                continue  # recompute this chunk; the boundary moves to the next load
            if not kv.append_computed(request, ids):
                self.block_pool.release(ids[::-1])
                break
            request.num_computed_tokens += len(ids) * bs
            self._count_late_restore(request, first, end)
        while pending and pending[0][1] * bs < request.num_computed_tokens:
            pending.pop(0)  # the prefill went past it (an allocation failed): recomputed
        if not pending:
            self._pending.pop(request.request_id, None)
            self._forget_prefetch(request.request_id)

    def _count_late_restore(self, request: Request, first: int, end: int) -> None:
        """Move restored blocks [first, end) from `recomputed` to their tier in the request's
        sources (set at admission, before these loads happened)."""
        keys = request.keys_of_full_blocks(self.block_size)[first:end]
        tiers = Counter(self._restored_from.pop(key, "device") for key in keys)
        sources = request.metrics.prompt_token_sources
        for tier, blocks in tiers.items():
            n = blocks * self.block_size
            if sources is not None and sources.get("recomputed", 0) >= n:
                sources[tier] = sources.get(tier, 0) + n
                sources["recomputed"] -= n
                self.tokens[tier] += n
                self.tokens["recomputed"] -= n
        self.counters["restored_blocks_after_recompute"] += end - first

    def _restore_chunk(
        self, request: Request, chunk: Chunk | None, first: int, end: int
    ) -> list[int] | None:
        """Blocks [first, end) of the request from `chunk`, loaded into fresh device blocks
        registered in the prefix cache (held by the caller), or None when the load failed.
        `chunk=None`: the blocks are cached on the device; they are taken as they are, or
        None if the pool evicted one of them since."""
        pool = self.block_pool
        if chunk is None:
            keys = request.keys_of_full_blocks(self.block_size)[first:end]
            ids = [pool.lookup(key) for key in keys]
            if any(block is None for block in ids):
                self.counters["device_blocks_evicted_before_reuse"] += 1
                return None
            pool.touch(ids)
            self.counters["reused_device_blocks_after_recompute"] += len(ids)
            return ids
        need = end - first
        if need <= 0 or need > pool.num_allocatable:
            return None
        deadline = _now() + self.config.restore_deadline_s
        loaded, tier = self._load(request.request_id, chunk, deadline)
        if loaded is None or tier is None or loaded.blocks.shape[0] != len(chunk.keys):
            self.counters["restore_failures"] += 1
            return None
        keys = request.keys_of_full_blocks(self.block_size)
        grid = (first // self.blocks_per_chunk) * self.blocks_per_chunk
        blocks = loaded.blocks.to(self.kv_pool.kv.device)
        ids = pool.allocate(need)
        for j, block_id in zip(range(first, end), ids, strict=True):
            with torch.inference_mode():
                self.kv_pool.kv[block_id].copy_(blocks[j - grid])
            pool.set_form(block_id, loaded.form)  # a block restored lossy is never "exact"
            if pool.cache_block(block_id, keys[j]):
                self._restored_from[keys[j]] = tier
        self.counters["restored_chunks"] += 1
        self.counters["restored_blocks"] += need
        self.counters[f"restored_blocks_{tier}"] += need
        if loaded.form != FULL:
            self.counters[f"restored_blocks_{loaded.form}"] += need
        return ids

    def _restore_loads(
        self, request: Request, start: int, for_prefetch: bool = False
    ) -> list[tuple[Chunk | None, int, int]]:
        """The stored chunks after block `start` that the request will load, as (chunk, first
        block, end block), in prompt order; for a prefetch, in the plan's issue order (a
        bidirectional plan loads back to front: the chunks next to the recomputed front are
        needed last). Chunks still cached on the device after a run the prefill recomputes
        come as (None, first, end), except for a prefetch: they are taken, not loaded.

        `restore="load"` loads every stored chunk; runs of blocks stored nowhere (holes) are
        recomputed and the loads after them go on. `restore="plan"` follows the restore
        planner (`policy.restore`): the front it recomputes while the back loads."""
        keys = request.keys_of_full_blocks(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        namespace = self.namespace_of(request)
        k = self.blocks_per_chunk
        found: list[tuple[Chunk | None, int, int]] = []
        runs: list[tuple[int, int, str | None]] = []  # every run of blocks and its tier
        # an empty store is the common case under retain and recompute: no hashing then
        stored = bool(len(self.store)) or self.writes.staging
        pos = start
        while pos < max_blocks:
            grid_end = min((pos // k + 1) * k, max_blocks)
            chunk = self.find_stored_chunk(keys, pos // k, namespace, pos) if stored else None
            cached = 0 if chunk is not None else self._cached_run(keys[pos:grid_end])
            if cached:
                # cached on the device after a run the prefill recomputes (the prefix
                # lookup stopped before it): taken as they are when the prefill gets there
                runs.append((pos, pos + cached, "device"))
                found.append((None, pos, pos + cached))
                if pos + cached < grid_end:
                    runs.append((pos + cached, grid_end, None))
                pos = grid_end
                continue
            end = grid_end if chunk is None else min((pos // k) * k + len(chunk.keys), grid_end)
            runs.append((pos, end, None if chunk is None else self.locate(chunk.id)))
            if chunk is not None:
                found.append((chunk, pos, end))
                if end < grid_end:
                    runs.append((end, grid_end, None))  # a short chunk: the rest is a hole
            pos = grid_end
        if for_prefetch:
            found = [entry for entry in found if entry[0] is not None]
        if not any(chunk for chunk, _, _ in found) or self.config.restore != "plan":
            return found
        plan = self._plan(runs, count=not for_prefetch)
        chosen = {runs[i][0]: i for i in plan.loads}
        loads = [entry for entry in found if entry[0] is None or entry[1] in chosen]
        if for_prefetch:
            loads.sort(key=lambda entry: plan.loads.index(chosen[entry[1]]))
        return loads

    def _cached_run(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, name blocks cached on the device."""
        count = 0
        while count < len(keys) and self.block_pool.lookup(keys[count]) is not None:
            count += 1
        return count

    def _plan(self, runs: list[tuple[int, int, str | None]], count: bool) -> RestorePlan:
        from kvtier.policy.restore import plan_restore
        from kvtier.policy.view import ChunkView

        bs = self.block_size
        views = [
            ChunkView(
                index=i,
                token_start=first * bs,
                token_end=end * bs,
                tier=tier,
                size_bytes=(end - first) * self.bytes_per_block,
            )
            for i, (first, end, tier) in enumerate(runs)
        ]
        plan = plan_restore(views, self.runner.cost_model)
        if count:
            self.counters[f"restore_plan_{plan.kind}"] += 1
        return plan

    def _load(
        self, request_id: str, chunk: Chunk, deadline: float
    ) -> tuple[Restored | None, str | None]:
        """The chunk in the pool's dtype and the form it was stored in (None: missing,
        corrupt, not this pool's blocks, or late), and the tier it counts as restored from.

        In order: its prefetch (waited for until the deadline; decoded on the worker), the
        staged bytes of a write still in flight (no waiting for the tier), a load now
        (retried `retries` times)."""
        prefetch = self._prefetches.get(request_id)
        if prefetch is not None and chunk.id in prefetch[1]:
            handle, index = prefetch
            placement = self.store.locate(chunk.id)
            loaded, finished = handle.entry(index[chunk.id], max(0.0, deadline - _now()))
            if loaded is None and not finished:
                self.counters["restore_late"] += 1
            if loaded is not None:
                self.counters["restored_chunks_prefetched"] += 1
            return loaded, placement.tier if placement is not None else None
        staged = self.writes.staged(chunk.id)
        if staged is not None:
            self.counters["restored_chunks_staged"] += 1
            loaded = self._restore(staged.payload)
            return (loaded._replace(form=staged.form) if loaded else None), staged.tier
        placement = self.store.locate(chunk.id)
        if placement is None:
            return None, None
        payload = self.store.promote(chunk.id, attempts=1 + self.config.retries)
        return self._restore(payload), placement.tier

    def _restore(self, payload: Payload | None) -> Restored | None:
        """`ChunkForms.restore`, with bytes that do not decode counted as a miss."""
        try:
            return self.chunk_forms.restore(payload)
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
        self._pending.pop(request.request_id, None)
        self._forget_prefetch(request.request_id)
        keys = self._remember_chunks(request, swap=False)
        if self.write_through:
            self._write_through(keys, self.namespace_of(request))
        if keys and request.session_id is not None:
            self.runner.remember_session(
                request.session_id, tuple(keys), self.namespace_of(request)
            )

    def _write_through(self, keys: list[bytes], namespace: str) -> None:
        """Queue each full chunk of a finished request that no tier holds (nor is being
        written) for the top tier, its device blocks staying cached. The partial tail chunk
        is left: the next turn extends it into a chunk with another id. A chunk restored from
        a tier this turn is found there and not written again."""
        for chunk_keys in self.chunk_keys(keys):
            chunk = Chunk(chunk_keys, namespace)
            if len(chunk_keys) < self.blocks_per_chunk or self.locate(chunk.id) is not None:
                continue
            ids = [b for b in map(self.block_pool.lookup, chunk_keys) if b is not None]
            if len(ids) < len(chunk_keys):
                continue  # some block was never cached: no whole chunk to copy
            payload = self.gather(ids)

            def done(ok: bool, nbytes: int = payload.nbytes) -> None:
                if ok:
                    self.counters["written_through_chunks"] += 1
                    self.counters["written_through_bytes"] += nbytes
                else:
                    self.counters["write_through_failures"] += 1  # queue full, or failed

            self.writes.put(chunk, payload, None, done, self.form_of(ids))

    def on_preempted(self, request: Request) -> None:
        """Called by the scheduler before it releases a preempted request's blocks: with
        `swap_on_preempt` they are spilled when the pool reuses them (swap-out), whatever
        the policy, and come back through `extend_prefix` at re-admission."""
        self._pending.pop(request.request_id, None)  # re-planned at re-admission
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
        recodes = {
            name: {"ops": r["ops"], "bytes_in": r["bytes"], "seconds": r["latency"]["sum_s"]}
            for name, r in snapshot["recodes"].items()
        }
        return {
            "policy": self.runner.policy_name,
            "tokens": dict(self.tokens),
            "decisions": dict(self.runner.decisions),
            "policy_runs": dict(self.runner.runs),
            "counters": dict(self.counters),
            "tiers": tiers,
            "moves": moves,
            "forms": dict(self.tier_forms),
            "recodes": recodes,
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
