"""Group-wise asymmetric integer quantization (INT8 / INT4 / INT2), packed into bytes.

KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024,
arXiv:2402.02750) quantizes keys per channel (a group runs along tokens: key outliers live
in fixed channels) and values per token (a group runs along channels). Both are this one
operation on a different axis: `quantize(x, bits, group_size, dim)` groups `group_size`
consecutive values along `dim` and stores, per group, a float16 minimum and step and one
`bits`-bit code per value.

Error bound: every value is within half a step of its reconstruction, where
step = (group max - group min) / (2**bits - 1). The float16 minimum and step are rounded
outward (minimum down, step up) so the bound holds after rounding too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.errors import KvtierError

SUPPORTED_BITS = (2, 4, 8)


@dataclass
class Quantized:
    codes: torch.Tensor  # uint8, `8 // bits` codes per byte, [..., groups, group_size * bits / 8]
    minimum: torch.Tensor  # float16 [..., groups, 1]
    step: torch.Tensor  # float16 [..., groups, 1]
    bits: int
    dim: int
    length: int  # size of `dim` before padding to whole groups
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.minimum, self.step))


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise KvtierError(f"quantization bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def quantize(x: torch.Tensor, bits: int, group_size: int, dim: int) -> Quantized:
    check_bits(bits)
    if group_size < 1 or (group_size * bits) % 8:
        raise KvtierError(
            f"group_size must be positive and fill whole bytes at {bits} bits, got {group_size}"
        )
    dim = dim % x.ndim
    moved = x.float().movedim(dim, -1)
    length = moved.shape[-1]
    pad = -length % group_size
    if pad:  # repeat the last value: it widens no group's range
        moved = torch.cat((moved, moved[..., -1:].expand(*moved.shape[:-1], pad)), dim=-1)
    groups = moved.reshape(*moved.shape[:-1], -1, group_size)
    minimum, step = group_scales(groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True), bits)
    codes = to_codes(groups, minimum, step, bits)
    return Quantized(_pack(codes, bits), minimum, step, bits, dim, length, x.shape)


def group_scales(
    low: torch.Tensor, high: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 minimum and step of groups with these float32 extremes, rounded outward
    (minimum down, step up) so every value stays within half a step of its code."""
    minimum = _round_toward(low, float("-inf"))
    step = _round_toward((high - minimum.float()) / ((1 << bits) - 1), float("inf"))
    return minimum, step


