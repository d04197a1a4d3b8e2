"""EngineTiers: kvtier's tiered connector beside one vLLM worker's KV cache.

It holds a `kvtier.cache.TieredConnector` (the same tiers, store, mover, restore planner,
write-through and retention policy as kvtier's own engine) bound to an `EngineContext` made
of adapters over vLLM: `PagedKVPort` (vLLM's per-layer paged KV, through its block ids),
`VllmBlockView` (vLLM's pool as kvtier may see it) and `RequestView`s. It runs where the KV
tensors are (vLLM's worker); the scheduler side (`scheduler_side.py`) reaches it only
through each step's messages (`messages.py`):

    reset       every stored chunk dropped (vLLM's weights may have changed)
    Lookup      the request is tracked (tenant, session and its hints, prefix chain),
                discovery and prefetch start; when asked, the Restorer's plan from vLLM's
                own hits says how many tokens kvtier can fill (the reply goes back with
                this step)
    Allocation  vLLM's block ids for those tokens become load jobs
    (loads)     before the forward: chunks written into vLLM's blocks; a chunk that fails
                names its blocks for vLLM's load-error path (they are recomputed)
    Save        after the forward: full chunks copied out of vLLM's blocks and written to
                the top tier on the mover's worker (write-through as chunks fill up)
    Finish      the session remembered for the policy and for prefix chains; the blocks
                vLLM keeps cached after it are the session's KV on the device
    DeviceState vLLM's waiting queue and free blocks, and which cached blocks it reused
    after_step  finished writes accounted, the policy on its timer or under vLLM's pressure;
                its orders on vLLM's idle blocks go back with the step's reply

The worker is the only caller; the lock guards the report read by other threads (tests,
stats).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from kvtier.cache.connector import TieredConnector
from kvtier.engine.connector import EngineContext, KVBlockPort, QueueDemand
from kvtier.engine.sessions import SessionTracker
from kvtier.integrations.vllm.block_view import VllmBlockView
from kvtier.integrations.vllm.messages import (
    Allocation,
    DeviceState,
    Finish,
    Lookup,
    Save,
    StepMessages,
    WorkerReply,
)
from kvtier.integrations.vllm.requests import (
    RequestView,
    SessionChains,
    identity,
    load_limit,
    session_hints,
)
from kvtier.integrations.vllm.settings import ConnectorSettings
from kvtier.integrations.vllm.tier_events import TierEvent, TierEventLog, describe_saved


@dataclass(frozen=True)
class _Waiting:
    """A request in vLLM's waiting queue, as the policy's queue view reads one."""

    num_tokens: int


class EngineTiers:
    def __init__(
        self,
        settings: ConnectorSettings,
        port: KVBlockPort,
        num_blocks: int,
        block_size: int,
        model: str,
        kv_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.model = settings.namespace or model
        self.block_view = VllmBlockView(num_blocks)
        self.queue = QueueDemand()  # vLLM's waiting queue as of the last step's schedule
        self.sessions = SessionTracker()
        self.chains = SessionChains()
        self.connector = TieredConnector(settings.tiers, settings.policy.name, settings.policy)
        self.connector.bind(
            EngineContext(
                block_pool=self.block_view,  # type: ignore[arg-type]  # the view's subset
                kv_port=port,
                block_size=block_size,
                kv_quant=None,
                sessions=self.sessions,
                queue=lambda: self.queue,
                loads_after_recompute=False,  # vLLM takes loads only after its own hits
            )
        )
        self.tier_names = tuple(self.connector.store.tiers)
        self.lock = threading.RLock()
        # what the tiers gain and lose, in vLLM's block hashes: only with vLLM's KV events on
        self.events = _event_log(self.connector) if kv_events else None
        self.views: dict[str, RequestView] = {}
        self._loading: dict[str, tuple[int, list[int]]] = {}  # id -> (first block, block ids)
        self._admitted: list[RequestView] = []
        self._load_errors: set[int] = set()
        self._promised: dict[str, int] = {}  # request id -> tokens promised, until allocated
        self._replies: dict[str, tuple[int, int]] = {}  # answers for this step's reply
        self._sources: dict[str, dict[str, int]] = {}  # their tokens per tier
        self.load_seconds = 0.0  # the steps' waits for loads (the forward runs after them)

    # ----- before the forward ------------------------------------------------------------

    def before_forward(self, messages: StepMessages) -> None:
        """Finishes, lookups and allocations in the order the scheduler sent them, then this
        step's loads into vLLM's blocks."""
        with self.lock:
            if messages.reset:
                self.connector.clear()
            for finish in messages.finishes:
                self._finish(finish)
            if messages.device is not None:  # after the finishes: it names their blocks
                self._device(messages.device)
            for lookup in messages.lookups:
                self._lookup(lookup)
            for allocation in messages.allocations:
                self._allocate(allocation)
            if messages.allocations:
                self._run_loads()

    def _device(self, state: DeviceState) -> None:
        self.block_view.update(state)
        waiting = tuple(_Waiting(tokens) for tokens in state.waiting_tokens)
        self.queue = QueueDemand(waiting)  # type: ignore[arg-type]  # reads num_tokens only

    def _lookup(self, lookup: Lookup) -> None:
        record = lookup.record
        view = self.views.get(record.request_id)
        if view is None:
            tenant, session_id = identity(record)
            view = RequestView(record, self.model, tenant, session_id)
            view.load_limit = load_limit(record, self.tier_names)
            if view.session_id is None:
                keys = view.keys_of_full_blocks(self.block_size)
                view.session_id = self.chains.session_of(keys, view.request_id)
            self.sessions.start_turn(
                view.session_id, view.request_id, view.num_prompt_tokens, session_hints(record)
            )
            self.views[view.request_id] = view
            self.connector.on_request_added(view)  # discovery in shared tiers, prefetch
        else:
            view.request = record  # its tokens as of now (a re-admission carries outputs)
        if lookup.readmitted:
            self.connector.on_preempted(view)  # re-planned from scratch
            view.num_cached_tokens = None
        if lookup.ask:
            tokens = self.connector.num_loadable_tokens(view, lookup.num_computed_tokens)
            self._promised[view.request_id] = tokens
            self._replies[view.request_id] = (lookup.num_computed_tokens, tokens)
            if tokens:
                self._sources[view.request_id] = self.connector.loadable_sources(view)

    def _allocate(self, allocation: Allocation) -> None:
        view = self.views.get(allocation.request_id)
        if view is None:
            return
        promised = self._promised.pop(view.request_id, 0)
        external = allocation.num_external_tokens
        if promised:
            ids = allocation.block_ids
            if external != promised or len(ids) * self.block_size != promised:
                ids = []  # vLLM took fewer tokens than promised: recomputed instead
            self.connector.on_blocks_allocated(view, ids)
            if ids:
                self._loading[view.request_id] = (
                    allocation.num_computed_tokens // self.block_size,
                    ids,
                )
        if view.num_cached_tokens is None:
            view.num_cached_tokens = allocation.num_computed_tokens + (external if promised else 0)
            self._admitted.append(view)

    def _run_loads(self) -> None:
        start = time.perf_counter()
        failed = self.connector.wait_for_loads()
        self.load_seconds += time.perf_counter() - start
        for rid, first_bad in failed.items():
            first, ids = self._loading.get(rid, (first_bad, []))
            self._load_errors.update(ids[first_bad - first :])
            view = self.views.get(rid)
            if view is not None and view.num_cached_tokens is not None:
                view.num_cached_tokens = min(view.num_cached_tokens, first_bad * self.block_size)
        self._loading.clear()
        for view in self._admitted:
            self.connector.on_admitted(view)  # prompt-token sources counted
            self.sessions.record_prefix(view.request_id, view.num_cached_tokens or 0)
        self._admitted.clear()

    def take_load_errors(self) -> set[int]:
        with self.lock:
            errors, self._load_errors = self._load_errors, set()
            return errors

    # ----- after the forward -------------------------------------------------------------

    def after_forward(self, messages: StepMessages) -> None:
        """Copy out the chunks this step's forward completed, then the policy's timer."""
        with self.lock:
            for save in messages.saves:
                self._save(save)
            with self.block_view.acting():
                self.connector.after_step()

    def _save(self, save: Save) -> None:
        view = self.views.get(save.request_id)
        if view is None:
            return
        _extend(view, save.tokens_from, save.tokens)
        k = self.connector.blocks_per_chunk
        keys = view.keys_of_full_blocks(self.block_size)[: save.end_chunk * k]
        ids = save.block_ids[: len(keys)]
        if self.events is not None:  # before the write: its placement is announced
            describe_saved(self.events, view.request, save, keys, k, self.block_size)  # type: ignore[arg-type]
        with self.block_view.bind(keys, ids):
            # the gather is the copy; the tier write runs on the mover's worker
            self.connector.spiller.write_through_chunks(
                keys[save.first_chunk * k :], self.connector.chunks.namespace_of(view)
            )

    def _finish(self, finish: Finish) -> None:
        view = self.views.pop(finish.request_id, None)
        if view is None:
            return
        self._promised.pop(finish.request_id, None)
        self._loading.pop(finish.request_id, None)
        _extend(view, finish.tokens_from, finish.tokens)
        view.request.num_computed_tokens = finish.num_computed_tokens
        bs = self.block_size
        keys = view.keys_of_full_blocks(bs)[: finish.num_computed_tokens // bs]
        # no device block is reachable now: this only remembers the session for the policy
        self.connector.on_request_finished(view)
        self.connector.spiller.forget(keys)  # vLLM reports no evictions
        self.block_view.idle(keys, finish.cached_block_ids)
        self.sessions.end_turn(finish.request_id)
        prompt_blocks = min(view.num_prompt_tokens // bs, len(keys))
        ends = [keys[i - 1] for i in {prompt_blocks, len(keys)} if i]
        if view.session_id is not None:
            self.chains.remember(view.session_id, ends)

    def reply(self) -> WorkerReply:
        """What the scheduler side learns after this step."""
        with self.lock:
            answers, self._replies = self._replies, {}
            sources, self._sources = self._sources, {}
            c = self.connector
            # a shared tier (Redis) may hold what another replica wrote: always worth asking
            shared = bool(c.store.shared_tiers)
            may_hit = c.chunks.any_stored() or shared
            evict, keep = self.block_view.take_orders()
            c.counters["policy_released_vllm_blocks"] += len(evict)
            c.counters["policy_kept_vllm_blocks"] += len(keep)
            return WorkerReply(answers, may_hit, sources, evict, keep)

    def take_tier_events(self) -> list[TierEvent]:
        """What the tiers gained and lost since the last call (empty with KV events off)."""
        with self.lock:
            if self.events is None:
                return []
            events = self.events.take()
            counters = self.connector.counters
            counters["kv_events_dropped"] = self.events.dropped
            counters["kv_events_unannounced"] = self.events.unannounced
            return events

    # ----- reporting and lifecycle -------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {**self.connector.stats(), "load_seconds": self.load_seconds}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the writes in flight (tests and benchmarks measure a settled state)."""
        with self.lock:
            return self.connector.flush(timeout)

    def close(self) -> None:
        with self.lock:
            self.connector.close()


def _event_log(connector: TieredConnector) -> TierEventLog:
    writes = connector.writes
    return TierEventLog(connector.store, lambda chunk_id: writes.staged(chunk_id) is not None)


def _extend(view: RequestView, start: int, tokens: list[int]) -> None:
    if tokens:
        view.request.all_token_ids[start : start + len(tokens)] = tokens


class Registry:
    """The EngineTiers of each vLLM engine in this process, by vLLM's engine id."""

    def __init__(self) -> None:
        self._engines: dict[str, EngineTiers] = {}
        self._lock = threading.Lock()

    def add(self, engine_id: str, tiers: EngineTiers) -> None:
        with self._lock:
            self._engines[engine_id] = tiers

    def get(self, engine_id: str) -> EngineTiers | None:
        with self._lock:
            return self._engines.get(engine_id)

    def remove(self, engine_id: str) -> None:
        with self._lock:
            self._engines.pop(engine_id, None)

    def all(self) -> list[EngineTiers]:
        with self._lock:
            return list(self._engines.values())


REGISTRY = Registry()
