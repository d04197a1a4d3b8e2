"""Compression fixtures: one fp32 engine per run, its pipeline reset to none after each test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.engine import Engine, EngineConfig

MIB = 1 << 20


@pytest.fixture(scope="session")
def _engine() -> Engine:
    return Engine(EngineConfig(dtype="float32", kv_cache_bytes=48 * MIB))


@pytest.fixture
def engine(_engine: Engine):
    """fp32 engine (exact comparisons), empty prefix cache, no compression unless set."""
    assert not _engine.has_unfinished_requests()
    _engine.set_compression(None)
    _engine.reset_prefix_cache()
    yield _engine
    _engine.set_compression(None)


def random_prompt(n: int, seed: int) -> list[int]:
    """Token ids from the ordinary vocabulary (ids below 100 are special/control)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 49152, (n,), generator=generator).tolist()


def prose_prompt(tokenizer, num_tokens: int) -> list[int]:
    """Real English (tests/data/english.txt), cut to `num_tokens` tokens."""
    text = (Path(__file__).parents[1] / "data" / "english.txt").read_text()
    return tokenizer.encode(text)[:num_tokens]
