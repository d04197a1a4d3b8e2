"""What a prefill costs on this engine: a few timed prefills, fitted to the cost model's
`a + b t + c t (2p + t) / 2` (`CostProfile.from_measurements`).

`kvtier bench` measures it once, on the first engine, before any replay, and hands it to every
policy's tiers (`TiersConfig.cost_profile`): the cost policy and the restore planner then
price recompute as this engine runs it, not as `[policy.profile]`'s GPU model would (a
SmolLM2 prefill on one CPU thread is ~100x slower per token than the default Llama-3.1-8B on
an H100), and the bill's engine-seconds spent recomputing are this engine's.

Each point prefills `tokens` new tokens after `cached` tokens already in the prefix cache,
timed three times; the fastest run counts (a stall from another process only ever slows one down).
About 3.5 s on one CPU thread. The prefix cache is emptied afterwards, so the replay starts
cold.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvtier.errors import KvtierError
from kvtier.policy.cost_model import CostProfile

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine

# (new tokens, cached tokens before them): three prefills from position 0 fix a and b; one
# after a cached prefix fixes c (the attention over earlier keys). One point more than the
# unknowns, and the best of three runs each: with exactly three points a stall that slowed
# both runs of the shortest prefill passed for a fixed cost and drove the per-token cost to 0
POINTS = ((128, 0), (256, 0), (512, 0), (256, 1536))
REPEATS = 3
# the most KV one point holds at once (its cached prefix and its new tokens, one more block
# for the generated token): the pool `measure_profile` needs
PROFILE_TOKENS = max(tokens + cached for tokens, cached in POINTS) + 16
_LOW_TOKEN = 256  # synthetic prompts avoid the special tokens at the start of the vocabulary


def measure_profile(engine: Engine) -> CostProfile:
    """The engine's prefill coefficients, from `POINTS` (each repeat prefills new tokens of
    its own after the same cached prefix, which is prefilled once, untimed)."""
    from kvtier.engine.sampling import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    samples = []
    for index, (tokens, cached) in enumerate(POINTS):
        prefix = _tokens(index, 0, cached)
        if cached:
            engine.generate([prefix], one)
        best = float("inf")
        for repeat in range(REPEATS):
            prompt = prefix + _tokens(index, repeat + 1, tokens)
            started = time.perf_counter()
            (out,) = engine.generate([prompt], one)
            best = min(best, time.perf_counter() - started)
            if out.error is not None:  # a refused prefill would time as free
                raise KvtierError(f"measuring the prefill cost: {out.error}")
        samples.append((tokens, cached, best))
    engine.reset_prefix_cache()
    return CostProfile.from_measurements(samples)


def _tokens(point: int, part: int, count: int) -> list[int]:
    """Token ids of their own for each (point, part): no prefix is shared by accident."""
    seed = point * 7919 + part * 104729
    return [_LOW_TOKEN + (seed + i * 31) % 4000 for i in range(count)]
