"""QuantizedKVPool: the device KV pool stored packed (INT8 / INT4 / INT2), KIVI's axes.

What `EngineConfig.kv_quant` selects, like vLLM's `kv_cache_dtype`: the pool's storage form
is fixed when the engine starts, and a block takes 1/1.68 (INT8), 1/2.91 (INT4) or 1/4.57
(INT2) of its bfloat16 bytes (SmolLM2, 16-token blocks, value groups of 32: `packed.nbytes`
over `num_blocks`, tests/engine/test_quant_pool.py), so the same `kv_cache_bytes` holds
that many times as many blocks, less the full-precision tails below.

Every FULL block is stored packed: keys per channel over the block's 16 tokens (KIVI: key
outliers live in fixed channels), values per token over groups of `value_group` channels,
each group with a float16 minimum and step (rounded outward: every value within half a
step, `compress/quant.py`). A sequence's last, not yet full block stays in full precision in
a small staging area (KIVI's residual window: 0-15 recent tokens here; a key group needs all
of its block's tokens before it can be quantized). Staging holds one block per sequence the
scheduler may run (`max_num_seqs`) and is paid for out of the same budget.

What attention reads follows KIVI: a step's attention sees the blocks written in that same
step in full precision (the plan's scratch copy: a prefill chunk attends to itself exactly,
as KIVI's prefill does), and everything written in earlier steps as stored: dequantized
(vectorised over blocks, heads and tokens), the staged tail exact. A block is quantized in
the layer pass that fills its last slot. So a prefix-cache hit computes exactly what a miss
computes when its prefill was chunked at the same block boundary; a one-chunk miss read its
own prompt exactly (measured: with an INT4 pool, prompt logits read back as stored at every
position agree with full precision on the top token 89% of the time, 96% with this rule and
32-token chunks; SmolLM2, 300 tokens of English).

Layout: one uint8 slab per block (`packed[num_blocks, bytes_per_block]`: a spill or a restore
of a block is one memcpy), holding six fields, each all layers deep:
    key codes [L, H, bs / per_byte, D]     key minimum, step   float16 [L, H, 1, D]
    value codes [L, H, bs, D / per_byte]   value minimum, step float16 [L, H, bs, D / group]
Codes are packed split-halves (`quant.pack_split`), so unpacking is a concatenation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvtier.compress.quant import group_scales, pack_split, to_codes, unpack_split
from kvtier.engine.device_copy import device_index
from kvtier.engine.hooks import BlockCodec, IdentityCodec
from kvtier.engine.kv_pool import token_vector_index, zeros
from kvtier.errors import KvtierError

KV_QUANT_BITS = {"int8": 8, "int4": 4, "int2": 2}
_IDENTITY = IdentityCodec()
_FIELDS = ("key_codes", "key_min", "key_step", "value_codes", "value_min", "value_step")


@dataclass
class WritePlan:
    """Where one step's new K/V go (built once per step, shared by every layer).

    Tokens of blocks this step fills completely go to `scratch` (full precision, all layers)
    and are quantized into the pool layer by layer; tokens of blocks still partial after the
    step go to their staging slot. Rows index the step's K flattened to [tokens * heads, D].
    """

    staged_rows: torch.Tensor
    staged_index: torch.Tensor  # vector index in staging, layer 0's K
    filled_rows: torch.Tensor
    filled_index: torch.Tensor  # vector index in scratch, layer 0's K
    filled_blocks: torch.Tensor  # block ids, one per scratch row
    scratch: torch.Tensor  # [len(filled_blocks), L, 2, H, bs, D]


class _Paste(NamedTuple):
    """Index tensors of `QuantizedKVPool._paste_index` (None: nothing to paste)."""

    staged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    filled: tuple[torch.Tensor, ...] | None


class QuantizedKVPool:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device,
        budget_bytes: int,
        kv_quant: str,
        value_group: int = 32,
        staging_blocks: int = 64,
    ) -> None:
        if kv_quant not in KV_QUANT_BITS:
            raise KvtierError(
                f"kv_quant must be one of {', '.join(KV_QUANT_BITS)} or None, got {kv_quant!r}"
            )
        self.bits = bits = KV_QUANT_BITS[kv_quant]
        per_byte = 8 // bits
        if block_size % per_byte or head_dim % per_byte:
            raise KvtierError(
                f"kv_quant={kv_quant} packs {per_byte} codes per byte: block_size "
                f"({block_size}) and head_dim ({head_dim}) must be multiples of {per_byte}"
            )
        if value_group < 1 or head_dim % value_group:
            raise KvtierError(
                f"kv_quant_group must divide head_dim={head_dim}, got {value_group!r}"
            )
        self.form = f"kivi{bits}-g{value_group}"
        self.block_shape = torch.Size((num_layers, 2, num_kv_heads, block_size, head_dim))
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.head_dim, self.block_size, self.dtype = head_dim, block_size, dtype
        self.value_group = value_group
        self.device = torch.device(device)
        layers, h, bs, d = num_layers, num_kv_heads, block_size, head_dim
        shapes = {
            "key_codes": ((layers, h, bs // per_byte, d), torch.uint8),
            "key_min": ((layers, h, 1, d), torch.float16),
            "key_step": ((layers, h, 1, d), torch.float16),
            "value_codes": ((layers, h, bs, d // per_byte), torch.uint8),
            "value_min": ((layers, h, bs, d // value_group), torch.float16),
            "value_step": ((layers, h, bs, d // value_group), torch.float16),
        }
        offsets, offset = {}, 0
        for name in _FIELDS:
            shape, field_dtype = shapes[name]
            offsets[name] = offset
            offset += math.prod(shape) * field_dtype.itemsize
        self.bytes_per_block = offset
        self.full_bytes_per_block = self.block_shape.numel() * dtype.itemsize
        self.staging_bytes = staging_blocks * self.full_bytes_per_block
        self.num_blocks = (budget_bytes - self.staging_bytes) // self.bytes_per_block
        if self.num_blocks < 1:
            raise KvtierError(
                f"kv_cache_bytes={budget_bytes} cannot hold the full-precision tails of "
                f"max_num_seqs={staging_blocks} sequences ({self.staging_bytes} bytes) plus "
                f"one packed block ({self.bytes_per_block} bytes); raise kv_cache_bytes or "
                "lower max_num_seqs"
            )
        self.packed = zeros((self.num_blocks, self.bytes_per_block), torch.uint8, self.device)
        self.fields = {}
        for name in _FIELDS:
            shape, field_dtype = shapes[name]
            nbytes = math.prod(shape) * field_dtype.itemsize
            raw = self.packed[:, offsets[name] : offsets[name] + nbytes]
            self.fields[name] = raw.view(field_dtype).view(self.num_blocks, *shape)
        # Full-precision tails: staging slot s holds the partial block `_staged_block[s]`.
        self.staging = zeros((staging_blocks, *self.block_shape), dtype, self.device)
        self._slot_of = torch.full((self.num_blocks,), -1, dtype=torch.long)
        self._slot_of_device = self._slot_of.to(self.device)
        self._staged_block: dict[int, int] = {}  # slot -> block
        self._free_slots = list(range(staging_blocks))
        # block table -> where gather pastes staged tails and this step's filled blocks
        # (see `_paste_index`); emptied whenever the slots or the step change.
        self._paste: dict[tuple[int, int], tuple[torch.Tensor, _Paste]] = {}
        # Whether a block still has an owner; set by the engine (its BlockPool's refcounts).
        # A partial block whose request finished leaves a stale staging slot, reclaimed
        # when the slots run out.
        self.block_in_use: Callable[[int], bool] = lambda block_id: True
        self._kv_stride = num_kv_heads * block_size
        self._layer_stride = 2 * self._kv_stride

    @property
    def capacity_bytes(self) -> int:
        """Bytes of KV this pool holds: the packed blocks plus the staging tails."""
        return self.num_blocks * self.bytes_per_block + self.staging_bytes

    def buffers(self) -> list[torch.Tensor]:
        """The tensors holding the pool's memory (what `engine.prefault` faults in)."""
        return [self.packed, self.staging]

    @property
    def num_staged(self) -> int:
        return len(self._staged_block)

    def is_staged(self, block_id: int) -> bool:
        """The block is partial and held in full precision (not yet quantized)."""
        return int(self._slot_of[block_id]) >= 0

    # ----- writes ------------------------------------------------------------------------

    def plan_writes(self, block_ids: torch.Tensor, offsets: torch.Tensor) -> WritePlan:
        """Plan a step's writes (tokens in sequence order, so a block that gets its last
        slot written this step is full afterwards)."""
        h = self.num_kv_heads
        self._paste.clear()  # a new step: new tables and plan
        filled = torch.unique(block_ids[offsets == self.block_size - 1])
        is_filled = torch.isin(block_ids, filled)
        scratch = torch.zeros(
            (len(filled), *self.block_shape), dtype=self.dtype, device=self.device
        )
        # A filled block may have older tokens staged from earlier steps: carry them over
        # and free the slot now, so the same sequence's new tail can take it.
        for row, block_id in enumerate(filled.tolist()):
            slot = int(self._slot_of[block_id])
            if slot >= 0:
                scratch[row] = self.staging[slot]
                self._unstage(block_id)
        partial = torch.unique(block_ids[~is_filled]).tolist()
        for block_id in partial:
            self._stage(block_id, keep=partial)
        self._sync_slots()
        token_rows = torch.arange(len(block_ids))
        staged_tokens = token_rows[~is_filled]
        filled_tokens = token_rows[is_filled]
        heads = torch.arange(h)
        return WritePlan(
            staged_rows=(staged_tokens[:, None] * h + heads).reshape(-1).to(self.device),
            staged_index=token_vector_index(
                self._slot_of[block_ids[staged_tokens]], offsets[staged_tokens], self.block_shape
            ).to(self.device),
            filled_rows=(filled_tokens[:, None] * h + heads).reshape(-1).to(self.device),
            filled_index=token_vector_index(
                torch.searchsorted(filled, block_ids[filled_tokens]),
                offsets[filled_tokens],
                self.block_shape,
            ).to(self.device),
            filled_blocks=filled.to(self.device),
            scratch=scratch,
        )

    def write_slots(
        self, layer: int, plan: WritePlan, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store one layer's K/V of the step's new tokens ([N, kv_heads, head_dim] each).
        Blocks the step fills are quantized into the pool now; this step's attention still
        reads them from the plan's full-precision scratch (`gather(..., plan)`)."""
        d = self.head_dim
        keys, values = key.reshape(-1, d), value.reshape(-1, d)
        shift = layer * self._layer_stride
        for rows, index, target in (
            (plan.staged_rows, plan.staged_index, self.staging),
            (plan.filled_rows, plan.filled_index, plan.scratch),
        ):
            if rows.numel():
                vectors = target.view(-1, d)
                vectors.index_copy_(0, index + shift, keys.index_select(0, rows))
                vectors.index_copy_(
                    0, index + shift + self._kv_stride, values.index_select(0, rows)
                )
        if plan.filled_blocks.numel():
            self._store(plan.filled_blocks, plan.scratch[:, layer], layer)

    def write_tokens(self, block_table: list[int], tokens: torch.Tensor) -> None:
        """Fill a sequence's first slots, in order, from [layers, 2, kv_heads, n, head_dim]
        (compaction): whole blocks are quantized, a trailing partial block is staged."""
        n = tokens.shape[3]
        num_full, rest = divmod(n, self.block_size)
        num_blocks = num_full + (rest > 0)
        padded = tokens.new_zeros(*tokens.shape[:3], num_blocks * self.block_size, self.head_dim)
        padded[:, :, :, :n] = tokens
        shaped = padded.view(*tokens.shape[:3], num_blocks, self.block_size, self.head_dim)
        blocks = shaped.permute(3, 0, 1, 2, 4, 5).to(self.dtype)  # [nb, L, 2, H, bs, D]
        ids = block_table[:num_blocks]
        if num_full:
            self._store_blocks(ids[:num_full], blocks[:num_full])
        if rest:
            self._stage(ids[-1], keep=ids)
            self._sync_slots()
            self.staging[int(self._slot_of[ids[-1]])] = blocks[-1]

    def write_block(
        self, block_id: int, payload: torch.Tensor, codec: BlockCodec = _IDENTITY
    ) -> None:
        """Fill one (full) block from a payload in the codec's form: this pool's own form
        is copied as it is, any other is decoded and quantized."""
        if codec.form == self.form:
            self.packed[block_id].copy_(payload.reshape(-1))
        else:
            full = codec.decode(payload, self.block_shape, self.dtype)
            self._store_blocks([block_id], full[None])
        if self.is_staged(block_id):
            self._unstage(block_id)
            self._sync_slots()

    # ----- reads -------------------------------------------------------------------------

    def gather(
        self, layer: int, block_tables: torch.Tensor, plan: WritePlan | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer for `block_tables` [B, nb], dequantized into the model
        dtype, with the staged tails pasted in, and, given the step's `plan`, the blocks
        this step filled in full precision: each [B, kv_heads, nb * bs, D]."""
        b, nb = block_tables.shape
        h, bs, d, g = self.num_kv_heads, self.block_size, self.head_dim, self.value_group
        index = block_tables.reshape(-1)

        def take(name: str) -> torch.Tensor:
            # [B * nb, H, ...] -> [B, H, nb, ...]: the head-major order attention reads.
            rows = self.fields[name][:, layer].index_select(0, index)
            return rows.view(b, nb, *rows.shape[1:]).transpose(1, 2)

        key = _affine(
            unpack_split(take("key_codes"), self.bits, dim=3),  # [B, H, nb, bs, D]
            take("key_min"),
            take("key_step"),
            self.dtype,
        )
        value_codes = unpack_split(take("value_codes"), self.bits, dim=4)
        value = _affine(
            value_codes.unflatten(-1, (-1, g)),  # [B, H, nb, bs, D / g, g]
            take("value_min")[..., None],
            take("value_step")[..., None],
            self.dtype,
        ).view(b, h, nb, bs, d)
        paste = self._paste_index(block_tables, plan)
        if paste.staged is not None:
            seq, pos, slots = paste.staged
            staged = self.staging[slots, layer]  # [n, 2, H, bs, D]
            key[seq, :, pos] = staged[:, 0]
            value[seq, :, pos] = staged[:, 1]
        if plan is not None and paste.filled is not None:
            seq, pos, row = paste.filled
            key[seq, :, pos] = plan.scratch[row, layer, 0]
            value[seq, :, pos] = plan.scratch[row, layer, 1]
        return key.view(b, h, nb * bs, d), value.view(b, h, nb * bs, d)

    def _paste_index(self, block_tables: torch.Tensor, plan: WritePlan | None) -> _Paste:
        """Where `gather` pastes full-precision blocks into these tables: (sequence, block
        position, staging slot) of staged tails, (sequence, position, scratch row) of the
        blocks `plan` fills. The same for every layer of a step, so found once per table and
        step: `nonzero` waits for the device, which per layer would stall a GPU's queue."""
        cache_key = (id(block_tables), id(plan))
        hit = self._paste.get(cache_key)
        if hit is not None and hit[0] is block_tables:
            return hit[1]
        staged = filled = None
        if self._staged_block:
            slots = self._slot_of_device[block_tables.reshape(-1)].view(block_tables.shape)
            seq, pos = (slots >= 0).nonzero(as_tuple=True)
            if seq.numel():
                staged = (seq, pos, slots[seq, pos])
        if plan is not None and plan.filled_blocks.numel():
            found = (block_tables[..., None] == plan.filled_blocks).nonzero(as_tuple=True)
            if found[0].numel():
                filled = found
        paste = _Paste(staged, filled)
        self._paste[cache_key] = (block_tables, paste)  # the table kept: its id stays its own
        return paste

    def gather_tokens(self, block_table: list[int], slots: torch.Tensor) -> torch.Tensor:
        """Copy out chosen slots of one sequence: `slots` [layers, kv_heads, n] (each layer
        and head may pick different slots) -> [layers, 2, kv_heads, n, head_dim]."""
        full = self._read_blocks(torch.tensor(block_table, device=self.device))
        # [nb, L, 2, H, bs, D] -> [L, 2, H, nb * bs, D]
        full = full.permute(1, 2, 3, 0, 4, 5).reshape(*self.block_shape[:3], -1, self.head_dim)
        index = slots.to(self.device)[:, None, :, :, None]
        return full.gather(3, index.expand(-1, 2, -1, -1, self.head_dim))

    def read_block(self, block_id: int, codec: BlockCodec = _IDENTITY) -> torch.Tensor:
        """A copy of one block in the codec's form: this pool's own form is the packed
        bytes as they are (no re-quantization), any other is encoded from the
        dequantized block."""
        if codec.form == self.form and not self.is_staged(block_id):
            return self.packed[block_id].clone()
        full = self._read_blocks(torch.tensor([block_id], device=self.device))[0]
        return codec.encode(full)

    def read_blocks(
        self, block_ids: Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """These blocks dequantized, [n, *block_shape] (the connector's block port)."""
        blocks = self._read_blocks(device_index(block_ids, self.device))
        if out is None:
            return blocks
        out.copy_(blocks)
        return out

    def write_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Quantize [n, *block_shape] into these (full) blocks."""
        with torch.inference_mode():
            self._store_blocks(list(block_ids), blocks.to(self.device, self.dtype))

    def block_view(self, block_ids: Sequence[int]) -> None:
        """None: packed blocks are no full-precision bytes to read into (`write_blocks`)."""
        return None

    # ----- internals ---------------------------------------------------------------------

    def _read_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Dequantized blocks, staged ones as staged: [n, L, 2, H, bs, D]."""
        fields = {name: field.index_select(0, block_ids) for name, field in self.fields.items()}
        blocks = _dequantize(self, fields, self.dtype)
        slots = self._slot_of_device[block_ids]
        staged = (slots >= 0).nonzero(as_tuple=True)[0]
        if staged.numel():
            blocks[staged] = self.staging[slots[staged]]
        return blocks

    def encode(self, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
        """Quantize full-precision blocks [..., 2, H, bs, D] into the six fields."""
        x = blocks.float()
        keys, values = x.select(-4, 0), x.select(-4, 1)  # [..., H, bs, D]
        key_min, key_step = group_scales(
            keys.amin(-2, keepdim=True), keys.amax(-2, keepdim=True), self.bits
        )
        key_codes = to_codes(keys, key_min, key_step, self.bits)
        grouped = values.unflatten(-1, (-1, self.value_group))  # [..., H, bs, D / g, g]
        value_min, value_step = group_scales(
            grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True), self.bits
        )
        value_codes = to_codes(grouped, value_min, value_step, self.bits).flatten(-2)
        return {
            "key_codes": pack_split(key_codes, self.bits, dim=-2),
            "key_min": key_min,
            "key_step": key_step,
            "value_codes": pack_split(value_codes, self.bits, dim=-1),
            "value_min": value_min[..., 0],
            "value_step": value_step[..., 0],
        }

    def _store(self, block_ids: torch.Tensor, blocks: torch.Tensor, layer: int) -> None:
        """Quantize one layer of blocks ([n, 2, H, bs, D]) into the pool."""
        for name, part in self.encode(blocks).items():
            self.fields[name][:, layer].index_copy_(0, block_ids, part)

    def _store_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Quantize whole blocks ([n, L, 2, H, bs, D]) into the pool."""
        index = device_index(block_ids, self.device)
        for name, part in self.encode(blocks).items():
            self.fields[name].index_copy_(0, index, part)
        for block_id in block_ids:
            if self.is_staged(block_id):
                self._unstage(block_id)
        self._sync_slots()

    def _stage(self, block_id: int, keep: list[int]) -> None:
        """Give a partial block a staging slot (if it has none), reclaiming the slots of
        blocks nobody owns any more when none is free; `keep` are blocks being written."""
        if self.is_staged(block_id):
            return
        if not self._free_slots:
            for stale in list(self._staged_block.values()):
                if stale not in keep and not self.block_in_use(stale):
                    self._unstage(stale)
        if not self._free_slots:
            raise RuntimeError("staging full: more partial blocks than max_num_seqs")
        slot = self._free_slots.pop()
        self._slot_of[block_id] = slot
        self._staged_block[slot] = block_id

    def _unstage(self, block_id: int) -> None:
        slot = int(self._slot_of[block_id])
        self._slot_of[block_id] = -1
        del self._staged_block[slot]
        self._free_slots.append(slot)

    def _sync_slots(self) -> None:
        self._paste.clear()
        if self._slot_of_device is not self._slot_of:  # a copy on the accelerator
            # From a pinned snapshot, without blocking: a copy from pageable memory would
            # synchronise the stream at every step that stages a block.
            self._slot_of_device.copy_(self._slot_of.pin_memory(), non_blocking=True)


class PackedBlockCodec:
    """The `BlockCodec` of a packed pool's own form: a payload is a block's packed bytes,
    so a tier stores and restores them without re-quantizing (`read_block` /
    `write_block` with this codec are plain copies)."""

    def __init__(self, pool: QuantizedKVPool) -> None:
        self.pool = pool
        self.form = pool.form

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        parts = self.pool.encode(block.to(self.pool.device)[None])
        return torch.cat([parts[name].reshape(-1).view(torch.uint8) for name in _FIELDS])

    def decode(self, payload: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        raw = payload.reshape(1, -1).to(self.pool.device)
        fields, offset = {}, 0
        for name in _FIELDS:
            like = self.pool.fields[name]
            nbytes = math.prod(like.shape[1:]) * like.element_size()
            fields[name] = (
                raw[:, offset : offset + nbytes].view(like.dtype).view(1, *like.shape[1:])
            )
            offset += nbytes
        return _dequantize(self.pool, fields, dtype)[0].reshape(shape)


def _dequantize(
    pool: QuantizedKVPool, fields: dict[str, torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """Blocks from their six fields ([n, L, ...] each) -> [n, L, 2, H, bs, D] in `dtype`,
    computed as `gather` computes them (float32 minimum + code x step, then rounded)."""
    keys = _affine(
        unpack_split(fields["key_codes"], pool.bits, dim=-2),
        fields["key_min"],
        fields["key_step"],
        dtype,
    )
    value_codes = unpack_split(fields["value_codes"], pool.bits, dim=-1)
    values = _affine(
        value_codes.unflatten(-1, (-1, pool.value_group)),
        fields["value_min"][..., None],
        fields["value_step"][..., None],
        dtype,
    ).flatten(-2)
    return torch.stack((keys, values), dim=2)


def _affine(
    codes: torch.Tensor, minimum: torch.Tensor, step: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """minimum + codes x step in float32 (as quant.dequantize), then in `dtype`. Separate
    float32 passes: one addcmul from uint8 straight into bfloat16 took 10x longer on CPU."""
    dense = {"dtype": torch.float32, "memory_format": torch.contiguous_format}
    values = codes.to(**dense)
    # Dense scales: broadcasting strided ones (gathered [B, H, nb, ...] views) was 3x slower.
    torch.addcmul(minimum.to(**dense), values, step.to(**dense), out=values)
    return values.to(dtype)
