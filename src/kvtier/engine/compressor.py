"""Applies a compression pipeline to requests in the engine, so pool memory really shrinks.

When a request's prompt is fully prefilled (its question seen: query-aware), each layer's
keys are scored by the pipeline's presses, which pick the slots every (layer, KV head) keeps
(the same number everywhere, a different set per head allowed). The kept K/V are copied out,
the request's blocks are released and fresh private blocks take the compacted KV
("copy-on-compress": shared or prefix-cached blocks are never overwritten, so other requests
and later prefix hits still see the full prefix). Keys are stored after RoPE, so moving them
needs no re-rotation; the request keeps its logical position for the tokens it generates.

A StreamingLLM press with `keep_tokens` also bounds the cache while decoding: once the
sequence holds a block's worth of slots past the budget it is compacted back to sinks +
recent window, so memory stays constant however long the session runs.
"""

from __future__ import annotations

import torch

from kvtier.compress.config import EVICTION_PRESSES, CompressionConfig
from kvtier.compress.presses.base import EvictionPress, LayerView
from kvtier.compress.presses.kivi import KiviPress
from kvtier.compress.presses.lowrank import LowRankPress
from kvtier.compress.presses.streaming_llm import StreamingLLMPress
from kvtier.compress.recorder import LayerRecord, PrefillRecorder
from kvtier.compress.registry import (
    build_eviction_press,
    build_kivi_press,
    build_lowrank_press,
)
from kvtier.engine.kv_cache_manager import KVCacheManager
from kvtier.engine.kv_pool import KVPool
from kvtier.engine.request import Request
from kvtier.errors import KvtierError


