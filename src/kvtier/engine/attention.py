"""Paged attention over the block pool with `scaled_dot_product_attention`.

Per layer: the step's new K/V are written into their pool slots, then each query attends to
its sequence's blocks. Decodes (one query each) read K/V straight from the pool where
`PagedAttention.pages_decode` (engine/paged_decode.py); otherwise all go through ONE padded
SDPA call over K/V gathered out of the pool, with a
length mask. A prefill chunk on CPU (bf16 and float32) is, per 512-position stretch counted
from position 0, two flash-attention calls merged by their log-sum-exp: its queries against
the keys before the stretch (all visible: no mask at all) and against the stretch's keys (a
square, so plain `is_causal` skips the future half); see `_prefill_split` (bf16 with
head_dim 64 on an AVX512_BF16 CPU: both calls by the kernel of engine/prefill_attention.py
instead of torch's flash attention, unless `EngineConfig.prefill_attention` names torch's).
Elsewhere, or
when an observer must see the chunk's keys, the chunk is split along the query axis with
additive causal masks, so that query rows never multiply against keys that lie in their
future (a causal mask alone still pays for those products).

In deterministic mode (`EngineConfig.deterministic`) every row of a step, decode or prefill,
takes one call of `prefill_attention.paged_attention` per layer instead: each row against its
own sequence's keys [0, its position] read through the block tables, in pieces of 512 keys
from key 0 folded in key order, by the same arithmetic whatever the row is (no stretches
counted from a chunk), so KV written by a decode equals KV recomputed by a prefill, bit for
bit.

Grouped-query attention is folded rather than repeated: the query heads sharing a KV head
are stacked along the query axis ([B, kv_heads, group * q_len, D]), so K/V are read once per
KV head instead of being copied `group` times.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from kvtier.engine import prefill_attention
from kvtier.engine.hooks import AttentionObserver
from kvtier.engine.kv_pool import KVPool, SlotPlan
from kvtier.engine.quant_pool import QuantizedKVPool, WritePlan
from kvtier.errors import KvtierError

# Where `PagedAttention._prefill_split` cuts a prompt's positions, counted from position 0:
# the scheduler's default chunk (`EngineConfig.max_num_batched_tokens`), so that a prompt
# prefilled alone is cut only where its chunks end anyway.
SPLIT_ALIGN = 512


@dataclass
class QueryChunk:
    """Rows [start, end) of a prefill span attending to the first `key_len` positions."""

    start: int
    end: int
    key_len: int
    mask: torch.Tensor  # [group * (end - start), key_len] additive (0 / -inf), folded


@dataclass
class PrefillSpan:
    request_id: str
    token_start: int  # rows of the flat batch
    token_end: int
    block_table: torch.Tensor  # [1, num_blocks]
    context_len: int  # keys visible to the span's last query (its position + 1)
    chunks: list[QueryChunk]  # empty when `PagedAttention.splits_prefill` (no masks needed)

    @property
    def past_len(self) -> int:
        """Positions before the span: computed by earlier steps (or a prefix hit)."""
        return self.context_len - (self.token_end - self.token_start)


@dataclass
class AttentionMetadata:
    """Where a step's tokens live in the pool and what each one attends to.

    Rows of the flat batch: first `num_decodes` single-token sequences, then prefill spans.
    Built once per step by the runner and shared by all layers.
    """

    # Where the new K/V go: from the pool's `plan_writes` (KVPool: a SlotPlan;
    # QuantizedKVPool: a WritePlan), handed back to its `write_slots` untouched. Set by the
    # runner once all of the step's slots are known.
    slot_index: SlotPlan | WritePlan | None = None
    num_decodes: int = 0
    decode_request_ids: list[str] = field(default_factory=list)
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks], padded
    decode_context_lens: torch.Tensor | None = None  # [B]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * bs] additive
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Deterministic mode's per-sequence view of the step, built by the first layer that
    # needs it (`StepSequences.of`) and shared by the others.
    sequences: StepSequences | None = None


@dataclass(frozen=True)
class StepSequences:
    """The step's rows grouped by sequence, in row order, as `paged_attention` takes them:
    sequence s owns rows row_start[s] .. row_start[s + 1], the first at position
    first_pos[s], its blocks tables[s] (padded with zeros)."""

    tables: torch.Tensor  # [S, width] int64
    row_start: torch.Tensor  # [S + 1] int64
    first_pos: torch.Tensor  # [S] int64

    @classmethod
    def of(cls, meta: AttentionMetadata) -> StepSequences:
        tables: list[torch.Tensor] = []
        rows = [0]
        first: list[int] = []
        if meta.num_decodes:
            assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
            tables.extend(meta.decode_block_tables.cpu())
            first.extend((meta.decode_context_lens.cpu() - 1).tolist())
            rows.extend(range(1, meta.num_decodes + 1))
        for span in meta.prefills:
            tables.append(span.block_table[0].cpu())
            first.append(span.past_len)
            rows.append(span.token_end)
        width = max(len(t) for t in tables)
        padded = torch.zeros(len(tables), width, dtype=torch.int64)
        for i, table in enumerate(tables):
            padded[i, : len(table)] = table
        return cls(padded, torch.tensor(rows), torch.tensor(first))


class PagedAttention:
    def __init__(
        self,
        pool: KVPool | QuantizedKVPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        paged_decode: bool = False,
        deterministic: bool = False,
        prefill_kernel: bool = True,
    ) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.observers: list[AttentionObserver] = []
        # EngineConfig.paged_decode, where the kernel applies and is built: settled here, once,
        # so that no request switches paths midway (bf16 outputs of the two differ in last bits)
        self.paged_decode = paged_decode and self._kernel_applies()
        # EngineConfig.deterministic: the engine checked `deterministic_unavailable` first
        self.deterministic = deterministic
        # `settle_prefill_attention(...) == "kernel"`: bf16 prefill chunks by the kernel of
        # engine/prefill_attention.py; False: by torch's flash attention (`_flash`)
        self.prefill_kernel = prefill_kernel

    def deterministic_unavailable(self) -> str | None:
        """Why deterministic mode cannot serve this pool here (None: it can). Its kernel is
        the prefill kernel's (`prefill_kernel_unavailable`), here reading a plain `KVPool` whose
        blocks hold whole groups of 16 keys."""
        pool = self.pool
        if pool.device.type == "cpu" and type(pool) is not KVPool:
            return "it needs a full-precision KV pool (no kv_quant)"
        if pool.block_size % 16:
            return (
                f"its kernel reads blocks of a multiple of 16 tokens (block_size {pool.block_size})"
            )
        return prefill_kernel_unavailable(pool, self.head_dim)

    @property
    def needs_weights(self) -> bool:
        return any(o.needs_weights for o in self.observers)

    @property
    def splits_prefill(self) -> bool:
        """Whether prefill chunks take `_prefill_split` (then the runner builds no masks).

        It needs the CPU flash kernel's log-sum-exp output, and observers are handed the
        whole span's keys, which this path never gathers. In bf16 the kernel hands back each
        partial output rounded to bf16 before the merge; measured against transformers in
        float32 on two random 1,500-token prompts that costs nothing visible next to bf16's
        own error (`benchmarks/bf16_drift.py`, 2 threads: mean |logit diff| 0.105 / 0.106
        split, 0.100 / 0.110 masked; top-1 agreement 89.4% / 91.9% split, 89.9% / 90.9%
        masked)."""
        return self.pool.device.type == "cpu" and not self.observers

    def _kernel_applies(self) -> bool:
        """Whether `engine/paged_decode.py` can serve this pool: on the CPU, a plain `KVPool`
        (not the packed `QuantizedKVPool`) of the shapes and dtypes `paged_decode.fits`, with
        its C++ kernel built (a C++ compiler at hand; built or loaded from the cache here)."""
        if self.pool.device.type != "cpu" or type(self.pool) is not KVPool:
            return False
        from kvtier.engine import paged_decode

        fits = paged_decode.fits(self.pool.dtype, self.head_dim, self.pool.block_size)
        return fits and paged_decode.available()

    @property
    def pages_decode(self) -> bool:
        """Whether decodes read K/V straight from the pool (`engine/paged_decode.py`: no
        gather, no padded copy) rather than gather + one padded SDPA call: when asked for
        (`EngineConfig.paged_decode`) and where the kernel applies; observers are handed the
        gathered keys, so not with them."""
        return self.paged_decode and not self.observers

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [N, heads, D], k/v [N, kv_heads, D] -> attention output [N, heads * D]."""
        self.pool.write_slots(layer, meta.slot_index, k, v)
        if self.deterministic:
            if meta.sequences is None:
                meta.sequences = StepSequences.of(meta)
            seqs = meta.sequences
            out = prefill_attention.paged_attention(
                q, self.pool.kv, layer, seqs.tables, seqs.row_start, seqs.first_pos, self.scale
            ).to(q.dtype)
            return out.view(q.shape[0], self.num_heads * self.head_dim)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd and self.pages_decode:
            from kvtier.engine import paged_decode

            out[:nd] = paged_decode.decode_attention(
                self.pool.kv,
                layer,
                q[:nd],
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.scale,
                torch.get_num_threads(),  # torch's own OpenMP threads: see `paged_decode`
            )
        elif nd:
            key, value = self.pool.gather(layer, meta.decode_block_tables, meta.slot_index)
            q_dec = q[:nd].unsqueeze(1)
            o = self._attend(
                layer,
                meta.decode_request_ids,
                q_dec,
                key,
                value,
                meta.decode_mask,
                meta.decode_context_lens,
            )
            out[:nd] = o[:, 0]
        for span in meta.prefills:
            if not span.chunks:
                rows = slice(span.token_start, span.token_end)
                out[rows] = self._prefill_split(layer, q[rows], k[rows], v[rows], span, meta)
                continue
            key, value = self.pool.gather(layer, span.block_table, meta.slot_index)
            # On the host: a per-layer copy to a GPU would synchronise (only observers read it).
            key_lens = torch.tensor([span.context_len])
            for chunk in span.chunks:
                rows = slice(span.token_start + chunk.start, span.token_start + chunk.end)
                o = self._attend(
                    layer,
                    [span.request_id],
                    q[rows].unsqueeze(0),
                    key[:, :, : chunk.key_len],
                    value[:, :, : chunk.key_len],
                    chunk.mask,
                    key_lens,
                )
                out[rows] = o[0]
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _prefill_split(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        span: PrefillSpan,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One prefill chunk, q [n, heads, D], k/v [n, kv_heads, D] -> [n, heads, D].

        Positions are cut at fixed `SPLIT_ALIGN` boundaries counted from position 0, not at
        the chunk's edges: a query at position p in the stretch [a, a + SPLIT_ALIGN) attends
        to [a, p] in a square causal call over [a, end of the chunk's part of that stretch)
        and to [0, a) in one unmasked call, the two merged by their log-sum-exp (softmax over
        the union = the two partial outputs weighted by exp(their lse - the union's)). So
        where the chunk starts (a prefix hit, a restore, a budget shared with decodes) does
        not move the split: a chunk starting inside a stretch takes the stretch's earlier
        keys from the pool and pads its queries in front with zero rows (discarded). The
        same prompt alone and after a prefix hit then gives the same bits, which the server
        tests hold it to (splitting at the chunk's start did not). Measured on this CPU, 1
        thread, the last 512-token chunk of an 8K prompt, one layer: 63 ms instead of 110 ms
        for masked 256-row sub-chunks, and no masks to build (12 MB each at 8K).

        bf16 with head_dim 64 on a CPU with AVX512_BF16 takes the kernel of
        engine/prefill_attention.py for both calls instead of `_flash` (which runs bf16 at
        float32 speed there, without AMX tiles): ~2x faster on them
        (benchmarks/prefill_attention.py), float32 partial outputs, and each row's bits
        independent of the rows beside it, so it needs no zero queries in front (the
        stretch's earlier keys still come from the pool). `prefill_kernel` False keeps
        `_flash` (on a CPU with AMX, torch packs K/V for its tiles in calls of at least 64
        queries and keys).
        """
        n = q.shape[0]
        start = span.past_len  # position of the chunk's first row
        stops = list(range((start // SPLIT_ALIGN + 1) * SPLIT_ALIGN, start + n, SPLIT_ALIGN))
        edges = [start, *stops, start + n]
        # Keys needed from the pool: [0, a) of every piece, and [a, start) of the first;
        # this step's K/V are already written there.
        from_pool = max(stops[-1] if stops else 0, start)
        key = value = None
        if from_pool:
            table = span.block_table[:, : -(-from_pool // self.pool.block_size)]
            key, value = self.pool.gather(layer, table, meta.slot_index)
        out = torch.empty_like(q)
        kernel = self.prefill_kernel and prefill_attention.fits(q) and prefill_attention.available()
        for lo, hi in itertools.pairwise(edges):
            a = lo // SPLIT_ALIGN * SPLIT_ALIGN
            rows = slice(lo - start, hi - start)
            m = hi - lo
            own_k, own_v = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [kv_heads, m, D]
            if lo > a:  # the stretch's earlier positions
                own_k = torch.cat([key[0, :, a:lo], own_k], dim=1)
                own_v = torch.cat([value[0, :, a:lo], own_v], dim=1)
            # Folded: [kv_heads, group * m, D] is the same memory as [heads, m, D].
            folded = q[rows].transpose(0, 1).reshape(self.num_kv_heads, self.group * m, -1)
            if kernel:
                # bf16 dot products (engine/prefill_attention.py): the square's rows sit at
                # positions lo - a .. of their stretch, no zero rows in front needed
                own, lse = prefill_attention.prefill_attention(
                    folded, own_k, own_v, self.scale, causal_m=m, q_offset=lo - a
                )
            else:
                q_rows = q[rows].transpose(0, 1)  # [heads, m, D]: head h = kv * group + g
                if lo > a:  # zero queries in front of the stretch's earlier positions
                    q_rows = torch.cat(
                        [q_rows.new_zeros(self.num_heads, lo - a, self.head_dim), q_rows], 1
                    )
                own, lse = _flash(
                    q_rows.contiguous()[None],
                    own_k.repeat_interleave(self.group, 0)[None],
                    own_v.repeat_interleave(self.group, 0)[None],
                    is_causal=True,
                )
                own, lse = own[0, :, lo - a :], lse[0, :, lo - a :]  # [heads, m, D], [heads, m]
            own = own.reshape(self.num_heads, m, self.head_dim)
            lse = lse.reshape(self.num_heads, m)
            if a:
                if kernel:
                    past_out, past_lse = prefill_attention.prefill_attention(
                        folded, key[0, :, :a], value[0, :, :a], self.scale
                    )
                else:
                    past_out, past_lse = _flash(folded[None], key[:, :, :a], value[:, :, :a])
                past_out = past_out.reshape(own.shape)
                past_lse = past_lse.reshape(lse.shape)
                total = torch.logaddexp(lse, past_lse)
                merged = own.float() * (lse - total).exp_()[..., None]
                merged += past_out.float() * (past_lse - total).exp_()[..., None]
                own = merged
            out[rows] = own.transpose(0, 1)
        return out

    def _attend(
        self,
        layer: int,
        request_ids: list[str],
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor,
        key_lens: torch.Tensor,
    ) -> torch.Tensor:
        """q [B, L, heads, D]; key/value [B, kv_heads, T, D]; mask folded -> [B, L, heads, D]."""
        b, length = q.shape[:2]
        # [B, L, kv_heads, group, D] -> [B, kv_heads, group * L, D]: head h = kv * group + g.
        qf = q.view(b, length, self.num_kv_heads, self.group, self.head_dim)
        qf = qf.permute(0, 2, 3, 1, 4).reshape(b, self.num_kv_heads, self.group * length, -1)
        weights = None
        if self.needs_weights:
            scores = (qf.float() @ key.float().transpose(-1, -2)) * self.scale
            weights = (scores + mask).softmax(-1)
            o = weights.to(value.dtype) @ value
        else:
            o = F.scaled_dot_product_attention(qf, key, value, attn_mask=mask)
        if self.observers:
            unfolded_q = q.permute(0, 2, 1, 3)
            unfolded_w = None if weights is None else weights.reshape(b, self.num_heads, length, -1)
            for observer in self.observers:
                observer.observe(
                    layer,
                    request_ids,
                    unfolded_q,
                    key,
                    unfolded_w if observer.needs_weights else None,
                    key_lens,
                )
        o = o.view(b, self.num_kv_heads, self.group, length, self.head_dim)
        return o.permute(0, 3, 1, 2, 4).reshape(b, length, self.num_heads, self.head_dim)


def prefill_kernel_unavailable(pool: KVPool | QuantizedKVPool, head_dim: int) -> str | None:
    """Why the kernel of engine/prefill_attention.py cannot compute this pool's prefill
    attention here (None: it can): it reads bf16 pairs with AVX512_BF16 dot products, head_dim
    64, on the CPU."""
    if pool.device.type != "cpu":
        return "it runs on the CPU only"
    if pool.dtype != torch.bfloat16:
        return "it needs dtype bfloat16"
    if head_dim != prefill_attention.DIM:
        return f"it takes head_dim {prefill_attention.DIM} (this model: {head_dim})"
    if not prefill_attention.available():
        return "it needs a CPU with AVX512_BF16 and a C++ compiler (g++ or $CXX)"
    return None


def settle_prefill_attention(
    choice: str, pool: KVPool | QuantizedKVPool, head_dim: int, deterministic: bool = False
) -> Literal["kernel", "torch"]:
    """What computes this pool's bf16 prefill attention: `EngineConfig.prefill_attention`
    where it can run. "auto" is the kernel wherever it runs, AMX CPUs included: it gives a
    position's row the same bits whatever chunk computes it, so KV a short chunk wrote equals
    KV the same history recomputes. torch's flash attention does not promise that on AMX: it
    packs K/V for the tiles only in calls of at least 64 queries and keys and computes
    smaller ones by MKL's gemm. Where the kernel cannot run (every pool that is not bf16 on
    an AVX512_BF16 CPU), "auto" is torch's, and the kernel asked by name is refused with the
    reason. Settled once, at engine start: the two round differently in the last bits, and
    no request may switch midway. Deterministic mode computes every row by its own kernel
    (`deterministic_unavailable` says where it cannot): "kernel" then, and "torch" asked by
    name is refused."""
    if deterministic:
        if choice == "torch":
            raise KvtierError(
                "prefill_attention 'torch' does not combine with deterministic mode, whose "
                "kernel computes every row"
            )
        return "kernel"
    if choice == "torch":
        return "torch"
    why = prefill_kernel_unavailable(pool, head_dim)
    if why is None:
        return "kernel"
    if choice == "kernel":
        raise KvtierError(f"prefill_attention 'kernel' is not available here: {why}")
    return "torch"


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention, [B, H, L, D] -> (output [B, H, L, D], log-sum-exp [B, H, L]
    float32): what `F.scaled_dot_product_attention` runs on CPU, plus the normaliser that
    lets two partial attentions be merged exactly."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=is_causal)
