"""What a tier stores: the bytes of one chunk plus what is needed to view them as K/V again.

A payload is a 1-D contiguous `uint8` tensor over the chunk's bytes, not a copy of them:
`Payload.of(kv)` reinterprets a contiguous tensor in place, and `Payload.tensor()` turns the
bytes back into the logical dtype and shape, again without copying. Tiers copy bytes once
(into a host slot, a file, a socket); nothing above them serialises or re-allocates.

A size-only payload has `data=None` and carries just `nbytes`: the simulator moves those
through the same store and accounting code as real bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

# What file, socket and cipher calls accept without a copy.
BytesLike = bytes | bytearray | memoryview

# Logical dtype names that may appear in stored metadata. A name read back from disk or Redis is
# looked up here rather than with getattr(torch, name), so corrupt metadata cannot name an
# arbitrary attribute.
_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


@dataclass(frozen=True, slots=True)
class Payload:
    """One chunk's bytes (or only its size) and how to read them.

    data: 1-D contiguous uint8 tensor of exactly `nbytes` elements (CPU, pinned CPU or device),
        or None for size-only tiers.
    form: the representation ("full", "int8", "int4+sink", ...); tiers never interpret it.
    dtype, shape: the logical tensor the bytes hold, so `tensor()` can restore it.
    """

    data: torch.Tensor | None
    nbytes: int
    form: str = "full"
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()

    @classmethod
    def of(cls, tensor: torch.Tensor, form: str = "full") -> Payload:
        """The bytes of `tensor`, shared with it (copied only when it is not contiguous)."""
        flat = tensor.contiguous().view(-1).view(torch.uint8)
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {tensor.dtype} cannot be stored in a tier")
        return cls(flat, flat.numel(), form, dtype, tuple(tensor.shape))

    @classmethod
    def sized(cls, nbytes: int, form: str = "full") -> Payload:
        """A payload of `nbytes` that has no bytes: what size-only tiers store and return."""
        return cls(None, nbytes, form)

    def with_data(self, data: torch.Tensor) -> Payload:
        """The same metadata over other bytes (a tier's copy of them)."""
        return Payload(data, self.nbytes, self.form, self.dtype, self.shape)

    def without_data(self) -> Payload:
        """The metadata alone: what an index keeps about a payload it does not hold."""
        return Payload(None, self.nbytes, self.form, self.dtype, self.shape)

    def tensor(self) -> torch.Tensor:
        """The bytes viewed as the logical dtype and shape, without copying."""
        if self.data is None:
            raise ValueError("a size-only payload has no bytes")
        viewed = self.data.view(_DTYPES[self.dtype])
        return viewed.view(self.shape) if self.shape else viewed

    def meta(self) -> bytes:
        """form, dtype and shape as the few bytes that disk and Redis records carry."""
        form, dtype = self.form.encode(), self.dtype.encode()
        if len(form) > 255 or len(self.shape) > 255:
            raise ValueError("form name or rank too long to store")
        return (
            bytes([len(form)])
            + form
            + bytes([len(dtype)])
            + dtype
            + bytes([len(self.shape)])
            + struct.pack(f"<{len(self.shape)}Q", *self.shape)
        )

    @classmethod
    def from_meta(cls, data: torch.Tensor | None, nbytes: int, meta: bytes) -> Payload:
        """Inverse of `meta()`; raises ValueError on bytes it did not write."""
        try:
            pos = 0
            form_len = meta[pos]
            form = meta[pos + 1 : pos + 1 + form_len].decode()
            pos += 1 + form_len
            dtype_len = meta[pos]
            dtype = meta[pos + 1 : pos + 1 + dtype_len].decode()
            pos += 1 + dtype_len
            rank = meta[pos]
            shape = struct.unpack_from(f"<{rank}Q", meta, pos + 1)
            pos += 1 + 8 * rank
        except (IndexError, UnicodeDecodeError, struct.error) as exc:
            raise ValueError(f"unreadable payload metadata: {exc}") from exc
        if pos != len(meta) or dtype not in _DTYPES:
            raise ValueError("unreadable payload metadata")
        return cls(data, nbytes, form, dtype, tuple(shape))


def empty_bytes(nbytes: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A fresh 1-D uint8 tensor for a tier to read into when the caller gave no buffer."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)


def aligned_bytes(nbytes: int, align: int) -> torch.Tensor:
    """A fresh 1-D uint8 tensor of `nbytes` starting at a multiple of `align` in memory, so that
    O_DIRECT can move it without a bounce copy.

    torch's large CPU tensors start 64 bytes into a page (glibc puts its chunk header first), so
    this over-allocates by `align` and slices.
    """
    base = torch.empty(nbytes + align, dtype=torch.uint8)
    skip = -base.data_ptr() % align
    return base[skip : skip + nbytes]


def as_buffer(data: torch.Tensor) -> memoryview:
    """A writable memoryview over a CPU uint8 tensor's bytes, for file and socket calls."""
    return memoryview(data.numpy()).cast("B")
