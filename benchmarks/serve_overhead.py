"""HTTP overhead of `kvtier serve`: the same multi-turn workload through the in-process engine
and through a real `kvtier serve` on loopback, side by side in one run.

Workload: the `quick` generator preset shrunk to `--sessions` sessions (every turn's chat
messages, history resent as a chat app does). Each session runs closed-loop, its next turn sent
as soon as the previous answer ends; all sessions run at once (session k starts
`k * --stagger-s` late), so the concurrency is the number of sessions in both setups. Greedy,
`ignore_eos`, `max_tokens` = the turn's answer length (capped by `--max-output-tokens`), so
both setups generate the same number of tokens.

- in-process: `Engine.stream(messages, ..., session_id=...)` in this process (the API the
  server itself calls), timed around the async iterator;
- HTTP: `kvtier serve` started as a subprocess with the same engine settings, driven by
  streaming httpx clients (`POST /v1/chat/completions`, `stream: true`, `X-Session-ID`), as
  vLLM's multi-turn benchmark does; timed client-side, SSE parsing included.

TTFT is send -> first chunk with text; ITL the gaps between chunks with text. Each repeat runs
both setups (alternating which goes first) from a cold prefix cache; reported figures are the
medians over repeats of each repeat's p50 / p99. Overhead = HTTP / in-process - 1.

    .venv/bin/python benchmarks/serve_overhead.py \\
        --threads 1 --sessions 4 --repeats 5 --out out/serve_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.workload.generator import generate
from kvtier.workload.model import Request, flatten
from kvtier.workload.presets import preset_config

MODEL = "smollm2"


@dataclass
class Timing:
    """One request as its client saw it."""

    ttft_s: float
    itl_s: list[float]
    chunks: int
    engine_ttft_s: float | None = None  # the engine's own TTFT (arrival -> first token)


@dataclass
class SetupResult:
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    requests: int
    wall_s: float
    # Client-side mean TTFT minus the engine's own mean TTFT over the same requests: the time
    # spent outside the engine (HTTP, tokenizing, hand-offs). Paired within one run, so it
    # does not move with the machine's load as the percentiles do.
    outside_engine_ms: float = 0.0


@dataclass
class Repeat:
    order: list[str]
    results: dict[str, SetupResult] = field(default_factory=dict)


def timing_of(sent: float, chunk_times: list[float], engine_ttft_s: float | None = None) -> Timing:
    if not chunk_times:
        raise RuntimeError("a request produced no text")
    gaps = [b - a for a, b in itertools.pairwise(chunk_times)]
    return Timing(chunk_times[0] - sent, gaps, len(chunk_times), engine_ttft_s)


def summarize(timings: list[Timing], wall_s: float, engine_ttft_mean_s: float) -> SetupResult:
    ttft = np.array([t.ttft_s for t in timings])
    itl = np.array([g for t in timings for g in t.itl_s])
    return SetupResult(
        float(np.percentile(ttft, 50)),
        float(np.percentile(ttft, 99)),
        float(np.percentile(itl, 50)),
        float(np.percentile(itl, 99)),
        len(timings),
        wall_s,
        (float(ttft.mean()) - engine_ttft_mean_s) * 1000,
    )


# ----- the two clients: one turn in, one Timing out -----------------------------------------

Send = Callable[[Request, str, int], Awaitable[Timing]]


def in_process_sender(engine: Engine) -> Send:
    async def send(request: Request, session: str, max_tokens: int) -> Timing:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        sent = time.perf_counter()
        times = []
        engine_ttft = None
        # "anonymous/<session>": the session id the server gives an anonymous caller's turn
        async for out in engine.stream(request.messages, params, session_id=f"anonymous/{session}"):
            if out.delta_text:
                times.append(time.perf_counter())
            if out.finished and out.metrics is not None:
                engine_ttft = out.metrics.ttft_s
        return timing_of(sent, times, engine_ttft)

    return send


def http_sender(client: httpx.AsyncClient) -> Send:
    async def send(request: Request, session: str, max_tokens: int) -> Timing:
        body = {
            "model": MODEL,
            "messages": request.messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        sent = time.perf_counter()
        times = []
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Session-ID": session}
        ) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    times.append(time.perf_counter())
        return timing_of(sent, times)

    return send


async def server_ttft_totals(client: httpx.AsyncClient) -> tuple[float, float]:
    """(sum, count) of the server's own TTFT histogram, over every tenant."""
    text = (await client.get("/metrics")).text
    totals = {"sum": 0.0, "count": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name != "kvtier:time_to_first_token_seconds":
            continue
        for sample in family.samples:
            kind = sample.name.rsplit("_", 1)[-1]
            if kind in totals:
                totals[kind] += sample.value
    return totals["sum"], totals["count"]


async def run_workload(
    send: Send,
    sessions: dict[str, list[Request]],
    tag: str,
    max_output: int,
    client: httpx.AsyncClient | None = None,
    stagger_s: float = 0.0,
) -> SetupResult:
    """Run the sessions concurrently, session k starting k * `stagger_s` in; `client` set:
    the engine TTFT comes from its /metrics."""
    before = await server_ttft_totals(client) if client is not None else None

    async def one_session(k: int, session_id: str, turns: list[Request]) -> list[Timing]:
        await asyncio.sleep(k * stagger_s)
        return [
            await send(turn, f"{session_id}-{tag}", min(turn.output_tokens, max_output))
            for turn in turns
        ]

    started = time.perf_counter()
    per_session = await asyncio.gather(
        *(one_session(k, s, t) for k, (s, t) in enumerate(sessions.items()))
    )
    wall = time.perf_counter() - started
    timings = [t for per in per_session for t in per]
    if before is not None:
        after = await server_ttft_totals(client)
        engine_mean = (after[0] - before[0]) / (after[1] - before[1])
    else:
        engine_mean = statistics.fmean(t.engine_ttft_s for t in timings)
    return summarize(timings, wall, engine_mean)


# ----- the server subprocess ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "kvtier.cli",
        "serve",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--device",
        "cpu",
        "--kv-cache-bytes",
        str(args.kv_cache_bytes),
        "--num-threads",
        str(args.threads),
        "--served-model-name",
        MODEL,
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    server = subprocess.Popen(command, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"kvtier serve exited with {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.terminate()
    raise RuntimeError("kvtier serve did not become healthy in 180 s")


# ----- the run -----------------------------------------------------------------------------


def workload_sessions(args: argparse.Namespace) -> dict[str, list[Request]]:
    config = preset_config("quick", sessions=args.sessions, document_share=args.document_share)
    sessions: dict[str, list[Request]] = {}
    for request in flatten(generate(config, seed=args.seed)):
        turns = sessions.setdefault(request.session_id, [])
        if len(turns) < args.max_turns:
            turns.append(request)
    return sessions


async def measure(args: argparse.Namespace) -> dict:
    sessions = workload_sessions(args)
    engine = Engine(
        EngineConfig(
            dtype=args.dtype,
            device="cpu",
            kv_cache_bytes=args.kv_cache_bytes,
            num_threads=args.threads,
        )
    )
    port = free_port()
    server = start_server(args, port)
    base = f"http://127.0.0.1:{port}"
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
            senders = {"in-process": in_process_sender(engine), "http": http_sender(client)}
            scraped = {"in-process": None, "http": client}

            async def cold() -> None:
                engine.reset_prefix_cache()
                (await client.post("/admin/tenants/anonymous/clear")).raise_for_status()

            # warm both (first calls pay one-off costs), then start cold
            warm = {"w": next(iter(sessions.values()))[:1]}
            for name, send in senders.items():
                await run_workload(send, warm, f"warm-{name}", 4, scraped[name])
            repeats = []
            for r in range(args.repeats):
                order = ["in-process", "http"] if r % 2 == 0 else ["http", "in-process"]
                repeat = Repeat(order)
                for name in order:
                    await cold()
                    repeat.results[name] = await run_workload(
                        senders[name],
                        sessions,
                        f"r{r}",
                        args.max_output_tokens,
                        scraped[name],
                        args.stagger_s,
                    )
                    print(f"repeat {r} {name}: {repeat.results[name]}", flush=True)
                repeats.append(repeat)
    finally:
        server.terminate()
        server.wait(timeout=60)
        engine.close()
    return report(args, sessions, repeats)


def report(args: argparse.Namespace, sessions: dict, repeats: list[Repeat]) -> dict:
    def med(setup: str, name: str) -> float:
        return statistics.median(getattr(r.results[setup], name) for r in repeats)

    def spread(setup: str, name: str) -> list[float]:
        values = [getattr(r.results[setup], name) for r in repeats]
        return [min(values), max(values)]

    def overhead(name: str) -> float:
        return statistics.median(
            getattr(r.results["http"], name) / getattr(r.results["in-process"], name) - 1
            for r in repeats
        )

    metrics = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "wall_s")
    summary = {
        name: {
            "in-process": med("in-process", name),
            "http": med("http", name),
            "overhead": overhead(name),
            "in-process_range": spread("in-process", name),
            "http_range": spread("http", name),
        }
        for name in metrics
    }
    # What HTTP adds per request beyond the in-process stream, as a share of the TTFT p50.
    added_ms = statistics.median(
        r.results["http"].outside_engine_ms - r.results["in-process"].outside_engine_ms
        for r in repeats
    )
    summary["outside_engine_ms"] = {
        "in-process": med("in-process", "outside_engine_ms"),
        "http": med("http", "outside_engine_ms"),
        "http_added_ms": added_ms,
        "http_added_share_of_ttft_p50": added_ms / 1000 / med("in-process", "ttft_p50_s"),
    }
    return {
        "command": " ".join(sys.argv),
        "settings": vars(args),
        "requests_per_repeat": sum(len(t) for t in sessions.values()),
        "prompt_tokens_max": max(r.prompt_tokens for t in sessions.values() for r in t),
        "summary": summary,
        "repeats": [
            {"order": r.order, **{k: asdict(v) for k, v in r.results.items()}} for r in repeats
        ],
    }


def print_table(result: dict) -> None:
    print(f"\n{result['requests_per_repeat']} requests per repeat, medians of repeats")
    print("| metric | in-process (min-max) | HTTP (min-max) | overhead |")
    print("|---|---|---|---|")
    summary = dict(result["summary"])
    outside = summary.pop("outside_engine_ms")

    def ms(row: dict, setup: str) -> str:
        low, high = row[f"{setup}_range"]
        return f"{row[setup] * 1000:.0f} ms ({low * 1000:.0f}-{high * 1000:.0f})"

    for name, row in summary.items():
        label = name.removesuffix("_s").replace("_", " ")
        print(
            f"| {label} | {ms(row, 'in-process')} | {ms(row, 'http')} "
            f"| {row['overhead'] * 100:+.1f}% |"
        )
    print(
        f"| mean TTFT outside the engine | {outside['in-process']:.2f} ms "
        f"| {outside['http']:.2f} ms | +{outside['http_added_ms']:.2f} ms = "
        f"{outside['http_added_share_of_ttft_p50'] * 100:.2f}% of TTFT p50 |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=4, help="concurrent sessions")
    parser.add_argument("--max-turns", type=int, default=2, help="turns kept per session")
    parser.add_argument("--document-share", type=float, default=0.25)
    parser.add_argument("--max-output-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--stagger-s",
        type=float,
        default=0.5,
        help="session k starts k * this late: first turns arriving in lockstep would make TTFT "
        "hinge on which of them a few ms of jitter lets into the first step",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both setups")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    print_table(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
