"""The official openai client against a real server: chat, completions, streams, sessions."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import ALICE_KEY, MODEL, wait_idle

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a helpful assistant for a small bakery. You answer questions about opening "
    "hours, bread, cakes and prices in one short sentence. Be friendly and precise."
)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key=ALICE_KEY, max_retries=0, timeout=120)


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_non_streaming(client, engine):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=4,
        temperature=0,
    )
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens <= 4
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0
    wait_idle(engine)


def test_chat_streaming_matches_greedy(client):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Count: 1, 2,"}],
        max_tokens=4,
        temperature=0,
    )
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 4


def test_completions(client):
    resp = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert resp.object == "text_completion"
    assert resp.choices[0].text
    stream = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == resp.choices[0].text


def test_multi_turn_session_hits_cache(client):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "When do you open on Sundays?"},
    ]
    headers = {"X-Session-ID": "conv-1"}
    first = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_headers=headers
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And on Mondays?"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_headers=headers
    )
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 32  # the system prompt at least


def test_vllm_multi_turn_benchmark_pattern(server, engine):
    """What vLLM's benchmark_serving_multi_turn.py sends: X-Session-ID, streamed chat."""
    url = server.v1 + "/chat/completions"
    headers = {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {ALICE_KEY}",
        "X-Session-ID": "bench-conv-7",
    }
    messages = [{"role": "user", "content": SYSTEM + " What bread do you have?"}]
    cached = []
    with httpx.Client(timeout=120) as http:
        for turn in range(2):
            payload = {
                "model": MODEL,
                "messages": messages,
                "seed": 0,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": 4,
                "min_tokens": 4,
                "ignore_eos": True,
            }
            text, usage = "", None
            with http.stream("POST", url, json=payload, headers=headers) as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk["choices"]:
                        text += choice["delta"].get("content") or ""
            assert usage["completion_tokens"] == 4  # ignore_eos honoured
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"Turn {turn}: and cakes?"},
            ]
    assert cached[1] > 0
    wait_idle(engine)


def test_metrics_and_health(server):
    health = httpx.get(server.base_url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    body = httpx.get(server.base_url + "/metrics").text
    for name in (
        "kvtier:num_requests_running",
        "kvtier:time_to_first_token_seconds_bucket",
        "kvtier:inter_token_latency_seconds_bucket",
        "kvtier:e2e_request_latency_seconds_bucket",
        "kvtier:prefix_cache_queries_total",
        "kvtier:prefix_cache_hits_total",
        "kvtier:kv_cache_usage_perc",
        "kvtier:request_success_total",
    ):
        assert name in body, name
    assert 'tenant="alice"' in body
