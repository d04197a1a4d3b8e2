"""TTFT of a resumed long session: KV restored from host, disk, Redis, or recomputed.

    .venv/bin/python benchmarks/resume.py --out out/resume_bench.json [--tokens 4096] [--repeats 3]

One engine (the embedded SmolLM2, bf16), one run. For each repeat and each source:
turn 1 prefills a fresh `--tokens`-token prompt (1 output token); then the session's KV leaves
the device: the policy runner executes `Move(session, all chunks, tier)` (one payload per
256-token chunk, device blocks freed), or, for "recompute", the prefix cache is reset; turn 2
(the history + 16 new tokens) is timed: TTFT = first token time - arrival, which includes the
restore (loads + writes into the pool) and the prefill of what was not restored. Medians of the
repeats are reported, with where the prompt tokens came from. Disk reads come from the page
cache (the segments were just written). Starts its own redis-server unless --redis-url.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from kvtier.cache import TiersConfig
from kvtier.cache.connector import attach_connector
from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.policy.actions import Move

MIB = 1 << 20


def start_redis(directory: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            break
        except redis.RedisError:
            time.sleep(0.02)
    return process, f"redis://127.0.0.1:{port}/0"


def tiers_for(source: str, workdir: Path, redis_url: str) -> TiersConfig | None:
    if source == "host":
        return TiersConfig(host_bytes=512 * MIB)
    if source == "disk":
        return TiersConfig(host_bytes=0, disk_bytes=1024 * MIB, disk_dir=workdir / "disk")
    if source == "remote":
        return TiersConfig(
            host_bytes=0, redis_url=redis_url, redis_bytes=1024 * MIB, redis_timeout_s=5.0
        )
    return None


def run(engine: Engine, tokens: int, seed: int, source: str) -> tuple[float, dict]:
    r = random.Random(seed)
    prompt = [r.randrange(1000, 20000) for _ in range(tokens)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    session = f"bench-{seed}-{source}"
    out = None
    rid = engine.add_request(prompt, one, session_id=session)
    first_ids: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                first_ids += o.new_token_ids
    if source == "recompute":
        engine.reset_prefix_cache()
    else:
        engine.connector.runner.execute(Move(session, None, source))
    second = prompt + first_ids + [r.randrange(1000, 20000) for _ in range(16)]
    rid = engine.add_request(second, one, session_id=session)
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
    return out.metrics.ttft_s, out.metrics.prompt_token_sources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--redis-url")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-resume-"))
    redis_process = None
    redis_url = args.redis_url
    if redis_url is None:
        redis_process, redis_url = start_redis(workdir)
    engine = Engine(EngineConfig(kv_cache_bytes=256 * MIB, max_model_len=args.tokens + 64))
    sources = ["recompute", "host", "disk", "remote"]
    results: dict[str, dict] = {s: {"ttft_s": [], "sources": None} for s in sources}
    try:
        for repeat in range(args.repeats):
            for source in sources:
                attach_connector(engine, tiers_for(source, workdir, redis_url), "retain")
                ttft, where = run(
                    engine, args.tokens, 1000 * repeat + sources.index(source), source
                )
                results[source]["ttft_s"].append(ttft)
                results[source]["sources"] = where
                print(
                    f"repeat {repeat} {source:9s} ttft {ttft * 1000:8.1f} ms  {where}", flush=True
                )
        attach_connector(engine, None)
    finally:
        if redis_process is not None:
            redis_process.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    base = statistics.median(results["recompute"]["ttft_s"])
    print(
        f"\nresumed {args.tokens}-token session, embedded SmolLM2 bf16, medians of {args.repeats}\n"
    )
    print("| restored from | median TTFT (ms) | vs recompute | prompt tokens by source |")
    print("|---|---|---|---|")
    for source in sources:
        median = statistics.median(results[source]["ttft_s"])
        results[source]["median_ttft_ms"] = median * 1000
        where = {k: v for k, v in results[source]["sources"].items() if v}
        print(f"| {source} | {median * 1000:.1f} | {base / median:.2f}x | {where} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"tokens": args.tokens, "repeats": args.repeats, "results": results}, indent=2
            )
        )


if __name__ == "__main__":
    main()
