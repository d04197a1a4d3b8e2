"""EngineTiers: kvtier's tiered connector behind one vLLM engine, in vLLM's calls.

It holds a `kvtier.cache.TieredConnector` (the same tiers, store, mover, restore planner,
write-through and retention policy as kvtier's own engine) bound to an `EngineContext` made
of adapters over vLLM: `PagedKVPort` (vLLM's per-layer paged KV, through its block ids),
`VllmBlockView` (vLLM's pool as kvtier may see it) and `RequestView`s. The vLLM connector
class (`connector.py`) only forwards to it.

vLLM builds two connector objects, a scheduler one and a worker one. kvtier's restore plan
(scheduler side) and its loads (worker side) are one `Restorer`, so both objects share this
instance through `REGISTRY` (keyed by vLLM's engine id): the worker side creates it when
vLLM registers the KV tensors, which vLLM does before it builds the scheduler. That needs
the worker in the scheduler's process, which is vLLM's default for one device (the uniproc
executor); other executors are refused with a clear error.

Flow per request:
    on_new_request      identity (tenant, session), discovery and prefetch start
    matched_tokens      the Restorer's plan from vLLM's own hits: tokens kvtier can fill
    allocated           vLLM's block ids for those tokens become load jobs
    run_loads (worker)  before the forward: chunks written into vLLM's blocks; a chunk that
                        fails names its blocks for vLLM's load-error path (recomputed)
    finished            full chunks written through to the top tier (one gather; the tier
                        write runs on the mover), session remembered for the policy
    after_step          finished writes accounted, the policy's timer

vLLM calls these from its engine-core loop; a lock keeps the scheduler and worker sides
from interleaving if a vLLM version runs them on two threads.
"""

from __future__ import annotations

import threading
from typing import Any

from kvtier.cache.connector import TieredConnector
from kvtier.engine.connector import EngineContext, KVBlockPort, QueueDemand
from kvtier.engine.sessions import SessionTracker
from kvtier.integrations.vllm.block_view import VllmBlockView
from kvtier.integrations.vllm.requests import RequestView, SessionChains, VllmRequest, identity
from kvtier.integrations.vllm.settings import ConnectorSettings

_NO_QUEUE = QueueDemand(0, 0, 0)  # vLLM does not show a connector its waiting queue


class EngineTiers:
    def __init__(
        self,
        settings: ConnectorSettings,
        port: KVBlockPort,
        num_blocks: int,
        block_size: int,
        model: str,
    ) -> None:
        self.block_size = block_size
        self.model = settings.namespace or model
        self.block_view = VllmBlockView(num_blocks)
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
                queue=lambda: _NO_QUEUE,
            )
        )
        self.lock = threading.RLock()
        self.views: dict[str, RequestView] = {}
        self._local: dict[str, int] = {}  # request id -> vLLM's own hit (tokens) at the ask
        self._promised: dict[str, int] = {}  # request id -> tokens promised, until allocated
        self._loading: dict[str, tuple[int, list[int]]] = {}  # id -> (first block, block ids)
        self._admitted: list[RequestView] = []
        self._load_errors: set[int] = set()

    # ----- scheduler side ----------------------------------------------------------------

    def on_new_request(self, request: VllmRequest) -> RequestView:
        with self.lock:
            tenant, session_id = identity(request)
            view = RequestView(request, self.model, tenant, session_id)
            if view.session_id is None:
                keys = view.keys_of_full_blocks(self.block_size)
                view.session_id = self.chains.session_of(keys, view.request_id)
            self.sessions.start_turn(view.session_id, view.request_id, view.num_prompt_tokens)
            self.views[view.request_id] = view
            self.connector.on_request_added(view)  # discovery in shared tiers, prefetch
            return view

    def matched_tokens(self, request: VllmRequest, num_computed_tokens: int) -> int:
        """Prompt tokens kvtier can fill from `num_computed_tokens` (vLLM's own hits) on."""
        with self.lock:
            view = self.views.get(request.request_id) or self.on_new_request(request)
            if view.num_cached_tokens is not None:
                # admitted before and preempted since: vLLM asks again from scratch
                self.connector.on_preempted(view)
                view.num_cached_tokens = None
            self._local[view.request_id] = num_computed_tokens
            tokens = self.connector.num_loadable_tokens(view, num_computed_tokens)
            if tokens:
                self._promised[view.request_id] = tokens
            else:
                self._promised.pop(view.request_id, None)
            return tokens

    def allocated(
        self, request: VllmRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """vLLM allocated the request's blocks (`block_ids`: all of them, from its first)."""
        with self.lock:
            view = self.views.get(request.request_id)
            if view is None:
                return
            rid = view.request_id
            local = self._local.pop(rid, 0)
            promised = self._promised.pop(rid, 0)
            if promised:
                first = local // self.block_size
                ids = block_ids[first : first + promised // self.block_size]
                if num_external_tokens != promised or len(ids) * self.block_size != promised:
                    ids = []  # vLLM took fewer tokens than promised: recomputed instead
                self.connector.on_blocks_allocated(view, ids)
                if ids:
                    self._loading[rid] = (first, ids)
            if view.num_cached_tokens is None:
                view.num_cached_tokens = local + (num_external_tokens if promised else 0)
                self._admitted.append(view)

    def finished(self, request: VllmRequest, block_ids: list[int]) -> None:
        """Before vLLM frees the request's blocks: its full chunks are copied out (the copy
        is the only part paid here; the tier write runs on the mover's worker)."""
        with self.lock:
            view = self.views.pop(request.request_id, None)
            if view is None:
                return
            rid = view.request_id
            for table in (self._local, self._promised, self._loading):
                table.pop(rid, None)
            bs = self.block_size
            computed = min(request.num_computed_tokens // bs, len(block_ids))
            keys = view.keys_of_full_blocks(bs)[:computed]
            with self.block_view.bind(keys, block_ids[:computed]):
                self.connector.on_request_finished(view)
            self.connector.spiller.forget(keys)  # vLLM reports no evictions
            self.sessions.end_turn(rid)
            prompt_blocks = min(view.num_prompt_tokens // bs, len(keys))
            ends = [keys[i - 1] for i in {prompt_blocks, len(keys)} if i]
            if view.session_id is not None:
                self.chains.remember(view.session_id, ends)

    def after_step(self) -> None:
        with self.lock:
            self.connector.after_step()

    # ----- worker side -------------------------------------------------------------------

    def run_loads(self) -> None:
        """This step's loads into vLLM's blocks, before the forward pass."""
        with self.lock:
            failed = self.connector.wait_for_loads()
            for rid, first_bad in failed.items():
                first, ids = self._loading.get(rid, (first_bad, []))
                self._load_errors.update(ids[first_bad - first :])
                view = self.views.get(rid)
                if view is not None and view.num_cached_tokens is not None:
                    view.num_cached_tokens = min(
                        view.num_cached_tokens, first_bad * self.block_size
                    )
            self._loading.clear()
            for view in self._admitted:
                self.connector.on_admitted(view)  # prompt-token sources counted
                self.sessions.record_prefix(view.request_id, view.num_cached_tokens or 0)
            self._admitted.clear()

    def take_load_errors(self) -> set[int]:
        with self.lock:
            errors, self._load_errors = self._load_errors, set()
            return errors

    # ----- reporting and lifecycle -------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return self.connector.stats()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the writes in flight (tests and benchmarks measure a settled state)."""
        with self.lock:
            return self.connector.flush(timeout)

    def close(self) -> None:
        with self.lock:
            self.connector.close()


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
