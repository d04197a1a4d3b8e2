"""Engine fixtures: one fp32 and one bf16 engine per test run, reset between tests."""

from __future__ import annotations

import pytest
import torch

from kvtier.clock import VirtualClock
from kvtier.engine import Engine, EngineConfig

MIB = 1 << 20


@pytest.fixture(scope="session")
def fake_clock() -> VirtualClock:
    return VirtualClock(1000.0)


@pytest.fixture(scope="session")
def _chunked_engine(fake_clock: VirtualClock) -> Engine:
    return Engine(
        EngineConfig(dtype="float32", max_num_batched_tokens=32, kv_cache_bytes=32 * MIB),
        clock=fake_clock,
    )


@pytest.fixture
def chunked_engine(_chunked_engine: Engine) -> Engine:
    """fp32 engine with a 32-token step budget (chunked prefill) and a fake session clock."""
    return _fresh(_chunked_engine)


@pytest.fixture(scope="session")
def _fp32_engine() -> Engine:
    return Engine(EngineConfig(dtype="float32", kv_cache_bytes=128 * MIB))


@pytest.fixture(scope="session")
def _bf16_engine() -> Engine:
    return Engine(EngineConfig(dtype="bfloat16", kv_cache_bytes=64 * MIB))


def _fresh(engine: Engine) -> Engine:
    assert not engine.has_unfinished_requests(), "a previous test left requests in flight"
    engine.reset_prefix_cache()
    return engine


@pytest.fixture
def fp32_engine(_fp32_engine: Engine) -> Engine:
    """fp32 engine (exact comparisons with transformers), empty prefix cache."""
    return _fresh(_fp32_engine)


@pytest.fixture
def bf16_engine(_bf16_engine: Engine) -> Engine:
    """bf16 engine (the serving default), empty prefix cache."""
    return _fresh(_bf16_engine)


def random_prompt(n: int, seed: int) -> list[int]:
    """Token ids drawn from the ordinary vocabulary (ids below 100 are special/control)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 49152, (n,), generator=generator).tolist()
