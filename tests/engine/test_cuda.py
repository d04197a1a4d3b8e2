"""The CUDA path: side-stream copies ordered by events, pinned host bytes, the engine end to end.

Every test here needs a CUDA device and is skipped without one (docs/gpu.md lists them)."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.device_copy import CudaCopy, device_index, for_device, pinned
from kvtier.engine.kv_pool import KVPool
from kvtier.tiers import HostTier, Payload

pytestmark = pytest.mark.requires_cuda

MIB = 1 << 20


def cuda_pool(num_blocks: int = 64) -> KVPool:
    shape_numel = 4 * 2 * 4 * 16 * 64
    pool = KVPool(4, 4, 64, 16, torch.bfloat16, "cuda", num_blocks * shape_numel * 2)
    pool.kv.normal_()
    return pool


def busy(stream: torch.cuda.Stream) -> None:
    """Keep `stream` busy for a while, so a copy not ordered after it would overtake it."""
    with torch.cuda.stream(stream):
        x = torch.randn(2048, 2048, device="cuda")
        for _ in range(50):
            x = x @ x
            x = x / x.norm()


def test_cuda_strategy_and_index_stay_on_device() -> None:
    copy = for_device(torch.device("cuda"))
    assert isinstance(copy, CudaCopy)
    index = device_index([4, 2], torch.device("cuda"))
    assert index.is_cuda and index.tolist() == [4, 2]
    assert pinned(torch.ones(3)).is_pinned()


def test_save_sees_writes_queued_on_the_compute_stream() -> None:
    pool = cuda_pool()
    copy = CudaCopy(pool.device)
    busy(torch.cuda.current_stream())
    pool.kv[3].fill_(7.0)  # queued behind the busy work on the compute stream
    saved = copy.save(pool, [3])
    saved.ready()
    assert saved.blocks.is_pinned() and not saved.blocks.is_cuda
    assert bool((saved.blocks == 7.0).all())


def test_save_copy_survives_the_pool_reusing_the_blocks() -> None:
    pool = cuda_pool()
    copy = CudaCopy(pool.device)
    expected = pool.kv[[5, 6]].cpu()
    saved = copy.save(pool, [5, 6])
    pool.kv[5:7].zero_()  # on the compute stream, which waited for the gather
    saved.ready()
    assert torch.equal(saved.blocks, expected)


@pytest.mark.parametrize("pin", [True, False])
def test_load_is_seen_by_the_next_compute_kernel(pin: bool) -> None:
    pool = cuda_pool()
    copy = CudaCopy(pool.device)
    blocks = torch.randn((2, *pool.block_shape)).to(torch.bfloat16)
    if pin:
        blocks = blocks.pin_memory()
    busy(torch.cuda.current_stream())
    copy.load(pool, [8, 9], blocks)
    seen = pool.kv[8:10].clone()  # a compute-stream kernel: it must wait for the load's event
    assert torch.equal(seen.cpu(), blocks)
    torch.cuda.synchronize()
    assert copy.in_flight == 0  # the host source is released once its copy completed


def test_host_tier_returns_pinned_bytes_for_the_device_copy() -> None:
    host = HostTier(4 * MIB, slot_bytes=64 * 1024)
    assert host.pinned
    data = torch.arange(100_000, dtype=torch.int32)
    assert host.put(b"k", Payload.of(data))
    got = host.get(b"k")
    assert got is not None and got.data.is_pinned()
    assert torch.equal(got.tensor(), data)


@pytest.mark.slow
@pytest.mark.parametrize("kv_quant", [None, "int8"])
def test_engine_on_cuda_matches_cpu_greedy(kv_quant: str | None) -> None:
    from kvtier.engine import Engine, EngineConfig, SamplingParams

    prompt = list(range(1000, 1300))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for device in ("cpu", "cuda"):
        engine = Engine(
            EngineConfig(dtype="float32", device=device, kv_cache_bytes=64 * MIB, kv_quant=kv_quant)
        )
        try:
            outputs[device] = engine.generate([prompt], params)[0].token_ids
        finally:
            engine.close()
    agree = sum(a == b for a, b in zip(outputs["cpu"], outputs["cuda"], strict=True))
    assert agree >= 12, outputs  # fp32 on both: late tokens may flip on near-ties only


@pytest.mark.slow
def test_resumed_session_restored_from_host_on_cuda_matches_recompute() -> None:
    from kvtier.cache import TiersConfig
    from kvtier.cache.setup import attach_connector
    from kvtier.engine import Engine, EngineConfig, SamplingParams
    from kvtier.policy.actions import Move

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = Engine(EngineConfig(dtype="float32", device="cuda", kv_cache_bytes=64 * MIB))
    try:
        history = list(range(2000, 2600))
        turn2 = [*history, 5, 6, 7]
        fresh = engine.generate([turn2], params)[0].token_ids
        engine.reset_prefix_cache()
        connector = attach_connector(engine, TiersConfig(host_bytes=256 * MIB), "retain")
        engine.add_request(history, params, session_id="s")
        while engine.has_unfinished_requests():
            engine.step()
        connector.runner.execute(Move("s", None, "host"))
        assert connector.flush(timeout=60)
        out = engine.generate([turn2], params)[0]
        assert out.metrics.prompt_token_sources["host"] > 0
        assert out.token_ids == fresh
    finally:
        engine.close()
