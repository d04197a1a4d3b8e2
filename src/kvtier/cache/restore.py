"""Restorer: a resumed prompt's stored chunks found, planned, prefetched and loaded.

The scheduler side of the connector contract (`kvtier.engine.connector`), for loads:

- `on_request_added` (request queued): what shared tiers hold is indexed, and the loads the
  restore will do start in the background (prefetch).
- `loadable` (admission, or the prefill reaching a boundary): the request's plan, made once
  from where its device hits end: the stored chunks after them (`restore="load"`: every one;
  `"plan"`: the restore planner's choice, `kvtier.policy.restore`), runs of blocks stored
  nowhere (holes, recomputed), and runs still cached on the device after a hole (taken as they
  are by the scheduler's prefix lookup there). The chunks that continue the prefix without a
  gap are promised; the scheduler allocates their blocks.
- `next_position`: where the prefill must stop because the plan goes on there.
- `allocated`: the promised chunks become this step's load jobs (or are dropped: no room).
- `run_loads` (worker side, before the forward): each job's chunk comes from its prefetch
  (waited for until the deadline), from the staged bytes of a write in flight, or from a load
  now; it is checked and written through the pool's block port. A missing, corrupt or late
  chunk fails its request from that block on (the engine recomputes from there).
- With the layer-wise pipelined restore (`layered`: `restore_pipeline = "layer"` and an
  engine whose forward calls `layer_ready`), the jobs whose chunk is a layered record in a
  disk or Redis tier are not read in `run_loads` but handed to a `LayerLoader` that fills
  them a layer at a time beside the forward; `finish_layer_loads`, after the forward, names
  the requests whose step must be thrown away (a layer failed or came late).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvtier.cache.chunks import Chunks
from kvtier.cache.config import TiersConfig
from kvtier.cache.forms import ChunkForms, Restored
from kvtier.cache.layers import LayerJob, LayerLoader
from kvtier.engine.request import Request
from kvtier.tiers import Chunk, Mover, Payload, Placement, TieredStore
from kvtier.tiers.payload import as_buffer
from kvtier.vocab import DEVICE, FULL, RECOMPUTED, SOURCES

if TYPE_CHECKING:
    from kvtier.policy.cost_model import CostModel
    from kvtier.policy.restore import RestorePlan
    from kvtier.tiers.mover import Prefetch


class Load(NamedTuple):
    """Blocks [first, end) of a request: from `chunk`, or (chunk None) cached on the device
    after a run the prefill recomputes."""

    chunk: Chunk | None
    first: int
    end: int


class _Job(NamedTuple):
    request: Request
    load: Load
    block_ids: list[int]


class _Fill(NamedTuple):
    """Blocks [first, first + blocks) of a request filled this step from `tier`."""

    request: Request
    tier: str
    first: int
    blocks: int


class Restorer:
    def __init__(
        self,
        config: TiersConfig,
        chunks: Chunks,
        store: TieredStore,
        mover: Mover,
        chunk_forms: ChunkForms,
        cost_model: Callable[[], CostModel],
        counters: Counter[str],
        tokens: Counter[str],
    ) -> None:
        self.config = config
        self.chunks = chunks
        self.block_size = chunks.block_size
        self.store = store
        self.mover = mover
        self.chunk_forms = chunk_forms
        self.cost_model = cost_model
        self.counters = counters
        self.tokens = tokens  # prompt tokens per source, over all requests
        self._plans: dict[str, list[Load]] = {}  # request id -> loads not yet promised
        self._promised: dict[str, list[Load]] = {}
        self._jobs: list[_Job] = []
        self._prefetches: dict[str, tuple[Prefetch, dict[bytes, int]]] = {}
        self._loaded: dict[str, Counter[str]] = {}  # request id -> blocks loaded per tier
        self._accounted: set[str] = set()  # requests whose sources are on their metrics
        self._shared = bool(store.shared_tiers)  # e.g. Redis under several replicas
        # The layer-wise pipelined restore: set by the connector when it is configured and
        # the engine's forward calls `layer_ready`.
        self.layered = False
        # Set by the connector for an engine that takes loads only right after its own hits
        # (`EngineContext.loads_after_recompute` False): plans load a prefix, then prefill.
        self.prefix_only = False
        self._loader: LayerLoader | None = None
        self._fills: list[_Fill] = []  # this step's, to undo what a failed layer discards

    # ----- scheduler side --------------------------------------------------------------

    def on_request_added(self, request: Request) -> None:
        """The request is queued. From its device hits on: the chunks of its prompt a shared
        tier holds that this process has not seen are indexed (another replica wrote them, or
        an earlier run), then the loads the restore will do start in the background."""
        c = self.config
        prefetching = c.prefetch and c.restore != "recompute"
        if not (self._shared or (prefetching and len(self.store))):
            return  # nothing to discover or prefetch: no lookups on the add path
        max_blocks = (request.num_tokens - 1) // self.block_size
        keys = request.keys_of_full_blocks(self.block_size)[:max_blocks]
        start = self.chunks.cached_run(keys)
        if self._shared:
            self.store.discover(keys, self.chunks.namespace_of(request), start)
        if not prefetching or not len(self.store):
            return  # (chunks only staged are read from their bytes at admission)
        ids = [
            load.chunk.id
            for load in self._plan_loads(request, start, for_prefetch=True)
            if load.chunk is not None and self._worth_prefetching(load.chunk.id)
        ]
        if not ids:
            return
        # decoding a quantized chunk runs on the prefetch worker too
        handle = self.mover.prefetch(ids, then=self._decode)
        self._prefetches[request.request_id] = (handle, {cid: i for i, cid in enumerate(ids)})
        self.counters["prefetched_chunks"] += len(ids)

    def _worth_prefetching(self, chunk_id: bytes) -> bool:
        """Not a chunk still being written (read from its staged bytes), nor one in a tier
        read at memory speed (host): that one is read straight into its device blocks when
        they are known, where a prefetch would copy it twice."""
        if self.chunks.writes.staged(chunk_id) is not None:
            return False
        placement = self.store.locate(chunk_id)
        if placement is None:
            return False
        # A layered chunk is read a layer at a time beside the forward instead.
        return not self.store.tiers[placement.tier].in_memory and not self._by_layers(placement)

    def _by_layers(self, placement: Placement) -> bool:
        """Whether a chunk stored here is read a layer at a time (the pipelined restore is on,
        and the tier holds full-precision chunks as layered records)."""
        return self.layered and placement.form == FULL and self.store.tiers[placement.tier].layered

    def loadable(self, request: Request, num_computed_tokens: int) -> int:
        rid = request.request_id
        start = num_computed_tokens // self.block_size
        max_blocks = (request.num_tokens - 1) // self.block_size
        plan = self._plans.get(rid)
        if rid in self._promised:  # promised before, but the scheduler could not admit it
            plan = self._plans[rid] = self._promised.pop(rid) + (plan or [])
        if plan is None:
            if start >= max_blocks or self.config.restore == "recompute":
                return 0
            plan = self._plans[rid] = self._plan_loads(request, start)
        self._pass(request, plan, start)
        promised: list[Load] = []
        while plan and plan[0].chunk is not None and plan[0].first == start:
            load = plan.pop(0)
            promised.append(load)
            start = load.end
        if not plan:
            self._plans.pop(rid, None)
            if not promised:
                self._forget_prefetch(rid)
        if not promised:
            return 0
        self._promised[rid] = promised
        return (promised[-1].end - promised[0].first) * self.block_size

    def promised_sources(self, request_id: str) -> dict[str, int]:
        """The tokens the request's promised loads take from each tier (its last
        `loadable` answer, until the loads are allocated)."""
        sources: Counter[str] = Counter()
        for load in self._promised.get(request_id, ()):
            if load.chunk is not None:
                tier = self.chunks.locate(load.chunk.id)
                sources[tier or "unknown"] += (load.end - load.first) * self.block_size
        return dict(sources)

    def _pass(self, request: Request, plan: list[Load], start: int) -> None:
        """Drop the plan's entries before block `start` (the scheduler's device lookup or the
        prefill got past them), counting what became of device runs."""
        while plan and plan[0].first < start:
            load = plan.pop(0)
            if load.chunk is None:
                reused = min(load.end, start) - load.first
                self.counters["reused_device_blocks_after_recompute"] += reused
                self._count_loaded(request, DEVICE, reused)
                if reused < load.end - load.first:
                    self.counters["device_blocks_evicted_before_reuse"] += 1
        if plan and plan[0].chunk is None and plan[0].first == start:
            plan.pop(0)  # the scheduler found none of them cached: evicted since the plan
            self.counters["device_blocks_evicted_before_reuse"] += 1

    def next_position(self, request: Request, after: int) -> int | None:
        for load in self._plans.get(request.request_id, ()):
            if load.first * self.block_size > after:
                return load.first * self.block_size
        return None

    def allocated(self, request: Request, block_ids: list[int]) -> None:
        promised = self._promised.pop(request.request_id, [])
        if not promised:
            return
        if not block_ids:
            self.counters["restore_skipped_no_room"] += 1
            return  # recomputed
        offset = promised[0].first
        for load in promised:
            ids = block_ids[load.first - offset : load.end - offset]
            self._jobs.append(_Job(request, load, ids))

    def forget(self, request_id: str) -> None:
        """The request left the scheduler (finished, or preempted: re-planned later)."""
        self._plans.pop(request_id, None)
        self._promised.pop(request_id, None)
        self._jobs = [job for job in self._jobs if job.request.request_id != request_id]
        self._forget_prefetch(request_id)

    def finished(self, request_id: str) -> None:
        self.forget(request_id)
        self._loaded.pop(request_id, None)
        self._accounted.discard(request_id)

    # ----- sources ---------------------------------------------------------------------

    def on_admitted(self, request: Request) -> None:
        """The prompt tokens' sources: device hits, each tier's loads, the rest recomputed."""
        bs = self.block_size
        cached_blocks = (request.num_cached_tokens or 0) // bs
        loaded = self._loaded.pop(request.request_id, Counter())
        sources: Counter[str] = Counter({tier: n * bs for tier, n in loaded.items()})
        sources[DEVICE] = (cached_blocks - sum(loaded.values())) * bs
        sources[RECOMPUTED] = request.num_prompt_tokens - cached_blocks * bs
        request.metrics.prompt_token_sources = {s: sources.get(s, 0) for s in SOURCES}
        self.tokens.update(sources)
        self._accounted.add(request.request_id)

    def _count_loaded(self, request: Request, tier: str, blocks: int) -> None:
        rid = request.request_id
        if rid not in self._accounted:
            if tier != DEVICE:  # device hits are what admission does not count as loaded
                self._loaded.setdefault(rid, Counter())[tier] += blocks
            return
        # loaded after a recomputed run, once admission had counted these as recomputed
        n = blocks * self.block_size
        sources = request.metrics.prompt_token_sources
        if sources is not None and sources.get(RECOMPUTED, 0) >= n:
            sources[tier] = sources.get(tier, 0) + n
            sources[RECOMPUTED] -= n
            self.tokens[tier] += n
            self.tokens[RECOMPUTED] -= n
        self.counters["restored_blocks_after_recompute"] += blocks

    # ----- worker side -----------------------------------------------------------------

    def run_loads(self) -> dict[str, int]:
        """This step's loads, in order; request id -> its first block not filled. Layered
        chunks (`layered`) start loading a layer at a time after the others are in."""
        jobs, self._jobs = self._jobs, []
        self._fills = []
        pipelined = self._layer_jobs(jobs) if self.layered else {}
        failed: dict[str, int] = {}
        for request, load, ids in jobs:
            rid = request.request_id
            if rid in failed or id(load) in pipelined:
                continue  # recomputed from the failed block on, or read beside the forward
            if not self._fill(request, load, ids):
                failed[rid] = load.first
                self.counters["restore_failures"] += 1
                self._plans.pop(rid, None)  # the prefill recomputes everything after it
        for rid in {job.request.request_id for job in jobs}:
            if rid not in self._plans:
                self._forget_prefetch(rid)
        self._start_layers(jobs, pipelined, failed)
        return failed

    # ----- the layer-wise pipelined restore --------------------------------------------

    def _layer_jobs(self, jobs: list[_Job]) -> dict[int, LayerJob]:
        """Which of this step's jobs load a layer at a time (by `id(load)`): a whole chunk in
        full precision, in a tier holding it as a layered record (its head read now: one
        Redis round trip for all of a tier's), with no prefetch or staged bytes to serve it
        already, into blocks the pool lends as they are (`block_view`: a CPU pool)."""
        candidates: dict[str, list[tuple[_Job, list[torch.Tensor], str]]] = {}
        for job in jobs:
            chunk = job.load.chunk
            assert chunk is not None
            placement = self.store.locate(chunk.id)
            prefetch = self._prefetches.get(job.request.request_id)
            if (
                placement is None
                or not self._by_layers(placement)
                or job.load.end - job.load.first != len(chunk.keys)
                or job.load.first % self.chunks.blocks_per_chunk
                or (prefetch is not None and chunk.id in prefetch[1])
                or self.chunks.writes.staged(chunk.id) is not None
            ):
                continue
            # each block on its own: a chunk's blocks need not be adjacent in the pool
            views = [self.chunks.port.block_view([block_id]) for block_id in job.block_ids]
            if all(view is not None for view in views):
                candidates.setdefault(placement.tier, []).append((job, views, placement.namespace))
        pipelined: dict[int, LayerJob] = {}
        for name, entries in candidates.items():
            tier = self.store.tiers[name]
            keys = [(job.load.chunk.id, ns) for job, _, ns in entries]  # type: ignore[union-attr]
            for (job, views, ns), head in zip(entries, tier.layer_heads(keys), strict=True):
                if head is None:
                    continue  # an older record, or gone: read whole, as before
                pipelined[id(job.load)] = LayerJob(
                    job.request.request_id,
                    job.load.first,
                    tier,
                    head.key,
                    ns,
                    tier.layer_check(head),
                    [as_buffer(view.view(torch.uint8).view(-1)) for view in views],
                )
        return pipelined

    def _start_layers(
        self, jobs: list[_Job], pipelined: dict[int, LayerJob], failed: dict[str, int]
    ) -> None:
        """Start the loader on the layered jobs of requests that have not failed before
        them (a request recomputes from its first failure: nothing after it may load)."""
        started = []
        for request, load, ids in jobs:
            job = pipelined.get(id(load))
            if job is None or failed.get(request.request_id, len(request.token_ids)) <= load.first:
                continue
            started.append(job)
            tier = job.tier.name
            for block_id in ids:
                self.chunks.block_pool.set_form(block_id, FULL)
            self._count_loaded(request, tier, len(ids))  # undone if a layer fails
            self._fills.append(_Fill(request, tier, load.first, len(ids)))
        if started:
            num_layers = self.chunks.port.block_shape[0]
            self._loader = LayerLoader(started, num_layers, self.config.restore_deadline_s)

    def layer_ready(self, layer: int) -> None:
        if self._loader is not None:
            self._loader.wait(layer)

    def finish_layer_loads(self) -> dict[str, int]:
        """After the forward: the loader joined; request id -> first block of its first
        chunk whose layers failed or came late. Those requests' step is thrown away and
        they recompute from there (what they loaded from there on is counted recomputed)."""
        loader, self._loader = self._loader, None
        if loader is None:
            return {}
        failed_jobs, late = loader.finish()
        failed: dict[str, int] = {}
        for job in failed_jobs:
            failed[job.request_id] = min(job.first, failed.get(job.request_id, job.first))
            self.counters["restore_failures"] += 1
            self.counters["restore_layer_failures"] += 1
            if late:
                self.counters["restore_late"] += 1
            else:
                self.store.delete(job.key)  # as a whole read that failed: forgotten
        bad = {id(job) for job in failed_jobs}
        for job in loader.jobs:
            if id(job) in bad or failed.get(job.request_id, job.first + 1) <= job.first:
                continue
            self.counters["restored_chunks"] += 1
            self.counters["restored_chunks_layered"] += 1
            self.counters["restored_blocks"] += len(job.blocks)
            self.counters[f"restored_blocks_{job.tier.name}"] += len(job.blocks)
        for fill in self._fills:
            first_bad = failed.get(fill.request.request_id)
            if first_bad is not None and fill.first >= first_bad:
                self._uncount(fill.request, fill.tier, fill.blocks)
        for rid in failed:
            self._plans.pop(rid, None)  # the prefill recomputes everything after it
            self._forget_prefetch(rid)
        return failed

    def _uncount(self, request: Request, tier: str, blocks: int) -> None:
        """Blocks counted as loaded from `tier` that a failed layer made recomputed."""
        n = blocks * self.block_size
        sources = request.metrics.prompt_token_sources
        if request.request_id not in self._accounted or sources is None:
            self._loaded.get(request.request_id, Counter())[tier] -= blocks
            return
        if sources.get(tier, 0) >= n:
            sources[tier] -= n
            sources[RECOMPUTED] = sources.get(RECOMPUTED, 0) + n
            self.tokens[tier] -= n
            self.tokens[RECOMPUTED] += n

    def _fill(self, request: Request, load: Load, block_ids: list[int]) -> bool:
        chunk = load.chunk
        assert chunk is not None
        deadline = time.monotonic() + self.config.restore_deadline_s
        grid = (load.first // self.chunks.blocks_per_chunk) * self.chunks.blocks_per_chunk
        # The whole chunk into adjacent device blocks: a load now reads it in place.
        whole = load.first == grid and load.end - load.first == len(chunk.keys)
        into = self.chunks.port.block_view(block_ids) if whole else None
        loaded, tier = self._load(request.request_id, chunk, deadline, into)
        if loaded is None or tier is None or loaded.blocks.shape[0] != len(chunk.keys):
            return False
        if into is not None and loaded.blocks.data_ptr() == into.data_ptr():
            self.counters["restored_chunks_in_place"] += 1
        else:
            blocks = loaded.blocks[load.first - grid : load.end - grid]
            self.chunks.load(block_ids, blocks)
        for block_id in block_ids:
            # a block restored lossy is never "exact"
            self.chunks.block_pool.set_form(block_id, loaded.form)
        n = len(block_ids)
        self._fills.append(_Fill(request, tier, load.first, n))
        self.counters["restored_chunks"] += 1
        self.counters["restored_blocks"] += n
        self.counters[f"restored_blocks_{tier}"] += n
        if loaded.form != FULL:
            self.counters[f"restored_blocks_{loaded.form}"] += n
        self._count_loaded(request, tier, n)
        return True

    def _load(
        self, request_id: str, chunk: Chunk, deadline: float, into: torch.Tensor | None = None
    ) -> tuple[Restored | None, str | None]:
        """The chunk in the pool's dtype and the form it was stored in (None: missing,
        corrupt, not this pool's blocks, or late), and the tier it counts as restored from.

        In order: its prefetch (waited for until the deadline; decoded on the worker), the
        staged bytes of a write still in flight (no waiting for the tier), a load now
        (retried `retries` times). A load now of a full-precision chunk reads into `into`
        (its device blocks) when given; a failed read may leave them half written, which
        is harmless: the request is rolled back and recomputes them."""
        prefetch = self._prefetches.get(request_id)
        if prefetch is not None and chunk.id in prefetch[1]:
            handle, index = prefetch
            placement = self.store.locate(chunk.id)
            wait = max(0.0, deadline - time.monotonic())
            loaded, finished = handle.entry(index[chunk.id], wait)
            if loaded is None and not finished:
                self.counters["restore_late"] += 1
            if loaded is not None:
                self.counters["restored_chunks_prefetched"] += 1
            return loaded, placement.tier if placement is not None else None
        staged = self.chunks.writes.staged(chunk.id)
        if staged is not None:
            self.counters["restored_chunks_staged"] += 1
            loaded = self._decode(staged.payload)
            return (loaded._replace(form=staged.form) if loaded else None), staged.tier
        placement = self.store.locate(chunk.id)
        if placement is None:
            return None, None
        out = None
        if into is not None and placement.form == FULL:
            out = into.view(-1).view(torch.uint8)
        payload = self.store.promote(chunk.id, out=out, attempts=1 + self.config.retries)
        return self._decode(payload), placement.tier

    def _decode(self, payload: Payload | None) -> Restored | None:
        """`ChunkForms.restore`, with bytes that do not decode counted as a miss."""
        try:
            return self.chunk_forms.restore(payload)
        except (ValueError, RuntimeError):
            return None

    def _forget_prefetch(self, request_id: str) -> None:
        prefetch = self._prefetches.pop(request_id, None)
        if prefetch is not None:
            prefetch[0].cancel()

    # ----- planning --------------------------------------------------------------------

    def _plan_loads(self, request: Request, start: int, for_prefetch: bool = False) -> list[Load]:
        """The stored chunks after block `start` that the request will load, in prompt order;
        for a prefetch, in the plan's issue order (a bidirectional plan loads back to front:
        the chunks next to the recomputed front are needed last). Runs still cached on the
        device after a run the prefill recomputes come as Load(None, ...), except for a
        prefetch.

        Chunks the request's `load_limit` does not allow count as stored nowhere.
        `restore="load"` loads every stored chunk; runs of blocks stored nowhere (holes) are
        recomputed and the loads after them go on. `restore="plan"` follows the restore
        planner (`policy.restore`): the front it recomputes while the back loads."""
        keys = request.keys_of_full_blocks(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        namespace = self.chunks.namespace_of(request)
        k = self.chunks.blocks_per_chunk
        found: list[Load] = []
        runs: list[tuple[int, int, str | None]] = []  # every run of blocks and its tier
        stored = self.chunks.any_stored()
        limit = request.load_limit
        budget = max_blocks if limit.max_tokens is None else limit.max_tokens // self.block_size
        pos = start
        while pos < max_blocks:
            grid_end = min((pos // k + 1) * k, max_blocks)
            hit = self.chunks.find_stored(keys, pos // k, namespace, pos) if stored else None
            chunk, shared = hit if hit is not None else (None, 0)
            if chunk is not None:
                blocks = min((pos // k) * k + shared, grid_end) - pos
                refused = limit.tiers is not None and not limit.allows(self.chunks.locate(chunk.id))
                if refused or blocks > budget:
                    # the request does not load from that tier, or no more: recomputed
                    chunk, shared = None, 0
                    if not for_prefetch:
                        self.counters["restore_chunks_refused_by_request"] += 1
                else:
                    budget -= blocks
            cached = 0 if chunk is not None else self.chunks.cached_run(keys[pos:grid_end])
            if cached:
                runs.append((pos, pos + cached, DEVICE))
                found.append(Load(None, pos, pos + cached))
                if pos + cached < grid_end:
                    runs.append((pos + cached, grid_end, None))
                pos = grid_end
                continue
            end = grid_end if chunk is None else min((pos // k) * k + shared, grid_end)
            runs.append((pos, end, None if chunk is None else self.chunks.locate(chunk.id)))
            if chunk is not None:
                found.append(Load(chunk, pos, end))
                if end < grid_end:
                    runs.append((end, grid_end, None))  # a short or diverging chunk: a hole
            pos = grid_end
        if for_prefetch:
            found = [load for load in found if load.chunk is not None]
        if not any(load.chunk for load in found) or self.config.restore != "plan":
            return found
        plan = self._plan(runs, count=not for_prefetch)
        chosen = {runs[i][0]: i for i in plan.loads}
        loads = [load for load in found if load.chunk is None or load.first in chosen]
        if for_prefetch:
            loads.sort(key=lambda load: plan.loads.index(chosen[load.first]))
        return loads

    def _plan(self, runs: list[tuple[int, int, str | None]], count: bool) -> RestorePlan:
        from kvtier.policy.restore import plan_prefix_restore, plan_restore
        from kvtier.policy.view import ChunkView

        bs = self.block_size
        per_block = self.chunk_forms.nbytes(1, FULL)
        views = [
            ChunkView(
                index=i,
                token_start=first * bs,
                token_end=end * bs,
                tier=tier,
                size_bytes=(end - first) * per_block,
            )
            for i, (first, end, tier) in enumerate(runs)
        ]
        planner = plan_prefix_restore if self.prefix_only else plan_restore
        plan = planner(views, self.cost_model())
        if count:
            self.counters[f"restore_plan_{plan.kind}"] += 1
        return plan
