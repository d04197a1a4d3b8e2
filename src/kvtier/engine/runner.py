"""ModelRunner: turns a scheduled step into tensors, runs the model, returns logits.

Per step, with the loops over requests (never over tokens of a decode):
- flat input ids and positions, decodes first, then prefill spans;
- slot index: where each new token's K/V goes in the pool;
- one padded block table + length mask for all decodes; per prefill span its block table
  and causal masks of its query sub-chunks;
- which rows need logits: the last computed position of a request that reached the end of
  its tokens (it samples), or every row of a request that asked for prompt logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.engine.attention import AttentionMetadata, PrefillSpan, QueryChunk
from kvtier.engine.kv_cache_manager import KVCacheManager, cdiv
from kvtier.engine.kv_pool import KVPool
from kvtier.engine.llama import LlamaModel
from kvtier.engine.quant_pool import QuantizedKVPool
from kvtier.engine.request import Request

# Query rows per SDPA call inside a prefill: small enough that most masked (future) keys
# are skipped, large enough to keep matmuls efficient. 256 measured best on 2 CPU cores
# for 2K-token prompts (52 ms/layer vs 80 ms for one call).
PREFILL_QUERY_CHUNK = 256


@dataclass
class StepResult:
    """Logits of the requests that sample this step (in `sampled` order)."""

    sampled: list[Request]
    logits: torch.Tensor  # [len(sampled), vocab] float32


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        pool: KVPool | QuantizedKVPool,
        kv_manager: KVCacheManager,
        device: str,
    ) -> None:
        self.model = model
        self.pool = pool
        self.kv = kv_manager
        self.block_size = kv_manager.block_size
        self.device = torch.device(device)
        self.group = model.config.num_heads // model.config.num_kv_heads

    @torch.inference_mode()
    def execute(
        self,
        batch: list[tuple[Request, int]],
        layer_ready: Callable[[int], None] | None = None,
    ) -> StepResult:
        """`layer_ready(i)`: called before layer i's attention reads the pool (loads that
        overlap the forward, `KVConnector.layer_ready`)."""
        decodes = [r for r, n in batch if n == 1]
        prefills = [(r, n) for r, n in batch if n > 1]
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_blocks: list[torch.Tensor] = []
        slot_offsets: list[torch.Tensor] = []
        logit_rows = _LogitRows()
        meta = AttentionMetadata()

        if decodes:  # one token each, at position num_computed_tokens
            pos = [r.num_computed_tokens for r in decodes]
            # A compressed request holds fewer KV slots than positions: its new token goes
            # to the next slot but keeps its true position for RoPE.
            slots = [self.kv.slot_of(r, p) for r, p in zip(decodes, pos, strict=True)]
            tables = [self.kv.block_table(r.request_id) for r in decodes]
            for row, (r, p) in enumerate(zip(decodes, pos, strict=True)):
                input_ids.append(r.token_ids[p])
                logit_rows.note(r, p + 1, row, row + 1)
            positions.append(torch.tensor(pos))
            slots_t = torch.tensor(slots)
            bs = self.block_size
            slot_blocks.append(
                torch.tensor([t[s // bs] for t, s in zip(tables, slots, strict=True)])
            )
            slot_offsets.append(slots_t % bs)
            self._decode_metadata(meta, decodes, tables, slots_t + 1)

        row = len(decodes)
        for r, n in prefills:  # a chunk of n tokens starting at num_computed_tokens
            start = r.num_computed_tokens
            table = torch.tensor(self.kv.block_table(r.request_id))
            pos_t = torch.arange(start, start + n)
            input_ids.extend(r.token_ids[start : start + n])
            positions.append(pos_t)
            slot_blocks.append(table[pos_t // self.block_size])
            slot_offsets.append(pos_t % self.block_size)  # never compressed mid-prefill
            meta.prefills.append(self._prefill_span(r, table, row, start, n))
            logit_rows.note(r, start + n, row, row + n)
            row += n

        pos_all = torch.cat(positions)
        meta.slot_index = self.pool.plan_writes(torch.cat(slot_blocks), torch.cat(slot_offsets))
        logits = self.model.forward(
            torch.tensor(input_ids, device=self.device),
            pos_all.to(self.device),
            meta,
            torch.tensor(logit_rows.rows(), dtype=torch.long, device=self.device),
            layer_ready,
        )
        offset = len(logit_rows.sample_rows)
        for r, a, b in logit_rows.score_spans:
            if not r.prompt_logits:
                r.prompt_logits_start = r.num_computed_tokens
            r.prompt_logits.append(logits[offset : offset + b - a].cpu())
            offset += b - a
        return StepResult(sampled=logit_rows.sampled, logits=logits[: len(logit_rows.sampled)])

    def _decode_metadata(
        self,
        meta: AttentionMetadata,
        decodes: list[Request],
        tables: list[list[int]],
        context_lens: torch.Tensor,
    ) -> None:
        """One padded block table and length mask for all single-token sequences."""
        max_blocks = max(len(t) for t in tables)
        padded = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
        for i, table in enumerate(tables):
            padded[i, : len(table)] = torch.tensor(table)
        visible = torch.arange(max_blocks * self.block_size)[None, :] < context_lens[:, None]
        meta.num_decodes = len(decodes)
        meta.decode_request_ids = [r.request_id for r in decodes]
        meta.decode_block_tables = padded.to(self.device)
        meta.decode_context_lens = context_lens.to(self.device)
        meta.decode_mask = self._additive(visible)[:, None, None, :]

    def _prefill_span(
        self, request: Request, table: torch.Tensor, row: int, start: int, n: int
    ) -> PrefillSpan:
        """A prefill chunk: its block table and, unless attention splits prefills itself
        (`PagedAttention.splits_prefill`), the causal masks of its query sub-chunks."""
        return PrefillSpan(
            request_id=request.request_id,
            token_start=row,
            token_end=row + n,
            block_table=table[: cdiv(start + n, self.block_size)][None].to(self.device),
            context_len=start + n,
            chunks=[] if self.model.attention.splits_prefill else self._query_chunks(start, n),
        )

    def _query_chunks(self, start: int, n: int) -> list[QueryChunk]:
        """The causal masks of a prefill chunk's query sub-chunks (masked path)."""
        # An observer asking for weights gets the whole chunk's matrix in one call.
        rows_per_chunk = n if self.model.attention.needs_weights else PREFILL_QUERY_CHUNK
        chunks = []
        for q0 in range(0, n, rows_per_chunk):
            q1 = min(n, q0 + rows_per_chunk)
            key_len = start + q1
            query_pos = torch.arange(start + q0, start + q1)
            visible = torch.arange(key_len)[None, :] <= query_pos[:, None]
            # Folded GQA: each query row appears once per head of its group.
            mask = self._additive(visible.repeat(self.group, 1))
            chunks.append(QueryChunk(start=q0, end=q1, key_len=key_len, mask=mask))
        return chunks

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """0 where visible, -inf elsewhere, in the model dtype: SDPA would otherwise turn a
        boolean mask into this on every call (twice per layer per chunk, 5% of a prefill)."""
        mask = torch.zeros(visible.shape, dtype=self.model.dtype)
        return mask.masked_fill_(~visible, float("-inf")).to(self.device)


class _LogitRows:
    """Which rows of the flat batch need logits, and for what."""

    def __init__(self) -> None:
        self.sample_rows: list[int] = []
        self.sampled: list[Request] = []
        self.score_spans: list[tuple[Request, int, int]] = []

    def note(self, request: Request, computed_after: int, row_start: int, row_end: int) -> None:
        # A request that asked for prompt logits keeps every row of its chunk; one whose
        # tokens are now all computed samples its next token from its last row.
        if request.return_prompt_logits:
            self.score_spans.append((request, row_start, row_end))
        if computed_after == request.num_tokens:
            self.sample_rows.append(row_end - 1)
            self.sampled.append(request)

    def rows(self) -> list[int]:
        return self.sample_rows + [i for _, a, b in self.score_spans for i in range(a, b)]
