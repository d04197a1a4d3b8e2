"""Moving whole KV blocks between the device pool and host memory, per device kind.

The connector restores blocks into the pool and spills them out through the pool's block port
(`KVBlockPort.write_blocks` / `read_blocks`); this module decides *how* those copies run:

- `CpuCopy`: the pool is host memory, so a copy is a copy, done when the call returns. A spill
  lands in page-aligned memory (an O_DIRECT disk tier then writes it without a bounce copy).
- `CudaCopy`: copies run on a side CUDA stream and the engine thread never waits for them.
  A restore copies pinned host bytes to the device and scatters them into the pool on the side
  stream, then makes the compute stream wait on that stream's event (a device-side wait, no
  host synchronisation), so the next forward, which reads those blocks, runs after them. A
  spill gathers the blocks on the side stream into a pinned buffer; the compute stream waits
  only for the gather (it may then overwrite the blocks), and whoever reads the host bytes
  (the mover's worker, before a tier write) calls `HostBlocks.ready()`, which waits for the
  copy's event on that thread alone.

Buffers are never reused early: the host source of a restore is kept referenced until its
copy's event has completed (checked without blocking, when later copies are queued), and
pinned buffers come from torch's caching host allocator, which itself reuses a freed pinned
block only once the copies recorded on it have completed. Side stream order covers the rest:
a chunk spilled and restored again before its tier write lands is read from its staged pinned
bytes by a restore that is queued on the same stream after the spill's copy.

`for_device(device)` picks the strategy; nothing else in the engine or the connector tests
the device kind.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from kvtier.tiers.payload import aligned_bytes
from kvtier.tiers.record import PAGE_BYTES

if TYPE_CHECKING:
    from kvtier.engine.connector import KVBlockPort


class HostBlocks(NamedTuple):
    """Blocks copied out of the pool ([n, *block_shape], host memory) and the call that waits
    until their bytes are there (a no-op on CPU; on CUDA the copy's event)."""

    blocks: torch.Tensor
    ready: Callable[[], None]


class DeviceCopy(Protocol):
    def load(self, port: KVBlockPort, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Fill `block_ids` from host `blocks` [n, *block_shape]; the next forward sees them."""
        ...

    def save(self, port: KVBlockPort, block_ids: Sequence[int]) -> HostBlocks:
        """Copy `block_ids` out to host memory; the pool may reuse them once this returns."""
        ...


def _no_wait() -> None:
    return None


class CpuCopy:
    """Synchronous copies: the pool is host memory already."""

    def load(self, port: KVBlockPort, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        port.write_blocks(block_ids, blocks)

    def save(self, port: KVBlockPort, block_ids: Sequence[int]) -> HostBlocks:
        # torch's own large tensors start 64 bytes into a page, which would send every spill
        # to an O_DIRECT disk tier through a bounce copy (docs/backends/disk.md).
        shape = (len(block_ids), *port.block_shape)
        nbytes = math.prod(shape) * port.dtype.itemsize
        staging = aligned_bytes(nbytes, PAGE_BYTES).view(port.dtype).view(shape)
        port.read_blocks(block_ids, out=staging)
        return HostBlocks(staging, _no_wait)


class CudaCopy:
    """Copies on a side stream, ordered against the compute stream by events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        # (event, host tensor) of restores in flight: the host bytes stay referenced until
        # the copy that reads them has completed.
        self._in_flight: list[tuple[torch.cuda.Event, torch.Tensor]] = []

    def load(self, port: KVBlockPort, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        self._forget_done()
        source = pinned(blocks)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            # Blocks just allocated may still be read by kernels of the step before.
            self.stream.wait_stream(compute)
            on_device = source.to(self.device, non_blocking=True)
            port.write_blocks(block_ids, on_device)
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(done)
        self._in_flight.append((done, source))

    def save(self, port: KVBlockPort, block_ids: Sequence[int]) -> HostBlocks:
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(compute)  # the blocks' last writes
            gathered = port.read_blocks(block_ids)
            taken = torch.cuda.Event()
            taken.record(self.stream)
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        # The pool may overwrite these blocks after the gather; the copy to host goes on.
        compute.wait_event(taken)
        return HostBlocks(host, copied.synchronize)

    @property
    def in_flight(self) -> int:
        """Restores whose host bytes are still referenced (not yet seen complete)."""
        self._forget_done()
        return len(self._in_flight)

    def _forget_done(self) -> None:
        self._in_flight = [(e, t) for e, t in self._in_flight if not e.query()]


def pinned(blocks: torch.Tensor) -> torch.Tensor:
    """`blocks` in page-locked host memory (itself when it is already): only pinned bytes are
    copied to the device asynchronously; from pageable memory CUDA stages them first, on the
    host. Tiers that read into pinned buffers (the host tier on a CUDA machine) skip this copy."""
    if blocks.device.type != "cpu" or blocks.is_pinned():
        return blocks
    out = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
    return out.copy_(blocks)


def device_index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """Block ids as a long tensor on `device`. On CUDA through pinned memory with a
    non-blocking copy: `torch.tensor(ids, device="cuda")` copies from pageable memory, which
    synchronises the stream on every call."""
    index = torch.tensor(list(block_ids), dtype=torch.long)
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def for_device(device: torch.device) -> DeviceCopy:
    return CudaCopy(device) if device.type == "cuda" else CpuCopy()