def to_codes(x: torch.Tensor, minimum: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of float32 `x` (minimum and step broadcast against it), one per value."""
    # A constant group has step 0: any code reconstructs it exactly.
    safe_step = torch.where(step > 0, step.float(), torch.ones_like(step, dtype=torch.float32))
    levels = (1 << bits) - 1
    return ((x - minimum.float()) / safe_step).round_().clamp_(0, levels).to(torch.uint8)


def pack_split(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack uint8 codes `8 // bits` per byte along `dim`, split-halves order: byte i holds
    the codes at i, i + m, i + 2m, ... (m = size / per_byte). Unpacking is then a
    concatenation along `dim`, which keeps the unpacked values in their natural order
    without an interleaving copy (what the packed KV pool wants on every read)."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    parts = codes.chunk(per_byte, dim)
    packed = parts[0].clone()
    for i in range(1, per_byte):
        packed |= parts[i] << (i * bits)
    return packed


def unpack_split(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `pack_split`: the codes, `8 // bits` times longer along `dim`."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    mask = (1 << bits) - 1
    parts = [packed & mask] + [(packed >> (i * bits)) & mask for i in range(1, per_byte)]
    return torch.cat(parts, dim)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    codes = _unpack(q.codes, q.bits).float()
    values = codes * q.step.float() + q.minimum.float()
    values = values.reshape(*values.shape[:-2], -1)[..., : q.length]
    return values.movedim(-1, q.dim).to(dtype).reshape(q.shape)


# Values decoded per tile by `dequantize_into`: a tile's float32 buffer (512 KiB) stays in a
# core's L2 between its passes, and no buffer is large enough for the allocator to map fresh
# pages (and fault them in) for each chunk.
_TILE_VALUES = 1 << 17


def dequantize_into(q: Quantized, out: torch.Tensor) -> None:
    """`dequantize(q)` written into `out` (any dtype, any strides), bit for bit, with no
    interleaving or transposing pass over float32 values, in tiles along the first axis
    (unless that is the grouped one). A restore decodes whole chunks this way (docs/tiers.md,
    "Quantized forms against full precision": 2x faster than the unpack, cast, scale, shift
    and transposing copy it replaced)."""
    if q.dim == 0:  # the codes' first axis is not the values' first axis
        _dequantize_tile(q, out)
        return
    rows = max(1, _TILE_VALUES * q.shape[0] // max(1, q.shape.numel()))
    for first in range(0, q.shape[0], rows):
        end = min(first + rows, q.shape[0])
        tile = Quantized(
            q.codes[first:end],
            q.minimum[first:end],
            q.step[first:end],
            q.bits,
            q.dim,
            q.length,
            torch.Size((end - first, *q.shape[1:])),
        )
        _dequantize_tile(tile, out[first:end])


def _dequantize_tile(q: Quantized, out: torch.Tensor) -> None:
    """Each code position of a byte is cast straight from the packed bytes into its place in a
    float32 buffer laid out in `out`'s order, so keys (grouped along tokens) land transposed
    in that cast of bytes and not in a later copy of floats; the buffer is scaled and shifted
    in place, then copied once into `out`. The values are `dequantize`'s: a code times a
    float16 step is exact in float32 (at most 8 + 11 significant bits), so only the shift
    and the final cast round, as there, whether or not the two are fused."""
    per_byte = 8 // q.bits
    groups, group_bytes = q.codes.shape[-2:]
    padded = list(q.shape)
    padded[q.dim] = groups * group_bytes * per_byte
    buffer = torch.empty(padded, dtype=torch.float32, device=q.codes.device)
    # the buffer seen as the codes are laid out: [*others, groups, group_bytes, per_byte]
    slots = buffer.movedim(q.dim, -1).unflatten(-1, (groups, group_bytes, per_byte))
    mask = (1 << q.bits) - 1
    for i in range(per_byte):
        slots[..., i].copy_(q.codes if per_byte == 1 else (q.codes >> (i * q.bits)) & mask)
    values = slots.flatten(-2)  # [*others, groups, group_size]
    step, minimum = q.step.float(), q.minimum.float()
    if q.dim == len(q.shape) - 1:
        # groups along the innermost axis: step and minimum are both constant along it, and
        # torch vectorises a ternary op over at most one such operand: two binary passes
        values.mul_(step).add_(minimum)
    else:  # both vary along the innermost axis: one vectorised pass
        torch.addcmul(minimum, values, step, out=values)
    out.copy_(buffer.narrow(q.dim, 0, q.length))


def max_error(x: torch.Tensor, bits: int, group_size: int, dim: int) -> torch.Tensor:
    """The documented bound for each value of `x`: half its group's step (same shape as x)."""
    q = quantize(x, bits, group_size, dim)
    half = (q.step.float() / 2).expand(*q.step.shape[:-1], group_size)
    half = half.reshape(*half.shape[:-2], -1)[..., : q.length]
    return half.movedim(-1, q.dim).reshape(x.shape)


def _round_toward(x: torch.Tensor, direction: float) -> torch.Tensor:
    """float16 of x, moved one ulp toward `direction` where rounding went the other way."""
    half = x.half()
    wrong = half.float() > x if direction < 0 else half.float() < x
    toward = torch.tensor(direction, dtype=half.dtype, device=half.device)
    return torch.where(wrong, torch.nextafter(half, toward), half)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    grouped = codes.reshape(*codes.shape[:-1], -1, per_byte)
    packed = torch.zeros(grouped.shape[:-1], dtype=torch.uint8, device=codes.device)
    for i in range(per_byte):
        packed |= grouped[..., i] << (i * bits)
    return packed


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    mask = (1 << bits) - 1
    parts = [(packed >> (i * bits)) & mask for i in range(per_byte)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1)
