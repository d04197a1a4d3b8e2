"""KvtierConnector: vLLM's `KVConnectorBase_V1`, backed by kvtier's tiers and policies.

Built against vLLM 0.32.0's interface (vllm/distributed/kv_transfer/kv_connector/v1/base.py).
Loaded by vLLM from

    kv_transfer_config={
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"config": "kvtier.toml", "tiers": {...}, "policy": {...}},
    }

Every call forwards to the engine's `EngineTiers` (engine_tiers.py); this class only speaks
vLLM's types. Loads are synchronous within the step (`start_load_kv`, before the forward);
saves are copies taken when a request finishes (`request_finished`), written to the tiers
in the background, so vLLM frees the blocks at once.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.errors import KvtierError
from kvtier.integrations.vllm.engine_tiers import REGISTRY, EngineTiers
from kvtier.integrations.vllm.kv_port import PagedKVPort
from kvtier.integrations.vllm.settings import parse_settings
from kvtier.integrations.vllm.stats import KvtierStats, totals

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class KvtierMetadata(KVConnectorMetadata):
    """Nothing travels: the loads are queued in the shared EngineTiers (see its docstring)."""


class KvtierConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self._engine_id = str(transfer.engine_id)
        self._settings = parse_settings(transfer.kv_connector_extra_config)
        if transfer.kv_load_failure_policy != "recompute":
            # a tier that fails (corrupt record, Redis down, late) must cost time only
            log.info("kvtier: kv_load_failure_policy=recompute (a failed load is recomputed)")
            transfer.kv_load_failure_policy = "recompute"
        self._tiers: EngineTiers | None = None
        self._reported: Counter[str] = Counter()  # totals already reported to vLLM

    # best effort: a save that never lands is a later miss, not lost output
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    @property
    def tiers(self) -> EngineTiers:
        if self._tiers is None:
            self._tiers = REGISTRY.get(self._engine_id)
            if self._tiers is None:
                raise KvtierError(
                    "the kvtier connector needs vLLM's worker in the scheduler's process "
                    "(tensor_parallel_size=1 with the default uniproc executor): no worker "
                    f"of engine {self._engine_id} registered its KV cache here"
                )
        return self._tiers

    # ----- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        config = self._vllm_config
        num_blocks = self._kv_cache_config.num_blocks
        port = PagedKVPort(kv_caches, num_blocks)
        tiers = EngineTiers(
            self._settings,
            port,
            num_blocks,
            config.cache_config.block_size,
            str(config.model_config.model),
        )
        REGISTRY.add(self._engine_id, tiers)
        self._tiers = tiers

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.tiers.run_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loaded whole in start_load_kv

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return None  # saved when the request finishes (request_finished)

    def wait_for_save(self) -> None:
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.tiers.take_load_errors()

    def shutdown(self) -> None:
        if self._role is KVConnectorRole.WORKER and self._tiers is not None:
            self._tiers.close()
            REGISTRY.remove(self._engine_id)

    # ----- scheduler side ----------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self.tiers.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.tiers.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.tiers.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self.tiers.after_step()
        return KvtierMetadata()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.tiers.finished(request, block_ids)
        return False, None

    def get_kv_connector_stats(self) -> KvtierStats | None:
        if self._role is not KVConnectorRole.SCHEDULER or self._tiers is None:
            return None
        now = totals(self._tiers.stats())
        delta = {name: value - self._reported[name] for name, value in now.items()}
        self._reported = now
        return KvtierStats(data=delta)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats | None:
        return KvtierStats(data=dict(data or {}))
