"""Fixtures for the tiered-engine tests: one fp32 engine with a tiny device pool (its tiers
are swapped per test with attach_connector), a fake session clock, real redis-servers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvtier.cache.setup import attach_connector
from kvtier.clock import VirtualClock
from kvtier.engine import Engine, EngineConfig

MIB = 1 << 20

# The redis-server fixtures of the tier tests (tests are not a package: load by path).
_spec = importlib.util.spec_from_file_location(
    "_kvtier_tiers_conftest", Path(__file__).parent.parent / "tiers" / "conftest.py"
)
_tiers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tiers)
RedisServer = _tiers.RedisServer
redis_server = _tiers.redis_server
redis_url = _tiers.redis_url
spawn_redis = _tiers.spawn_redis
own_redis = _tiers.own_redis
forge_layered = _tiers.forge_layered


@pytest.fixture(scope="session")
def clock() -> VirtualClock:
    return VirtualClock(1000.0)


@pytest.fixture(scope="session")
def _engine(clock: VirtualClock) -> Engine:
    # 16 MiB of fp32 SmolLM2 KV: 22 blocks of 16 tokens, so a 250-token prompt evicts others.
    # One torch thread: on a shared 2-core machine a second one stalls on the other's load.
    engine = Engine(
        EngineConfig(dtype="float32", kv_cache_bytes=16 * MIB, num_threads=1), clock=clock
    )
    yield engine
    attach_connector(engine, None)


@pytest.fixture(scope="session")
def expected(_engine: Engine) -> tuple[list[int], list[int]]:
    """(turn 1 output, turn 2 output) of the scenario's session computed with no connector."""
    from .scenario import make_turns, reference, run_first_and_flood

    attach_connector(_engine, None)
    turns = make_turns(0)
    first = run_first_and_flood(_engine, turns)
    return first, reference(_engine, turns, first)


@pytest.fixture
def engine(_engine: Engine) -> Engine:
    """The shared engine with no connector and an empty prefix cache."""
    attach_connector(_engine, None)
    yield _engine
    assert not _engine.has_unfinished_requests()
    attach_connector(_engine, None)
