"""The vLLM connector's block copies (`PagedKVPort` through `kvtier.engine.device_copy`):
on CPU plain synchronous copies, on CUDA a side stream ordered by events with pinned host
bytes and no host synchronisation on the forward's path.

The CUDA tests (`requires_cuda`) are skipped without a CUDA device; benchmarks/gpu_check.sh
runs them on a GPU machine. The layouts are vLLM's CUDA ones: FlashAttention's
[2, num_blocks, block_size, kv_heads, head_size] and FlashInfer's
[num_blocks, 2, block_size, kv_heads, head_size]."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.device_copy import CpuCopy, CudaCopy, for_device
from kvtier.integrations.vllm.kv_port import PagedKVPort

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, LAYERS = 40, 16, 4, 64, 6


def vllm_layers(block_dim: int, device: str, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    shape = [2, BLOCK_SIZE, HEADS, HEAD_SIZE]
    shape.insert(block_dim, NUM_BLOCKS)
    gen = torch.Generator().manual_seed(block_dim)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=gen).to(dtype).to(device)
        for i in range(LAYERS)
    }


def expected_blocks(layers: dict[str, torch.Tensor], block_dim: int, ids: list[int]):
    """[n, layers, *one block] on the CPU, read the slow obvious way."""
    return torch.stack(
        [torch.stack([t.select(block_dim, b).cpu() for t in layers.values()]) for b in ids]
    )


# ----- CPU: the path vLLM-CPU runs, unchanged ----------------------------------------------


@pytest.mark.parametrize("block_dim", [0, 1])
def test_cpu_port_copies_synchronously_without_pinning(block_dim):
    layers = vllm_layers(block_dim, "cpu")
    port = PagedKVPort(layers, NUM_BLOCKS)
    copy = for_device(port.device)
    assert isinstance(copy, CpuCopy)  # no stream, no event

    saved = copy.save(port, [3, 17, 9])
    saved.ready()
    assert not saved.blocks.is_cuda
    assert torch.equal(saved.blocks, expected_blocks(layers, block_dim, [3, 17, 9]))
    into = torch.empty_like(saved.blocks)
    assert port.read_blocks([3, 17, 9], out=into) is into
    assert torch.equal(into, saved.blocks)

    copy.load(port, [30, 31, 32], saved.blocks)
    assert torch.equal(
        expected_blocks(layers, block_dim, [30, 31, 32]),
        expected_blocks(layers, block_dim, [3, 17, 9]),
    )
    untouched = expected_blocks(vllm_layers(block_dim, "cpu"), block_dim, [33])
    assert torch.equal(expected_blocks(layers, block_dim, [33]), untouched)


# ----- CUDA: side stream, events, pinned host bytes ----------------------------------------


def busy_compute_stream() -> None:
    """Queue a while of work on the compute stream, so a copy not ordered against it would
    overtake it and the tests below would see stale or missing bytes."""
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(50):
        x = x @ x
        x = x / x.norm()


@pytest.mark.requires_cuda
@pytest.mark.parametrize("block_dim", [0, 1])
def test_cuda_save_and_load_move_equal_bytes_through_pinned_memory(block_dim):
    layers = vllm_layers(block_dim, "cuda")
    port = PagedKVPort(layers, NUM_BLOCKS)
    copy = for_device(port.device)
    assert isinstance(copy, CudaCopy)
    ids = [3, 17, 9, 0]
    expected = expected_blocks(layers, block_dim, ids)

    busy_compute_stream()
    name = next(iter(layers))
    layers[name].select(block_dim, 17).fill_(7.0)  # queued behind the busy work
    expected[1, 0] = 7.0
    saved = copy.save(port, ids)
    for tensor in layers.values():  # the pool reuses the blocks at once
        tensor.select(block_dim, 3).zero_()
    saved.ready()
    assert saved.blocks.is_pinned() and torch.equal(saved.blocks, expected)

    busy_compute_stream()
    copy.load(port, [30, 31, 32, 33], saved.blocks)
    # a compute-stream read: it runs after the load's event, with no host wait in between
    assert torch.equal(expected_blocks(layers, block_dim, [30, 31, 32, 33]), expected)

    pageable = saved.blocks.clone()  # a tier's buffer that is not pinned: staged first
    copy.load(port, [20, 21, 22, 23], pageable)
    assert torch.equal(expected_blocks(layers, block_dim, [20, 21, 22, 23]), expected)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("pin", [True, False])
def test_cuda_gather_into_host_memory_is_one_copy_done_on_return(pin):
    layers = vllm_layers(1, "cuda")
    port = PagedKVPort(layers, NUM_BLOCKS)
    out = torch.empty((2, *port.block_shape), dtype=port.dtype, pin_memory=pin)
    assert port.read_blocks([5, 6], out=out) is out
    assert torch.equal(out, expected_blocks(layers, 1, [5, 6]))


@pytest.mark.requires_cuda
@pytest.mark.parametrize("block_dim", [0, 1])
def test_cuda_load_and_save_never_synchronise_the_host(block_dim):
    """start_load_kv and the save after the forward run on vLLM's step: any host sync there
    (a pageable copy, .item(), an event or stream synchronize) is an error in this mode.
    Only `ready()`, on the mover's worker, waits."""
    layers = vllm_layers(block_dim, "cuda")
    port = PagedKVPort(layers, NUM_BLOCKS)
    copy = for_device(port.device)
    host = copy.save(port, [1, 2, 3, 4])
    host.ready()  # the first round: one-off set-up (the stream, allocator pools)
    copy.load(port, [10, 11, 12, 13], host.blocks)
    torch.cuda.synchronize()

    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):
            copy.load(port, [20 + step, 30 + step], host.blocks[:2])
            saved = copy.save(port, [20 + step, 30 + step, 5])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    saved.ready()
    assert torch.equal(saved.blocks[:2], host.blocks[:2])
    assert torch.equal(saved.blocks[2], expected_blocks(layers, block_dim, [5])[0])
