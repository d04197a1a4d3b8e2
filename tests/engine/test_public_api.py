"""The engine's cache-control API for servers and admin tools (no reaching into internals):
`block_owner`, `drop_cached`, `pin_blocks` / `unpin_blocks`, `exclusive`, and the pool's
`is_cached` / `is_idle_cached`."""

from __future__ import annotations

import threading

import pytest

from kvtier.engine import SamplingParams
from kvtier.engine.block_pool import BlockPool
from kvtier.errors import KvtierError

from .conftest import random_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


class OwnerRecorder:
    """A block listener that asks the engine who filled each block, as a server's does."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.filled: dict[int, object] = {}
        self.evicted: list[int] = []

    def on_block_filled(self, block_id: int, key: bytes) -> None:
        self.filled[block_id] = self.engine.block_owner(block_id)

    def on_block_freed(self, block_id: int) -> None:
        pass

    def on_block_evicted(self, block_id: int, key: bytes) -> None:
        self.evicted.append(block_id)


@pytest.fixture
def recorder(bf16_engine):
    recorder = OwnerRecorder(bf16_engine)
    bf16_engine.add_block_listener(recorder)
    yield recorder
    bf16_engine.remove_block_listener(recorder)


def run(engine, *requests) -> dict[str, int]:
    """Add (prompt, tenant, session) requests, step until done; request id -> cached tokens."""
    cached: dict[str, int] = {}
    ids = [
        engine.add_request(prompt, GREEDY, session_id=session, tenant=tenant)
        for prompt, tenant, session in requests
    ]
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens or 0
    return {i: cached[i] for i in ids}


def test_block_owner_names_the_tenant_and_session_that_filled_each_block(bf16_engine, recorder):
    a, b = random_prompt(70, 1), random_prompt(40, 2)  # 4 and 2 full blocks (+ outputs)
    run(bf16_engine, (a, "acme", "acme/s1"), (b, "beta", None))
    owners = [(o.tenant, o.session_id) for o in recorder.filled.values()]
    assert owners.count(("acme", "acme/s1")) == 4
    assert owners.count(("beta", None)) == 2
    assert len(owners) == 6
    # finished: nobody holds the (now idle cached) blocks any more
    assert all(bf16_engine.block_owner(b) is None for b in recorder.filled)


def test_drop_cached_evicts_idle_blocks_and_tells_listeners(bf16_engine, recorder):
    prompt = random_prompt(50, 3)
    run(bf16_engine, (prompt, None, None))
    blocks = list(recorder.filled)
    assert all(bf16_engine.block_pool.is_idle_cached(b) for b in blocks)
    assert bf16_engine.drop_cached(blocks) == len(blocks) == 3
    assert sorted(recorder.evicted) == sorted(blocks)
    assert not any(bf16_engine.block_pool.is_cached(b) for b in blocks)
    assert bf16_engine.drop_cached(blocks) == 0  # a stale list is harmless
    (cached,) = run(bf16_engine, (prompt, None, None)).values()
    assert cached == 0


def test_pinned_blocks_survive_eviction_until_unpinned(bf16_engine, recorder):
    prompt = random_prompt(50, 4)
    run(bf16_engine, (prompt, None, None))
    blocks = list(recorder.filled)
    assert bf16_engine.pin_blocks(blocks) == blocks
    assert bf16_engine.drop_cached(blocks) == 0
    assert bf16_engine.reset_prefix_cache() == 0
    (cached,) = run(bf16_engine, (prompt, None, None)).values()
    assert cached == 48  # all three full blocks hit
    bf16_engine.unpin_blocks(blocks)
    assert all(bf16_engine.block_pool.is_idle_cached(b) for b in blocks)
    with pytest.raises(KvtierError, match="not pinned"):
        bf16_engine.unpin_blocks(blocks)
    assert bf16_engine.drop_cached(blocks) == 3
    assert bf16_engine.pin_blocks(blocks) == []  # no longer cached: nothing to pin
    assert bf16_engine.stats().kv_blocks_used == 0


def test_exclusive_holds_off_steps(bf16_engine):
    bf16_engine.add_request(random_prompt(20, 5), GREEDY)
    stepped = threading.Event()

    def step_all() -> None:
        while bf16_engine.has_unfinished_requests():
            bf16_engine.step()
        stepped.set()

    with bf16_engine.exclusive(), bf16_engine.exclusive():  # re-entrant
        steps_before = bf16_engine.num_steps
        worker = threading.Thread(target=step_all)
        worker.start()
        assert not stepped.wait(0.3)  # the step waits for the lock
        assert bf16_engine.num_steps == steps_before
    worker.join(timeout=60)
    assert stepped.is_set()


def test_pool_cached_and_idle_states():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    assert not pool.is_cached(block) and not pool.is_idle_cached(block)
    pool.cache_block(block, b"k")
    assert pool.is_cached(block) and not pool.is_idle_cached(block)  # still in use
    pool.release([block])
    assert pool.is_cached(block) and pool.is_idle_cached(block)
    pool.touch([block])  # a prefix hit takes it back
    assert not pool.is_idle_cached(block)
