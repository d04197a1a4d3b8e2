"""KvtierConnector: vLLM's `KVConnectorBase_V1`, backed by kvtier's tiers and policies.

Built against vLLM 0.32.0's interface (vllm/distributed/kv_transfer/kv_connector/v1/base.py)
and checked against 0.34.0's too (`compat.py` says where they differ). Loaded by vLLM from

    kv_transfer_config={
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"config": "kvtier.toml", "tiers": {...}, "policy": {...}},
    }

vLLM makes one object per role. The scheduler one is a `SchedulerSide` (bookkeeping, no
tiers); the worker one owns the `EngineTiers` (tiers, store, restore planner, policy) beside
the KV tensors. They talk only through vLLM's step metadata (`messages.py`), so they may sit
in different processes, as vLLM-CPU's default mp executor and `vllm serve` put them.

Loads are synchronous within the step (before the forward, `start_load_kv`); saves are
copies taken after the forward that fills a chunk (`wait_for_save`), written to the tiers in
the background, so `request_finished` never delays vLLM's freeing.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.version import __version__ as vllm_version

from kvtier.errors import KvtierError
from kvtier.integrations.vllm.compat import refuse_sleep_mode, unchecked_release_note
from kvtier.integrations.vllm.engine_tiers import REGISTRY, EngineTiers
from kvtier.integrations.vllm.idle_blocks import IdleBlocks
from kvtier.integrations.vllm.kv_events import KvtierKVEvents, SchedulerEvents, worker_events
from kvtier.integrations.vllm.kv_port import PagedKVPort
from kvtier.integrations.vllm.messages import DeviceState, StepMessages, WorkerReply
from kvtier.integrations.vllm.prom_metrics import KvtierPromMetrics
from kvtier.integrations.vllm.scheduler_side import SchedulerSide
from kvtier.integrations.vllm.series import Deltas, totals
from kvtier.integrations.vllm.settings import describe, parse_settings
from kvtier.integrations.vllm.stats import KvtierStats
from kvtier.models.identity import model_identity
from kvtier.vocab import DISK, HOST, REMOTE

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# kvtier's tiers in vLLM's words for where cached prompt tokens came from; Redis is shared
# storage, neither a peer (p2p) nor this host's disk
_HIT_SOURCES = {
    HOST: CacheHitSource.HOST,
    DISK: CacheHitSource.DISK,
    REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED,
}


def route_logs_to_vllm() -> None:
    """kvtier's log lines (these, the tiers' errors, the policy's) through vLLM's own handler,
    so they appear in vLLM's log beside its lines; without it they would go nowhere."""
    kvtier, vllm = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if not kvtier.handlers and vllm.handlers:
        for handler in vllm.handlers:
            kvtier.addHandler(handler)
        kvtier.setLevel(vllm.level or logging.INFO)
        kvtier.propagate = False


class KvtierMetadata(KVConnectorMetadata):
    def __init__(self, messages: StepMessages) -> None:
        self.messages = messages


class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    def __init__(self, reply: WorkerReply) -> None:
        self.reply = reply

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # one worker (tensor_parallel_size=1, checked at start): nothing to merge
        return self


class KvtierConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        parallel = vllm_config.parallel_config
        if parallel.world_size > 1:
            raise KvtierError(
                "the kvtier connector supports one worker (tensor and pipeline parallel "
                f"size 1); this vLLM runs {parallel.world_size}"
            )
        refuse_sleep_mode(vllm_config.model_config.enable_sleep_mode)
        self._engine_id = str(transfer.engine_id)
        self._settings = parse_settings(transfer.kv_connector_extra_config)
        block_size = vllm_config.cache_config.block_size
        chunk_tokens = self._settings.tiers.chunk_tokens
        if chunk_tokens % block_size:
            raise KvtierError(
                f"tiers.chunk_tokens={chunk_tokens} must be a multiple of vLLM's "
                f"block_size={block_size}"
            )
        # a tier that fails (corrupt record, Redis down, late) must cost time only; vLLM's
        # scheduler reads the policy after it has built this object, so this is what it runs
        # with (its start-up line, printed before, still shows the value it was given)
        transfer.kv_load_failure_policy = "recompute"
        route_logs_to_vllm()
        if role == KVConnectorRole.SCHEDULER:  # once per engine, not once per process
            log.info("kvtier: %s", describe(self._settings, transfer.kv_load_failure_policy))
            if note := unchecked_release_note(vllm_version):
                log.warning("kvtier: %s", note)
        # the tiers' placements in vLLM's KV events: only when vLLM publishes events
        events = vllm_config.kv_events_config
        self._kv_events = bool(events is not None and events.enable_kv_cache_events)
        self._pending_events = SchedulerEvents() if self._kv_events else None
        self._scheduler = SchedulerSide(block_size, chunk_tokens, self._kv_events)
        self._idle = IdleBlocks()  # finished requests' blocks vLLM keeps cached
        self._tiers: EngineTiers | None = None
        self._deltas = Deltas()  # what was reported to vLLM so far

    # asked by vLLM 0.34 and later only (compat.py): refused at configuration time
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False

    # best effort: a save that never lands is a later miss, not lost output
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ----- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        config = self._vllm_config
        num_blocks = self._kv_cache_config.num_blocks
        self._tiers = EngineTiers(
            self._settings,
            PagedKVPort(kv_caches, num_blocks),
            num_blocks,
            config.cache_config.block_size,
            model_identity(str(config.model_config.model)),
            kv_events=self._kv_events,
        )
        REGISTRY.add(self._engine_id, self._tiers)

    @property
    def tiers(self) -> EngineTiers:
        if self._tiers is None:
            raise KvtierError("vLLM called the kvtier worker before registering its KV cache")
        return self._tiers

    def _messages(self) -> StepMessages:
        return self._get_connector_metadata().messages  # type: ignore[attr-defined]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.tiers.before_forward(self._messages())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loaded whole in start_load_kv

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return None  # whole chunks are copied in wait_for_save

    def wait_for_save(self) -> None:
        self.tiers.after_forward(self._messages())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.tiers.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return KvtierWorkerMetadata(self.tiers.reply())

    def get_kv_connector_stats(self) -> KvtierStats | None:
        if self._tiers is None:
            return None
        changed = self._deltas.since_last(totals(self._tiers.stats()))
        return KvtierStats(data=changed) if changed else None

    def get_kv_connector_kv_cache_events(self) -> KvtierKVEvents | None:
        if self._tiers is None or self._tiers.events is None:
            return None
        shared = frozenset(t.name for t in self._tiers.connector.store.shared_tiers)
        return worker_events(self._tiers.take_tier_events(), shared)

    def shutdown(self) -> None:
        if self._tiers is not None:
            self._tiers.close()
            REGISTRY.remove(self._engine_id)

    # ----- scheduler side ----------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        # vLLM's own prompt_tokens_cached_by_source then names kvtier's tiers
        if not num_external_tokens:
            return {}
        split = self._scheduler.hit_sources(request, num_external_tokens)
        if not split:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        named: Counter[CacheHitSource] = Counter()
        for tier, tokens in split.items():
            named[_HIT_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)] += tokens
        return dict(named)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        manager = self._kv_cache_manager
        if manager is None:
            raise KvtierError("vLLM did not bind its KV cache manager to the kvtier connector")
        messages = self._scheduler.step(
            scheduler_output.num_scheduled_tokens,
            lambda request_id: manager.get_block_ids(request_id)[0],
        )
        # vLLM's queue and pool for the policy's view and pressure trigger, as of this schedule
        self._idle.handed_out(_new_block_ids(scheduler_output))
        messages.device = DeviceState(
            self._scheduler.waiting_tokens(),
            manager.block_pool.get_num_free_blocks(),
            self._idle.take_gone(),
        )
        return KvtierMetadata(messages)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvtierWorkerMetadata):
            self._scheduler.on_reply(meta.reply)
            reply = meta.reply
            if (reply.evict or reply.keep) and self._kv_cache_manager is not None:
                self._idle.apply(self._kv_cache_manager.block_pool, reply.evict, reply.keep)
        events = connector_output.kv_cache_events
        if self._pending_events is not None and isinstance(events, KvtierKVEvents):
            self._pending_events.add(events.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._pending_events.take() if self._pending_events is not None else ()

    def reset_cache(self) -> bool:
        # vLLM's reset_prefix_cache(reset_connector=True), e.g. after a weight update: the
        # worker drops every stored chunk before the next step's lookups
        self._scheduler.reset()
        self._idle.clear()  # vLLM empties its prefix cache too
        return True

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        manager = self._kv_cache_manager
        cached = self._idle.remember(manager.block_pool, block_ids) if manager else []
        self._scheduler.finished(request, cached)
        return False, None  # its full chunks were copied out as they filled

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats | None:
        return KvtierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _new_block_ids(output: SchedulerOutput) -> list[int]:
    """The blocks vLLM handed to requests in this schedule (a new request's include its prefix
    hits; a resumed one's all of its blocks)."""
    ids: list[int] = []
    for new in output.scheduled_new_reqs:
        ids += new.block_ids[0]
    for groups in output.scheduled_cached_reqs.new_block_ids:
        if groups:
            ids += groups[0]
    return ids