class Compressor:
    def __init__(
        self,
        config: CompressionConfig,
        pool: KVPool,
        kv_manager: KVCacheManager,
        num_heads: int,
    ) -> None:
        self.pool = pool
        self.kv = kv_manager
        self.group = num_heads // pool.num_kv_heads
        self.scale = pool.head_dim**-0.5
        self.presses: list[EvictionPress] = []
        # Quantization applies to whatever the eviction presses keep, wherever it is listed.
        self.kivi: KiviPress | None = None
        # Low rank, like KIVI, rewrites whatever is kept (before KIVI when both are listed).
        self.lowrank: LowRankPress | None = None
        for spec in config.presses:
            if spec.name == "kivi":
                self.kivi = build_kivi_press(spec)
            elif spec.name == "lowrank":
                if not spec.is_identity:
                    self.lowrank = build_lowrank_press(spec)
                    self.lowrank.basis.check_geometry(
                        pool.num_layers, pool.num_kv_heads, pool.head_dim
                    )
            elif spec.name not in EVICTION_PRESSES:
                raise KvtierError(
                    f"press {spec.name!r} is not available in the engine yet "
                    f"(available: {', '.join((*EVICTION_PRESSES, 'kivi', 'lowrank'))})"
                )
            elif not spec.is_identity:
                self.presses.append(build_eviction_press(spec))
        self.decode_bounds = [
            p for p in self.presses if isinstance(p, StreamingLLMPress) and p.keep_tokens
        ]
        self.compressed: set[str] = set()
        window = max((p.query_window for p in self.presses), default=0)
        accumulate = any(p.needs_attention_sum for p in self.presses)
        self.recorder: PrefillRecorder | None = None
        if window > 0 or accumulate:
            self.recorder = PrefillRecorder(
                pool.num_kv_heads,
                pool.head_dim,
                window,
                accumulate,
                is_recording=lambda request_id: request_id not in self.compressed,
            )

    # ----- engine events -------------------------------------------------------------------

    @torch.inference_mode()
    def after_forward(self, request: Request) -> None:
        """Called after each step that computed tokens of `request`."""
        if request.request_id not in self.compressed:
            if request.num_computed_tokens == request.num_tokens:  # prompt fully prefilled
                self.compressed.add(request.request_id)
                self._compress_prompt(request)
        else:
            self._bound_decode(request)

    def forget(self, request_id: str) -> None:
        """The request finished, or was preempted (it will recompute and compress again)."""
        self.compressed.discard(request_id)
        if self.recorder is not None:
            self.recorder.forget(request_id)

    # ----- compaction ----------------------------------------------------------------------

    def _compress_prompt(self, request: Request) -> None:
        records = self.recorder.take(request.request_id) if self.recorder else {}
        num_slots = self.kv.num_slots(request)
        if all(p.budget(num_slots) >= num_slots for p in self.presses):
            quantized = self.kivi is not None and self.kivi.num_quantized(num_slots)
            if quantized or self.lowrank is not None:
                layers, heads = self.pool.num_layers, self.pool.num_kv_heads
                self.compact(request, torch.arange(num_slots).expand(layers, heads, -1))
            return
        table = self.kv.block_table(request.request_id)
        block_table = torch.tensor(table, device=self.pool.device)[None]
        kept = []
        for layer in range(self.pool.num_layers):
            keys, values = self.pool.gather(layer, block_table)
            view = self._view(layer, keys[0, :, :num_slots], values[0, :, :num_slots], records)
            for press in self.presses:
                view = _subset(view, press.select(view, press.budget(view.num_tokens)))
            kept.append(view.key_positions)
        self.compact(request, torch.stack(kept))

    def _bound_decode(self, request: Request) -> None:
        num_slots = self.kv.num_slots(request)
        for press in self.decode_bounds:
            # Compact a block's worth at a time: one copy per `block_size` decode steps.
            if num_slots < press.keep_tokens + self.pool.block_size:
                continue
            keep = press.decode_keep(num_slots)
            if keep is not None:
                layers, heads = self.pool.num_layers, self.pool.num_kv_heads
                # Already-quantized slots are not quantized twice; newer ones stay exact.
                self.compact(request, keep.expand(layers, heads, -1), quantize=False)
                num_slots = self.kv.num_slots(request)

    @torch.inference_mode()
    def compact(self, request: Request, kept_slots: torch.Tensor, quantize: bool = True) -> None:
        """Keep only `kept_slots` [layers, kv_heads, n] (ascending per head) of the request's
        KV, in fresh blocks; the old ones are released (see the module docstring). With a
        KIVI or low-rank press and `quantize`, the kept KV is rewritten on the way."""
        old_table = self.kv.block_table(request.request_id)
        tokens = self.pool.gather_tokens(old_table, kept_slots)
        if self.lowrank is not None and quantize:
            tokens = self.lowrank.apply(tokens)
        if self.kivi is not None and quantize:
            tokens = self.kivi.apply(tokens)
        new_table = self.kv.replace_blocks(request, kept_slots.shape[-1])
        self.pool.write_tokens(new_table, tokens)

    def _view(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        records: dict[int, LayerRecord],
    ) -> LayerView:
        heads, num_tokens, dim = keys.shape
        record = records.get(layer)
        if record is None:
            queries = keys.new_zeros(heads, self.group, 0, dim, dtype=torch.float32)
            positions = torch.zeros(0, dtype=torch.long)
            attention_sum = None
        else:
            queries, positions = record.queries, record.positions
            attention_sum = record.attention_sum
            if attention_sum is not None:
                attention_sum = attention_sum[..., :num_tokens]
        return LayerView(
            layer=layer,
            keys=keys.float(),
            values=values.float(),
            key_positions=torch.arange(num_tokens).expand(heads, -1),
            queries=queries,
            query_positions=positions,
            attention_sum=attention_sum,
            scale=self.scale,
        )


def _subset(view: LayerView, keep: torch.Tensor) -> LayerView:
    """The view restricted to slots `keep` [kv_heads, n] (per head), for the next press."""
    if keep.shape[-1] == view.num_tokens:
        return view
    dim = view.keys.shape[-1]
    index = keep[..., None].expand(-1, -1, dim)
    attention_sum = view.attention_sum
    if attention_sum is not None:
        attention_sum = attention_sum.gather(
            -1, keep[:, None].expand(-1, attention_sum.shape[1], -1)
        )
    return LayerView(
        layer=view.layer,
        keys=view.keys.gather(1, index),
        values=view.values.gather(1, index),
        key_positions=view.key_positions.gather(1, keep),
        queries=view.queries,
        query_positions=view.query_positions,
        attention_sum=attention_sum,
        scale=view.scale,
    )
