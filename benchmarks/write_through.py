"""Write-through on vs off: where the copy to the host tier is paid, and how many bytes it costs.

    .venv/bin/python benchmarks/write_through.py \
        --out out/write_through.json [--repeats 3] [--threads 1]

One engine (the embedded SmolLM2, bf16) with a device pool of `--pool-tokens` tokens and a
host tier, and sessions that do not fit it together: each round every session runs a turn
(its history plus new tokens), one at a time, so each resumed turn's admission evicts the
idle sessions' blocks and restores its own history from host. Without write-through those
evictions gather the evicted chunks on the engine thread (the eviction spill) while the turn
waits; with it, each finished turn's full chunks were gathered and queued when it finished,
so the evictions find them stored. Policy `retain` with `spill_on_evict=True` and its timer
off: no policy action, only the pool's evictions, move anything.

Reported per setup (setups alternating within a repeat, medians over repeats): the median
TTFT of the turns during which the pool evicted blocks, the bytes written into host (eviction
spills, write-through), and the engine-thread time spent in the connector's eviction hook
(`on_block_evicted`) and finish hook (`on_request_finished`), where the gathers happen.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import overflow_sessions as overflow

from kvtier.cache import TieredConnector, TiersConfig, attach_connector
from kvtier.engine import Engine
from kvtier.engine.hooks import BlockEventListener
from kvtier.policy.config import PolicyConfig

MIB = 1 << 20
SETUPS = ("off", "on")


class EvictionCount(BlockEventListener):
    """A block listener counting the pool's evictions."""

    def __init__(self) -> None:
        self.evicted = 0

    def on_block_evicted(self, block_id: int, key: bytes) -> None:
        self.evicted += 1


def time_hook(connector: TieredConnector, name: str, spent: dict[str, float]) -> None:
    """Replace the connector's hook `name` by a wrapper adding its wall time to spent[name]."""
    hook: Callable[..., None] = getattr(connector, name)

    def timed(*args: object) -> None:
        start = time.perf_counter()
        try:
            hook(*args)
        finally:
            spent[name] += time.perf_counter() - start

    setattr(connector, name, timed)


def run(engine: Engine, args: argparse.Namespace, seed: int, write_through: bool) -> dict:
    tiers = TiersConfig(
        host_bytes=1024 * MIB,
        chunk_tokens=args.chunk_tokens,
        spill_on_evict=True,
        write_through=write_through,
        swap_on_preempt=False,
        spill_queue=64,
    )
    timer_off = PolicyConfig(interval_s=1e9)
    connector = attach_connector(engine, tiers, "retain", timer_off)
    spent = {"on_block_evicted": 0.0, "on_request_finished": 0.0}
    for name in spent:
        time_hook(connector, name, spent)
    evictions = EvictionCount()
    engine.add_block_listener(evictions)
    r = random.Random(seed)
    sessions = overflow.histories(r, args)
    waited: list[float] = []  # TTFT of the turns during which the pool evicted blocks
    try:
        for _ in range(args.rounds):
            for i, history in enumerate(sessions):
                before = evictions.evicted
                rid = engine.add_request(history, overflow.FEW, session_id=f"s{i}")
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.request_id == rid:
                            history += out.new_token_ids
                        if out.finished and out.request_id == rid and evictions.evicted > before:
                            waited.append(out.metrics.ttft_s)
                history += overflow.random_tokens(r, args.turn_tokens)
        assert connector.flush(timeout=300)
    finally:
        engine.remove_block_listener(evictions)
    counters = connector.counters
    return {
        "turns_with_evictions": len(waited),
        "median_ttft_ms": statistics.median(waited) * 1000,
        "spilled_mb": counters["spilled_bytes"] / 1e6,
        "written_through_mb": counters["written_through_bytes"] / 1e6,
        "host_written_mb": connector.stats()["tiers"]["host"]["bytes_written"] / 1e6,
        "evict_hook_ms": spent["on_block_evicted"] * 1000,
        "finish_hook_ms": spent["on_request_finished"] * 1000,
        "failures": counters["spill_failures"] + counters["write_through_failures"],
        "restored_host_tokens": connector.tokens["host"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    overflow.add_arguments(parser, rounds=3, prompt_tokens=384, pool_tokens=768)
    args = parser.parse_args()
    engine = overflow.small_pool_engine(args)
    results: dict[str, list[dict]] = {setup: [] for setup in SETUPS}
    try:
        for repeat in range(args.repeats):
            for setup in SETUPS:
                row = run(engine, args, seed=repeat, write_through=setup == "on")
                results[setup].append(row)
                print(f"repeat {repeat} write-through {setup:3s} {row}", flush=True)
        attach_connector(engine, None)
    finally:
        engine.close()
    medians = overflow.report(args, "write-through", results, list(results["off"][0]), digits=4)
    off, on = medians["off"], medians["on"]
    print(
        f"\nTTFT off/on {off['median_ttft_ms'] / on['median_ttft_ms']:.3f}x; "
        f"host bytes on/off {on['host_written_mb'] / max(off['host_written_mb'], 1e-9):.2f}x"
    )


if __name__ == "__main__":
    main()
