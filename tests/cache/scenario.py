"""A resumed session whose KV was pushed out of a tiny device pool by another request."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvtier.engine import Engine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@dataclass
class Turns:
    first: list[int]
    flood: list[int]
    extra: list[int]

    def second(self, first_output: list[int]) -> list[int]:
        return self.first + first_output + self.extra


def make_turns(seed: int = 0) -> Turns:
    r = random.Random(seed)
    ids = lambda n: [r.randrange(1000, 20000) for _ in range(n)]  # noqa: E731
    return Turns(first=ids(150), flood=ids(250), extra=ids(20))


def run_first_and_flood(engine: Engine, turns: Turns, session: str = "s1") -> list[int]:
    """Turn 1 of `session`, then an unrelated long prompt that evicts it; returns turn 1's
    output ids."""
    rid = engine.add_request(turns.first, GREEDY, session_id=session)
    first_output = drain(engine)[rid]
    engine.add_request(turns.flood, GREEDY, session_id=session + "-flood")
    drain(engine)
    return first_output


def run_second(engine: Engine, turns: Turns, first_output: list[int], session: str = "s1"):
    rid = engine.add_request(turns.second(first_output), GREEDY, session_id=session)
    outs = {}
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished and out.request_id == rid:
                final = out
    return outs[rid], final


def drain(engine: Engine) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return outs


def reference(engine: Engine, turns: Turns, first_output: list[int]) -> list[int]:
    """Turn 2 computed from scratch (the caller has detached any connector)."""
    engine.reset_prefix_cache()
    rid = engine.add_request(turns.second(first_output), GREEDY)
    return drain(engine)[rid]


def assert_no_leak(engine: Engine) -> None:
    pool = engine.block_pool
    assert not engine.has_unfinished_requests()
    assert pool.num_used == 0
    assert len(pool.free_block_ids) + len(pool.kept) + len(pool.evictable) == pool.num_blocks
    assert all(count == 0 for count in pool.ref_counts)
