"""16 concurrent streams, client disconnects, the concurrency limit, draining on shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from kvtier.server.app import create_app
from tests.server.conftest import (
    ALICE_KEY,
    MODEL,
    start_server,
    stop_server,
    tenant_config,
    wait_idle,
)

pytestmark = pytest.mark.slow


def test_16_concurrent_streams_no_leak(server, engine):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Write a word about the number {i}."}],
            max_tokens=4,
            temperature=0.7,
            seed=i,
            stream=True,
        )
        text, reason = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(
            base_url=server.v1, api_key=ALICE_KEY, max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(main())
    assert len(results) == 16
    assert all(reason in ("stop", "length") for _, reason in results)
    wait_idle(engine)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0


def test_client_disconnect_cancels_generation(server, engine):
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {ALICE_KEY}"}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", server.v1 + "/chat/completions", json=payload, headers=headers) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
        steps_at_disconnect = engine.num_steps
        # leaving the block closes the connection mid-stream
    wait_idle(engine, timeout=30)
    # aborted within a few steps, not run on to its 2,000 tokens
    assert engine.num_steps - steps_at_disconnect < 100
    # non-streaming: a client that gives up (timeout) cancels too
    payload["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.v1 + "/chat/completions", json=payload, headers=headers, timeout=2)
    steps_at_disconnect = engine.num_steps
    wait_idle(engine, timeout=30)
    assert engine.num_steps - steps_at_disconnect < 100


def test_concurrency_limit_429_and_drain(engine):
    srv, thread = start_server(create_app(engine, tenant_config(max_concurrent_requests=1)))
    headers = {"Authorization": f"Bearer {ALICE_KEY}"}
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 24,
        "ignore_eos": True,
        "stream": True,
    }
    result: dict = {}

    def hold() -> None:
        with (
            httpx.Client(timeout=120) as http,
            http.stream(
                "POST", srv.v1 + "/chat/completions", json=payload, headers=headers
            ) as resp,
        ):
            result["status"] = resp.status_code
            result["started"] = time.monotonic()
            result["body"] = "".join(resp.iter_lines())

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        deadline = time.monotonic() + 60
        while "started" not in result and time.monotonic() < deadline:
            time.sleep(0.05)
        assert result.get("status") == 200
        busy = httpx.post(srv.v1 + "/chat/completions", json=payload, headers=headers)
        assert busy.status_code == 429
        assert busy.json()["error"]["type"] == "rate_limit_error"
    finally:
        # Shut down while the stream runs: it must finish cleanly, not be cut off.
        stop_server(srv, thread)
        holder.join(timeout=60)
    assert result["body"].endswith("data: [DONE]")
    wait_idle(engine)
