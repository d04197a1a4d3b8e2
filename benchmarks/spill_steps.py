"""Engine step time with eviction spills on vs off: the spill's write is not in the step.

    .venv/bin/python benchmarks/spill_steps.py \
        --out out/spill_steps.json [--repeats 3] [--threads 1]

One engine (the embedded SmolLM2, bf16) with a device pool of `--pool-tokens` tokens, and
sessions that do not fit it: each round, every session runs a turn (its history plus new
tokens), so each turn's blocks evict another session's. Both setups have a disk tier with
AES-GCM at rest (a spill = gather, checksum, encrypt, append) and `restore="recompute"`, so
the model computes exactly the same tokens in both; the only difference is `spill_on_evict`.

Reported per setup (medians over repeats, setups alternating within a repeat): the engine's
step times (median, p90, max, sum), the number of chunks spilled and the time the mover's
worker spent writing them (`caller->disk` latency sum). If the writes ran inside the steps,
the steps' sum would grow by about the writes' sum; it does not.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import overflow_sessions as overflow

from kvtier.cache import TiersConfig
from kvtier.cache.setup import attach_connector
from kvtier.engine import Engine

MIB = 1 << 20


def tiers(workdir: Path, spill: bool, chunk_tokens: int) -> TiersConfig:
    return TiersConfig(
        chunk_tokens=chunk_tokens,
        host_bytes=0,
        disk_bytes=2048 * MIB,
        disk_dir=workdir,
        encrypt=True,
        restore="recompute",
        spill_on_evict=spill,
        swap_on_preempt=False,
        spill_queue=64,
    )


def run(engine: Engine, args: argparse.Namespace, seed: int) -> list[float]:
    """Rounds of turns over sessions that overflow the pool; each step's wall time."""
    r = random.Random(seed)
    steps: list[float] = []
    sessions = overflow.histories(r, args)
    for _ in range(args.rounds):
        for i, history in enumerate(sessions):
            rid = engine.add_request(history, overflow.FEW, session_id=f"s{i}")
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                outs = engine.step()
                steps.append(time.perf_counter() - start)
                for out in outs:
                    if out.request_id == rid:
                        history += out.new_token_ids
            history += overflow.random_tokens(r, args.turn_tokens)
    return steps


def summary(steps: list[float]) -> dict[str, float]:
    ordered = sorted(steps)
    return {
        "steps": len(steps),
        "median_ms": statistics.median(ordered) * 1000,
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1000,
        "max_ms": ordered[-1] * 1000,
        "sum_s": sum(ordered),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    overflow.add_arguments(parser, rounds=2, prompt_tokens=256, pool_tokens=512)
    args = parser.parse_args()
    engine = overflow.small_pool_engine(args)
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-spill-steps-"))
    results: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        for repeat in range(args.repeats):
            for setup in ("off", "on"):
                connector = attach_connector(
                    engine,
                    tiers(workdir / f"{repeat}-{setup}", setup == "on", args.chunk_tokens),
                    "retain",
                )
                steps = run(engine, args, seed=repeat)
                assert connector.flush(timeout=300)
                write = connector.store.snapshot()["moves"].get("caller->disk")
                row = summary(steps) | {
                    "spilled_chunks": connector.counters["spilled_chunks"],
                    "spill_failures": connector.counters["spill_failures"],
                    "write_sum_s": write["latency"]["sum_s"] if write else 0.0,
                }
                results[setup].append(row)
                print(f"repeat {repeat} spills {setup:3s} {row}", flush=True)
        attach_connector(engine, None)
    finally:
        engine.close()
        shutil.rmtree(workdir, ignore_errors=True)
    keys = ["steps", "median_ms", "p90_ms", "max_ms", "sum_s", "spilled_chunks", "write_sum_s"]
    overflow.report(args, "spills", results, keys, digits=3)


if __name__ == "__main__":
    main()
