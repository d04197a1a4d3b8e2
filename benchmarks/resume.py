"""TTFT of a resumed long session: KV restored from host, disk, Redis, or recomputed.

    flock /tmp/kvtier-measure.lock .venv/bin/python benchmarks/resume.py \
        --out out/resume_bench.json [--tokens 4096] [--repeats 3] [--threads 1]

One engine (the embedded SmolLM2, bf16, `--threads` torch threads). Each repeat:

- recompute: a fresh prompt of the resumed turn's length (`--tokens` + 17) on an engine with
  no tiers and an empty prefix cache: TTFT is its whole prefill;
- host, disk, remote: one connector with all three tiers; turn 1 prefills a `--tokens` prompt
  (1 output token); then, per source in turn, the policy runner executes
  `Move(session, all chunks, source)` (one payload per 256-token chunk, device blocks freed;
  a chunk restored by the previous source is demoted from the tier above), the writes are
  flushed, and turn 2 (the history + 16 new tokens, new ones per source) is timed.

TTFT = first token time - arrival; it includes the prefetch started at arrival, the restore
(loads + writes into the pool) and the prefill of the 17 tokens not restored. Medians of the
repeats are reported, with where the prompt tokens came from. Disk reads come from the page
cache (the segments were just written). Starts its own redis-server unless --redis-url.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
from pathlib import Path

from local_redis import start_redis

from kvtier.cache import TiersConfig
from kvtier.cache.connector import attach_connector
from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.engine.outputs import RequestOutput
from kvtier.policy.actions import Move

MIB = 1 << 20
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def all_tiers(workdir: Path, redis_url: str) -> TiersConfig:
    return TiersConfig(
        host_bytes=512 * MIB,
        disk_bytes=1024 * MIB,
        disk_dir=workdir / "disk",
        redis_url=redis_url,
        redis_bytes=1024 * MIB,
        redis_timeout_s=5.0,
    )


def ids(r: random.Random, n: int) -> list[int]:
    return [r.randrange(1000, 20000) for _ in range(n)]


def timed(engine: Engine, prompt: list[int], session: str | None = None) -> RequestOutput:
    """Run one request alone; its final output (metrics: TTFT, prompt token sources)."""
    rid = engine.add_request(prompt, ONE_TOKEN, session_id=session)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    return final


def recompute(engine: Engine, tokens: int, seed: int) -> RequestOutput:
    attach_connector(engine, None)
    engine.reset_prefix_cache()
    return timed(engine, ids(random.Random(seed), tokens + 17))


def restores(
    engine: Engine, tiers: TiersConfig, tokens: int, seed: int, sources: list[str]
) -> dict[str, RequestOutput]:
    r = random.Random(seed)
    connector = attach_connector(engine, tiers, "retain")
    session = f"bench-{seed}"
    history = ids(r, tokens)
    history += timed(engine, history, session).new_token_ids
    outputs = {}
    for source in sources:
        connector.runner.execute(Move(session, None, source))
        if not connector.flush(timeout=120):
            raise RuntimeError(f"moving the session to {source} did not finish")
        # the next turn has no session id, so the runner keeps turn 1's keys for the next move
        outputs[source] = timed(engine, history + ids(r, 16))
    attach_connector(engine, None)
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--redis-url")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-resume-"))
    redis_process = None
    redis_url = args.redis_url
    if redis_url is None:
        redis_process, redis_url = start_redis(workdir)
    engine = Engine(
        EngineConfig(
            kv_cache_bytes=256 * MIB, max_model_len=args.tokens + 64, num_threads=args.threads
        )
    )
    tiered = ["host", "disk", "remote"]
    sources = ["recompute", *tiered]
    results: dict[str, dict] = {s: {"ttft_s": [], "sources": None} for s in sources}

    def record(repeat: int, source: str, out: RequestOutput) -> None:
        where = {k: v for k, v in out.metrics.prompt_token_sources.items() if v}
        results[source]["ttft_s"].append(out.metrics.ttft_s)
        results[source]["sources"] = where
        print(f"repeat {repeat} {source:9s} ttft {out.metrics.ttft_s * 1000:8.1f} ms  {where}")

    try:
        for repeat in range(args.repeats):
            record(repeat, "recompute", recompute(engine, args.tokens, 1000 * repeat))
            tiers = all_tiers(workdir / str(repeat), redis_url)
            outs = restores(engine, tiers, args.tokens, 1000 * repeat + 1, tiered)
            for source in tiered:
                record(repeat, source, outs[source])
    finally:
        engine.close()
        if redis_process is not None:
            redis_process.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    base = statistics.median(results["recompute"]["ttft_s"])
    print(
        f"\nresumed {args.tokens}-token session, embedded SmolLM2 bf16, {args.threads} torch "
        f"thread(s), medians of {args.repeats}\n"
    )
    print("| restored from | median TTFT (ms) | vs recompute | prompt tokens by source |")
    print("|---|---|---|---|")
    for source in sources:
        median = statistics.median(results[source]["ttft_s"])
        results[source]["median_ttft_ms"] = median * 1000
        where = results[source]["sources"]
        print(f"| {source} | {median * 1000:.1f} | {base / median:.2f}x | {where} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "tokens": args.tokens,
                    "repeats": args.repeats,
                    "threads": args.threads,
                    "results": results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
