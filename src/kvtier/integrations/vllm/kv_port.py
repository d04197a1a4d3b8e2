"""PagedKVPort: kvtier's block port (`kvtier.engine.connector.KVBlockPort`) over vLLM's KV.

vLLM hands a connector one paged tensor per attention layer (`register_kv_caches`), laid out
by its attention backend: the block axis is wherever that backend puts it (CPU: after the
K/V axis). The port finds that axis from the number of blocks, and moves whole blocks as
[n, num_layers, *one layer's block], so a chunk holds every layer of its tokens and the tier
code sees the same kind of payload as with kvtier's own pool. Only the block ids vLLM gave
are read or written.

On CUDA (the KV tensors' device decides; the CPU path has no pinning and no streams):
- the connector calls both directions through `kvtier.engine.device_copy.CudaCopy`, on its
  side stream ordered by events: a load's scatter runs there and vLLM's compute stream waits
  on its event before the forward; a save's gather runs there after an event of the compute
  stream, and only the mover's worker waits for the bytes, before a tier reads them;
- block ids go to the device from pinned memory without blocking (`device_index`): a
  pageable copy would synchronise the host with the stream on every call;
- a gather into host memory (`out` on the CPU; `CudaCopy` never asks for one) runs on the
  device and comes back in one copy, not one per layer, done when the call returns (the
  port's contract); a scatter from host bytes goes through pinned memory (`pinned`), so its
  copy to the device is asynchronous.
Pinned buffers come from torch's caching host allocator, which hands a freed one out again
only once the copies recorded on it have completed: reused, and never overwritten early.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvtier.engine.device_copy import device_index, pinned
from kvtier.errors import KvtierError


class PagedKVPort:
    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        if not kv_caches:
            raise KvtierError("vLLM registered no KV cache tensors with the kvtier connector")
        self.layer_names = list(kv_caches)
        self.layers = [kv_caches[name] for name in self.layer_names]
        first = self.layers[0]
        self.block_dims = [_block_dim(name, t, num_blocks) for name, t in kv_caches.items()]
        per_layer = [
            tuple(s for d, s in enumerate(t.shape) if d != dim)
            for t, dim in zip(self.layers, self.block_dims, strict=True)
        ]
        if len(set(per_layer)) != 1 or len({t.dtype for t in self.layers}) != 1:
            raise KvtierError(
                "the kvtier connector needs every attention layer's KV blocks in one shape "
                f"and dtype; vLLM registered {sorted(set(per_layer))}"
            )
        self.block_shape = torch.Size((len(self.layers), *per_layer[0]))
        self.dtype = first.dtype
        self.device = first.device
        self.num_blocks = num_blocks

    def read_blocks(
        self, block_ids: Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if out is not None and self.device.type == "cuda" and out.device != self.device:
            # gathered on the device, then one copy (not one per layer) to the host
            return out.copy_(self.read_blocks(block_ids))
        index = self._index(block_ids)
        if out is None:
            out = torch.empty((len(index), *self.block_shape), dtype=self.dtype, device=self.device)
        for layer, (tensor, dim) in enumerate(zip(self.layers, self.block_dims, strict=True)):
            out[:, layer].copy_(tensor.index_select(dim, index).movedim(dim, 0))
        return out

    def write_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        if tuple(blocks.shape[1:]) != tuple(self.block_shape) or blocks.dtype != self.dtype:
            raise KvtierError(
                f"blocks of shape {tuple(blocks.shape[1:])} {blocks.dtype} do not fit this "
                f"KV cache ({tuple(self.block_shape)} {self.dtype})"
            )
        index = self._index(block_ids)
        if self.device.type == "cuda":
            blocks = pinned(blocks)  # asynchronous only from pinned memory
        blocks = blocks.to(self.device, non_blocking=True)
        for layer, (tensor, dim) in enumerate(zip(self.layers, self.block_dims, strict=True)):
            tensor.index_copy_(dim, index, blocks[:, layer].movedim(0, dim))

    def block_view(self, block_ids: Sequence[int]) -> None:
        """None: a block spans one tensor per layer here, never one slab (`write_blocks`)."""
        return None

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        if self.device.type == "cuda":
            return device_index(block_ids, self.device)
        return torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)


def _block_dim(name: str, tensor: torch.Tensor, num_blocks: int) -> int:
    dims = [d for d, size in enumerate(tensor.shape) if size == num_blocks]
    if len(dims) != 1:
        raise KvtierError(
            f"cannot tell the block axis of layer {name}'s KV cache {tuple(tensor.shape)} "
            f"({num_blocks} blocks): the kvtier connector supports paged layouts with one "
            "axis of that length"
        )
    return dims[0]
