"""Block bookkeeping under random load: no leak, no double ownership, budget respected.

Two drivers:
- `bookkeeping_only_step` runs the real Scheduler, KVCacheManager and BlockPool but replaces
  the model with a stand-in that marks scheduled tokens computed and appends a pseudo-random
  token. It checks bookkeeping only (fast enough for 1,000 hypothesis-generated requests);
  it says nothing about the numbers the model would compute.
- the real engine (model and pool) on ~50 random requests with random aborts and a pool
  small enough to force preemptions.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.engine.block_pool import BlockPool
from kvtier.engine.kv_cache_manager import KVCacheManager
from kvtier.engine.request import FinishReason, Request
from kvtier.engine.scheduler import Scheduler, SchedulerOutput
from tests.host_dtype import BLOCK_BYTES

from .conftest import random_prompt
from .invariants import check_drained, check_invariants

BLOCK = 4
NUM_BLOCKS = 24
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 1], [2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4], []]

request_spec = st.tuples(
    st.integers(0, len(PREFIXES) - 1),  # shared prefix (frequent prefix-cache hits)
    st.integers(1, 30),  # own prompt tokens after the prefix
    st.integers(1, 12),  # max_tokens
    st.integers(0, 40),  # arrival step
    st.one_of(st.none(), st.integers(0, 15)),  # abort this many steps after arrival
)


def bookkeeping_only_step(scheduler: Scheduler, rng: random.Random) -> SchedulerOutput:
    """One engine step with the model replaced by bookkeeping (see module docstring)."""
    out = scheduler.schedule()
    for request, n in out.scheduled:
        request.num_computed_tokens += n
        scheduler.kv.register_full_blocks(request)
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(rng.randrange(8))  # tiny vocab: outputs repeat and share
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                scheduler.finish(request, FinishReason.LENGTH)
    return out


@settings(
    max_examples=20,  # x 50 requests = 1,000 requests
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    specs=st.lists(request_spec, min_size=50, max_size=50),
    priority=st.sampled_from(["decode_first", "prefill_first"]),
    budget=st.integers(1, 24),
)
def test_random_requests_never_leak_blocks(specs, priority, budget):
    pool = BlockPool(NUM_BLOCKS)
    manager = KVCacheManager(pool, BLOCK)
    scheduler = Scheduler(manager, budget, max_num_seqs=6, priority=priority)
    rng = random.Random(0)
    requests: list[tuple[int, int | None, Request]] = []
    for i, (prefix, own, max_tokens, arrival, abort_after) in enumerate(specs):
        prompt = PREFIXES[prefix] + [rng.randrange(8) for _ in range(own)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        abort_at = None if abort_after is None else arrival + abort_after
        requests.append((arrival, abort_at, Request(str(i), prompt, params, b"ns")))

    step = 0
    while step <= 40 or scheduler.has_unfinished:
        for arrival, abort_at, request in requests:
            if arrival == step:
                scheduler.add(request)
            if abort_at == step and request.request_id in scheduler.requests:
                scheduler.finish(request, FinishReason.ABORT)
        out = bookkeeping_only_step(scheduler, rng)
        check_invariants(pool, manager)
        assert out.num_batched_tokens <= budget
        assert pool.num_used <= NUM_BLOCKS
        step += 1
        assert step < 5000, "the scheduler stopped making progress"

    check_drained(pool, manager)
    for _, _, request in requests:
        assert request.is_finished
        if request.finish_reason is FinishReason.LENGTH and request.error is None:
            assert request.num_output_tokens == request.sampling_params.max_tokens


@pytest.mark.slow
def test_real_engine_random_requests_and_aborts():
    """~50 random requests through the real model on a 48-block pool (768 tokens), with
    shared prefixes, random aborts and forced preemptions; then nothing is left behind."""
    engine = Engine(
        EngineConfig(kv_cache_bytes=48 * BLOCK_BYTES, max_num_batched_tokens=96, max_num_seqs=12)
    )
    assert engine.kv_pool.capacity_bytes <= engine.config.kv_cache_bytes
    rng = random.Random(7)
    shared = [random_prompt(n, 100 + n) for n in (32, 48, 0)]
    max_tokens = {}
    for i in range(50):
        prompt = rng.choice(shared) + random_prompt(rng.randint(1, 100), i)
        params = SamplingParams(
            temperature=rng.choice([0, 0.8]), max_tokens=rng.randint(1, 12), seed=i
        )
        max_tokens[engine.add_request(prompt, params)] = params.max_tokens
    tokens = {request_id: 0 for request_id in max_tokens}
    reasons = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += len(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        in_flight = [r for r in max_tokens if r not in reasons]
        if in_flight and rng.random() < 0.1:
            victim = rng.choice(in_flight)
            assert engine.abort(victim)
            reasons[victim] = "abort"
        check_invariants(engine.block_pool, engine.kv_manager)
    check_drained(engine.block_pool, engine.kv_manager)

    stats = engine.stats()
    assert stats.num_preemptions > 0  # the small pool really forced recomputation
    assert stats.prefix_cache_hits > 0
    assert stats.kv_blocks_used == 0
    assert "abort" in reasons.values()
    for request_id, limit in max_tokens.items():
        assert reasons.get(request_id) in ("stop", "length", "abort")
        assert tokens[request_id] <= limit
        if reasons[request_id] == "length":
            assert tokens[request_id] == limit
