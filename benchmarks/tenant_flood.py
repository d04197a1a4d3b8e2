"""One tenant's flood against another tenant's requests on `kvtier serve`.

Starts `kvtier serve` with two tenants, `a` and `b` (the flags after `--` are added), then:

1. alone: tenant b sends `--requests` chat requests one after another (a short question,
   `--b-max-tokens` tokens, greedy, `ignore_eos`);
2. flood: tenant a runs `--flood-clients` clients, each sending requests back to back (a
   prompt of about `--flood-prompt-words` words, distinct per request so that no prefix is
   shared, `--flood-max-tokens` tokens; a 429 is retried after 50 ms); `--warmup-s` later,
   tenant b sends its requests again, one after another, while the flood goes on.

For tenant b it reports the 429s out of its requests and the latency (send to full answer)
of those served, median and maximum, alone and under the flood; for tenant a, its requests
served and refused during the flood. `--src` serves another checkout's code (its `src`
folder on PYTHONPATH), to measure before and after a change on one machine in one sitting.

    .venv/bin/python benchmarks/tenant_flood.py \\
        --out out/tenant_flood.json -- --threads 2 --max-concurrent-requests 12
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from serve_child import start_serve

MODEL = "smollm2"
KEYS = {"a": "sk-tenant-a", "b": "sk-tenant-b"}
TEXT = Path(__file__).resolve().parents[1] / "src/kvtier/data/text"


@dataclass
class Phase:
    statuses: list[int] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)  # of the requests served

    def summary(self) -> dict[str, float | int | None]:
        served = self.latencies_s
        return {
            "requests": len(self.statuses),
            "refused_429": self.statuses.count(429),
            "other_errors": sum(s not in (200, 429) for s in self.statuses),
            "latency_p50_s": statistics.median(served) if served else None,
            "latency_max_s": max(served) if served else None,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--b-max-tokens", type=int, default=8)
    parser.add_argument("--flood-clients", type=int, default=12)
    parser.add_argument("--flood-prompt-words", type=int, default=600)
    parser.add_argument("--flood-max-tokens", type=int, default=64)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--src", type=Path, default=None, help="serve this checkout's src")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("serve_flags", nargs="*", help="more `kvtier serve` flags, after --")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    flags = [f"--tenant={name}:{key}" for name, key in KEYS.items()] + args.serve_flags
    base_url, server = start_serve(flags, args.out.with_suffix(".log"), args.src)
    try:
        result = asyncio.run(measure(base_url, args))
    finally:
        server.terminate()
        server.wait(timeout=60)
    result["config"] = {**vars(args), "src": str(args.src), "out": str(args.out), "flags": flags}
    args.out.write_text(json.dumps(result, indent=2))
    alone, flood = result["b_alone"], result["b_under_flood"]
    print(
        f"tenant b, {args.requests} requests: 429s {alone['refused_429']} alone, "
        f"{flood['refused_429']} under the flood; latency p50 / max "
        f"{_s(alone['latency_p50_s'])} / {_s(alone['latency_max_s'])} alone, "
        f"{_s(flood['latency_p50_s'])} / {_s(flood['latency_max_s'])} under the flood; "
        f"tenant a during the flood: {result['a_flood']['served']} served, "
        f"{result['a_flood']['refused_429']} x 429"
    )


async def measure(base_url: str, args: argparse.Namespace) -> dict:
    words = " ".join(
        (TEXT / name).read_text() for name in sorted(os.listdir(TEXT)) if name.endswith(".txt")
    ).split()
    async with httpx.AsyncClient(base_url=base_url + "/v1", timeout=600) as http:
        await ask(http, "b", "Say hello.", args.b_max_tokens)  # warm-up, not counted
        alone = await tenant_b(http, args)
        stop = asyncio.Event()
        counter = itertools.count()
        flood_statuses: list[int] = []

        async def flooder() -> None:
            while not stop.is_set():
                i = next(counter)
                start = (i * 97) % max(1, len(words) - args.flood_prompt_words)
                text = " ".join(words[start : start + args.flood_prompt_words])
                prompt = f"Request {i}. Summarise this text. {text}"
                status, _ = await ask(http, "a", prompt, args.flood_max_tokens)
                flood_statuses.append(status)
                if status == 429:
                    await asyncio.sleep(0.05)

        clients = [asyncio.create_task(flooder()) for _ in range(args.flood_clients)]
        await asyncio.sleep(args.warmup_s)
        under_flood = await tenant_b(http, args)
        stop.set()
        for client in clients:
            client.cancel()  # in-flight requests are aborted with their connections
        await asyncio.gather(*clients, return_exceptions=True)
    return {
        "b_alone": alone.summary(),
        "b_under_flood": under_flood.summary(),
        "a_flood": {
            "served": flood_statuses.count(200),
            "refused_429": flood_statuses.count(429),
        },
        "b_latencies_s": {"alone": alone.latencies_s, "under_flood": under_flood.latencies_s},
    }


async def tenant_b(http: httpx.AsyncClient, args: argparse.Namespace) -> Phase:
    phase = Phase()
    for i in range(args.requests):
        status, seconds = await ask(http, "b", f"Question {i}: name a colour.", args.b_max_tokens)
        phase.statuses.append(status)
        if status == 200:
            phase.latencies_s.append(seconds)
    return phase


async def ask(http: httpx.AsyncClient, tenant: str, content: str, max_tokens: int) -> tuple:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    started = time.perf_counter()
    resp = await http.post(
        "/chat/completions", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"}
    )
    return resp.status_code, time.perf_counter() - started


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


if __name__ == "__main__":
    main()
