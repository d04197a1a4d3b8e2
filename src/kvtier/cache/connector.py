"""TieredConnector: the engine's KV moving through host / disk / remote tiers.

It implements the engine's connector contract (`kvtier.engine.connector.KVConnector`) by
putting together parts that each have one job:

- `kvtier.tiers.factory.build_backends` builds the tiers; a `TieredStore` indexes them and a
  `Mover` runs their I/O on worker threads (`cache/writes.py` tracks writes in flight);
- `cache/chunks.py`: the chunk grid and where each chunk is;
- `cache/restore.py`: a resumed prompt's chunks found, planned, prefetched and loaded into
  the blocks the scheduler allocated;
- `cache/spill.py`: blocks copied out on eviction, preemption (swap-out) and finish
  (write-through);
- `cache/policy_runner.py`: the retention policy, on a timer and under pressure;
- `cache/shutdown_flush.py`: what a persistent disk tier receives at `close()`;
- `cache/stats.py`: the report.

With a persistent disk tier (`disk_persist`) under the host, the store copies the host's
chunks to disk as they are written (`disk_copy = "on_write"`, `TieredStore`'s `copy_to`).

Built from configuration alone (`TieredConnector(tiers, policy, policy_config)`); the pool's
geometry arrives when an engine binds it (`Engine(config, connector=...)`, or
`kvtier.cache.setup.build_engine`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.cache.chunks import Chunks
from kvtier.cache.config import TiersConfig
from kvtier.cache.forms import FULL, ChunkForms
from kvtier.cache.policy_runner import PolicyRunner
from kvtier.cache.restore import Restorer
from kvtier.cache.shutdown_flush import flush_to_disk
from kvtier.cache.spill import Spiller
from kvtier.cache.stats import connector_stats
from kvtier.cache.writes import BackgroundWrites
from kvtier.engine.connector import EngineContext
from kvtier.engine.request import Request
from kvtier.errors import KvtierError
from kvtier.tiers import Mover, Payload, TieredStore
from kvtier.tiers.factory import build_backends
from kvtier.vocab import DISK, HOST, SOURCES

if TYPE_CHECKING:
    from kvtier.policy.base import RetentionPolicy
    from kvtier.policy.config import PolicyConfig

log = logging.getLogger(__name__)


class TieredConnector:
    def __init__(
        self,
        tiers: TiersConfig,
        policy: str | RetentionPolicy = "retain",
        policy_config: PolicyConfig | None = None,
    ) -> None:
        self.config = tiers
        self.policy = policy
        self.policy_config = policy_config
        self.counters: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter({source: 0 for source in SOURCES})
        self._closed = False

    def bind(self, context: EngineContext) -> None:
        config = self.config
        if context.kv_quant is not None:
            # a packed pool's blocks are quantized already; chunks here are stored and
            # restored as full-precision blocks, which would quantize them twice
            raise KvtierError(
                "kv_quant with tiers is not supported yet: the tiered connector copies "
                "full-precision blocks; use kv_quant=None with tiers"
            )
        if config.chunk_tokens % context.block_size:
            raise KvtierError(
                f"tiers.chunk_tokens={config.chunk_tokens} must be a multiple of "
                f"block_size={context.block_size}"
            )
        self.context = context
        self.block_pool = context.block_pool
        self.block_size = context.block_size
        self.blocks_per_chunk = config.chunk_tokens // self.block_size
        port = context.kv_port
        self.chunk_forms = ChunkForms(port.block_shape, port.dtype)
        self.bytes_per_block = self.chunk_forms.nbytes(1, FULL)
        forms = config.tier_forms()
        slot = self.chunk_forms.nbytes(1, forms["host"])
        # Layered records only where they will be read a layer at a time: this engine's
        # forward waits per layer (`layer_ready`), and the pipeline is asked for.
        layered = config.restore_pipeline == "layer" and context.layer_hook
        if config.restore_pipeline == "layer" and not layered:
            log.info("restore_pipeline='layer': this engine restores whole chunks (no layer hook)")
        tiers = build_backends(config.storage(host_slot_bytes=slot, layered=layered))
        # tier -> the quantized form its chunks are stored in (the worker encodes on the way in)
        self.tier_forms = {t.name: forms[t.name] for t in tiers if forms[t.name] != FULL}
        names = {t.name for t in tiers}
        # a disk tier that outlives the process gets what memory would lose with it
        self.persistent = config.disk_persist and DISK in names
        copies = self.persistent and HOST in names and config.disk_copy == "on_write"
        self.store = TieredStore(
            tiers,
            block_tokens=self.block_size,
            chunk_tokens=config.chunk_tokens,
            forms=self.tier_forms,
            recode=self.chunk_forms.recode,
            copy_to={HOST: DISK} if copies else None,
        )
        self.store.recover()  # what a persistent disk tier and Redis kept from earlier runs
        self.mover = Mover(self.store, spill_queue=config.spill_queue, retries=config.retries)
        self.writes = BackgroundWrites(self.mover, self.store.order[0])
        self.chunks = Chunks(
            self.block_size,
            self.blocks_per_chunk,
            self.block_pool,
            port,
            self.store,
            self.writes,
            self.tier_forms,
        )
        self.runner = PolicyRunner(self, self.policy, self.policy_config)
        # the INT4 decode's kernels compile (or load) in the background before a restore needs them
        self.chunk_forms.prepare({*self.tier_forms.values(), *self.runner.allowed_forms})
        spill = config.spill_on_evict
        spill_on_evict = spill if spill is not None else self.runner.policy.spills_on_evict
        self.spiller = Spiller(self.chunks, spill_on_evict, config.write_through, self.counters)
        self.restorer = Restorer(
            config,
            self.chunks,
            self.store,
            self.mover,
            self.chunk_forms,
            lambda: self.runner.cost_model,
            self.counters,
            self.tokens,
        )
        self.restorer.layered = layered
        self.restorer.prefix_only = not context.loads_after_recompute
        if self.persistent:
            how = "as they are written" if copies else "when demoted"
            log.info(
                "persistent disk tier%s; at close, up to %g s writing to it what memory holds "
                "(tiers.shutdown_flush_s)",
                f": the host's chunks copied to it {how} (tiers.disk_copy)"
                if HOST in names
                else "",
                config.shutdown_flush_s,
            )

    # ----- what the policy runner and tools use ------------------------------------------

    @property
    def write_through(self) -> bool:
        return self.spiller.write_through

    def chunk_keys(self, keys: Sequence[bytes]) -> list[tuple[bytes, ...]]:
        return self.chunks.chunk_keys(keys)

    def locate(self, chunk_id: bytes) -> str | None:
        return self.chunks.locate(chunk_id)

    def locate_form(self, chunk_id: bytes) -> tuple[str, str] | None:
        return self.chunks.locate_form(chunk_id)

    def form_of(self, block_ids: Sequence[int]) -> str:
        return self.chunks.form_of(block_ids)

    def gather(self, block_ids: Sequence[int]) -> tuple[Payload, Callable[[], None]]:
        return self.chunks.gather(block_ids)

    def drop_device_blocks(self, keys: Sequence[bytes]) -> int:
        return self.spiller.drop_device_blocks(keys)

    def free_moved_blocks(self, keys: Sequence[bytes]) -> int:
        """A policy moved these keys' chunk down: free their idle device blocks, or with
        `keep_moved` keep them hittable until the pool needs them."""
        if self.config.keep_moved:
            return self.spiller.keep_device_blocks(keys)
        return self.spiller.drop_device_blocks(keys)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every queued background write; False if some are still running after
        `timeout`. Serving never needs this (reads see writes in flight); tests and
        benchmarks use it to measure a settled state."""
        return self.writes.flush(timeout)

    def clear(self, timeout: float | None = 30.0) -> int:
        """Drop every chunk this process's index holds, in every tier; returns how many.

        For an engine whose weights changed (vLLM's `reset_prefix_cache(reset_connector=True)`
        after a weight update): the stored KV was computed with the old ones. The writes in
        flight land first, so none of the old KV is stored after. A shared tier keeps what
        only other replicas wrote (this index never saw it): each replica clears its own."""
        self.writes.flush(timeout)
        dropped = 0
        for tier in self.store.order:
            for chunk in self.store.chunks_in(tier):
                self.store.delete(chunk)
                dropped += 1
        self.counters["cleared_chunks"] += dropped
        return dropped

    # ----- block events ------------------------------------------------------------------

    def on_block_filled(self, block_id: int, key: bytes) -> None:
        return None

    def on_block_freed(self, block_id: int) -> None:
        return None

    def on_block_evicted(self, block_id: int, key: bytes) -> None:
        self.spiller.on_block_evicted(key)

    # ----- scheduler side ----------------------------------------------------------------

    def on_request_added(self, request: Request) -> None:
        self.restorer.on_request_added(request)

    def num_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int:
        return self.restorer.loadable(request, num_computed_tokens)

    def loadable_sources(self, request: Request) -> dict[str, int]:
        """Where the tokens of the last `num_loadable_tokens` answer come from, per tier."""
        return self.restorer.promised_sources(request.request_id)

    def next_load_position(self, request: Request, after: int) -> int | None:
        return self.restorer.next_position(request, after)

    def on_blocks_allocated(self, request: Request, block_ids: list[int]) -> None:
        self.restorer.allocated(request, block_ids)

    def on_admitted(self, request: Request) -> None:
        self.restorer.on_admitted(request)

    def on_preempted(self, request: Request) -> None:
        """With `swap_on_preempt` the request's computed blocks are spilled when the pool
        reuses them (swap-out), whatever the policy; re-admission loads them back."""
        self.restorer.forget(request.request_id)  # re-planned at re-admission
        if self.config.swap_on_preempt:
            self.spiller.remember(request, swap=True)
            self.counters["preempted_requests"] += 1

    def on_request_finished(self, request: Request) -> None:
        self.restorer.finished(request.request_id)
        keys = self.spiller.remember(request, swap=False)
        namespace = self.chunks.namespace_of(request)
        if self.spiller.write_through:
            reused = None
            if self.spiller.selective:  # the prompt's blocks found computed: seen twice
                reused = (request.num_cached_tokens or 0) // self.block_size
            self.spiller.write_through_chunks(keys, namespace, reused)
        if keys and request.session_id is not None:
            self.runner.remember_session(request.session_id, tuple(keys), namespace)

    # ----- worker side -------------------------------------------------------------------

    def start_loads(self) -> None:
        """Nothing to start: the loads a request will need began when it was queued
        (`on_request_added`'s prefetch); the others are read in `wait_for_loads`."""

    def wait_for_loads(self) -> dict[str, int]:
        return self.restorer.run_loads()

    def layer_ready(self, layer: int) -> None:
        self.restorer.layer_ready(layer)

    def finish_layer_loads(self) -> dict[str, int]:
        return self.restorer.finish_layer_loads()

    def after_step(self) -> None:
        self.writes.reap()
        self.runner.after_step()

    # ----- reporting and lifecycle -------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        self.writes.reap()
        counters = self.counters
        if self.config.keep_moved:  # the pool's own counts, reported beside the connector's
            pool = self.block_pool
            kept = {"kept_blocks": pool.num_kept, "kept_blocks_hit": pool.num_kept_hits}
            counters = Counter({**counters, **kept})
        return connector_stats(
            policy=self.runner.policy_name,
            tokens=self.tokens,
            decisions=self.runner.decisions,
            policy_runs=self.runner.runs,
            counters=counters,
            store=self.store,
            mover=self.mover,
            tier_forms=self.tier_forms,
            writes_in_flight=self.writes.in_flight,
        )

    def num_restore_errors(self) -> int:
        return sum(t.stats.errors for t in self.store.tiers.values())

    def close(self) -> None:
        if self._closed or not hasattr(self, "mover"):
            self._closed = True
            return
        self._closed = True
        if self.persistent and self.config.shutdown_flush_s > 0:
            try:
                flush_to_disk(self, self.config.shutdown_flush_s)
            except Exception:  # what is not written is recomputed after the restart
                log.exception("writing the KV cache to disk before exit failed")
        self.mover.close(drain=False, timeout=1.0)
        for tier in self.store.tiers.values():
            try:
                tier.close()
            except Exception:  # closing must not mask the caller's own error
                log.exception("closing tier %s failed", tier.name)
