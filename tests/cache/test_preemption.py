"""Preemption with tiers is a swap-out: the preempted request's blocks are spilled when the
pool reuses them and restored at re-admission, with output identical to the no-tier engine."""

from __future__ import annotations

import random

import pytest

from kvtier.cache import TiersConfig
from kvtier.cache.setup import attach_connector
from kvtier.engine import SamplingParams

from .scenario import assert_no_leak, drain

pytestmark = pytest.mark.slow

MIB = 1 << 20
# Three 90-token prompts growing by 60 tokens each: 3 x 10 blocks > the 22-block pool.
DECODE = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


def prompts(seed: int = 7) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(1000, 20000) for _ in range(90)] for _ in range(3)]


def run_all(engine) -> list[list[int]]:
    ids = [engine.add_request(p, DECODE) for p in prompts()]
    outs = drain(engine)
    return [outs[i] for i in ids]


@pytest.fixture(scope="module")
def reference(_engine) -> list[list[int]]:
    """The outputs with no tiers: preempted requests are recomputed."""
    attach_connector(_engine, None)
    preemptions = _engine.scheduler.num_preemptions
    outputs = run_all(_engine)
    assert _engine.scheduler.num_preemptions > preemptions
    return outputs


def test_preempted_requests_are_swapped_out_and_restored(engine, reference):
    # retain: nothing is spilled on eviction except what a preemption swaps out
    connector = attach_connector(engine, TiersConfig(host_bytes=64 * MIB, chunk_tokens=64))
    preemptions = engine.scheduler.num_preemptions
    swapped = run_all(engine)
    assert engine.scheduler.num_preemptions > preemptions
    assert swapped == reference
    assert connector.flush(timeout=30)
    counters = connector.counters
    assert counters["preempted_requests"] > 0
    assert counters["swapped_chunks"] > 0, counters
    assert counters["restored_blocks_host"] > 0, counters
    assert counters["spilled_chunks"] == 0
    assert_no_leak(engine)


def test_swap_can_be_turned_off(engine, reference):
    config = TiersConfig(host_bytes=64 * MIB, chunk_tokens=64, swap_on_preempt=False)
    connector = attach_connector(engine, config)
    assert run_all(engine) == reference
    assert connector.flush(timeout=30)
    assert connector.counters["swapped_chunks"] == 0
    assert len(connector.store) == 0
    assert_no_leak(engine)
