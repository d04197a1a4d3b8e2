"""Where a resumed session's TTFT goes: the restore's stages, per source, from a profile.

    .venv/bin/python benchmarks/restore_stages.py \
        [--tokens 4096] [--repeats 3] [--threads 1] [--form full]

The same turn as `benchmarks/resume.py` (turn 1 prefills `--tokens`, the session is moved to
host, disk, then Redis, and the history + 16 new tokens is timed from each), run under
cProfile. Per source, the medians over the repeats of the engine thread's time in each stage
(cumulative time of the function that does it):

- add_request: tokenizing, the prefix lookup, the restore plan, starting prefetches;
- wait for prefetch: the engine waiting for chunks the prefetch workers read (and decode);
- tier read (engine thread): chunks read when they are needed (host: into the device blocks);
- pool writes: `write_blocks` of chunks that did not land in their blocks directly;
- forward: the prefill of the new tokens (attention over the whole restored context);
- TTFT: the turn's time to first token.

Stages overlap the workers' time, not each other's: the rest of the TTFT is scheduling,
sampling and the profile's own overhead.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import shutil
import statistics
import tempfile
from pathlib import Path

from local_redis import start_redis
from resume import MIB, all_tiers, ids, timed

from kvtier.cache.setup import attach_connector
from kvtier.engine import Engine, EngineConfig
from kvtier.policy.actions import Move

# stage -> (file suffix, function name) whose cumulative time it is
STAGES = {
    "add_request": ("engine/engine.py", "add_request"),
    "wait for prefetch": ("tiers/mover.py", "entry"),
    "tier read (engine thread)": ("tiers/store.py", "promote"),
    "pool writes": ("engine/kv_pool.py", "write_blocks"),
    "forward": ("engine/llama.py", "forward"),
}


def stage_ms(profile: cProfile.Profile) -> dict[str, float]:
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    found = dict.fromkeys(STAGES, 0.0)
    for (filename, _, name), (_, _, _, cumulative, _) in stats.items():
        for stage, (suffix, function) in STAGES.items():
            if name == function and filename.endswith(suffix):
                found[stage] += cumulative * 1000
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--form", default="full", help="the form of disk and remote")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-stages-"))
    redis_process, redis_url = start_redis(workdir)
    engine = Engine(
        EngineConfig(
            kv_cache_bytes=256 * MIB, max_model_len=args.tokens + 64, num_threads=args.threads
        )
    )
    sources = ["host", "disk", "remote"]
    table: dict[str, list[dict[str, float]]] = {s: [] for s in sources}
    try:
        for repeat in range(args.repeats):
            r = random.Random(repeat)
            tiers = all_tiers(workdir / str(repeat), redis_url, args.form)
            connector = attach_connector(engine, tiers, "retain")
            history = ids(r, args.tokens)
            history += timed(engine, history, "s").new_token_ids
            for source in sources:
                connector.runner.execute(Move("s", None, source))
                if not connector.flush(timeout=120):
                    raise RuntimeError(f"moving the session to {source} did not finish")
                profile = cProfile.Profile()
                profile.enable()
                out = timed(engine, history + ids(r, 16))
                profile.disable()
                stages = stage_ms(profile)
                stages["TTFT"] = out.metrics.ttft_s * 1000
                table[source].append(stages)
            attach_connector(engine, None)
    finally:
        engine.close()
        redis_process.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\nresumed {args.tokens}-token session ({args.form}), {args.threads} torch thread(s), "
        f"engine-thread ms per stage, medians of {args.repeats} (under cProfile)\n"
    )
    print("| stage | " + " | ".join(sources) + " |")
    print("|---|" + "---|" * len(sources))
    for stage in [*STAGES, "TTFT"]:
        cells = [f"{statistics.median(run[stage] for run in table[s]):.1f}" for s in sources]
        print(f"| {stage} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
