"""Bad input -> 4xx with OpenAI's error JSON, never a 500."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import ALICE_KEY, MODEL, wait_idle

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {ALICE_KEY}"}
CHAT = [{"role": "user", "content": "hi"}]


def post(server, path: str, body=None, content: bytes | None = None, headers=AUTH):
    return httpx.post(
        server.v1 + path,
        json=body if content is None else None,
        content=content,
        headers={**headers, "Content-Type": "application/json"},
        timeout=60,
    )


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": CHAT, "max_tokens": "abc"}, "max_tokens"),
        ({"model": MODEL, "messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": CHAT, "max_tokens": 2.5}, "max_tokens"),
        ({"model": MODEL, "messages": CHAT, "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "messages": CHAT, "temperature": -1}, "temperature"),
        ({"model": MODEL, "messages": CHAT, "top_p": 0}, "top_p"),
        ({"model": MODEL, "messages": CHAT, "stream": "yes"}, "stream"),
        ({"model": MODEL, "messages": CHAT, "n": 2}, "n"),
        ({"model": MODEL, "messages": CHAT, "stop": 5}, "stop"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": MODEL, "messages": [{"content": "x"}]}, "messages.0.role"),
        ({"model": 7, "messages": CHAT}, "model"),
        ({"messages": CHAT}, "model"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            None,
        ),
        ({"model": MODEL, "messages": CHAT, "logprobs": True}, "logprobs"),
    ],
)
def test_bad_chat_fields(server, body, param):
    error = assert_error(post(server, "/chat/completions", body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "content", [b"{not json", b"", b"[1, 2]", b'"a string"', b"null", b"\xff\xfe"]
)
def test_malformed_json(server, content):
    assert_error(post(server, "/chat/completions", content=content), 400)


def test_bad_completion_prompts(server):
    for prompt in (None, 5, [], [[1, 2]], [-1], [10**9], ""):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        assert_error(post(server, "/completions", body), 400)
    body = {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1}
    assert_error(post(server, "/completions", body), 400, "prompt")


def test_oversize_prompt_and_body(server, engine):
    long_prompt = "word " * 1500  # > max_prompt_tokens (1024), < the 64 KiB body limit
    error = assert_error(
        post(server, "/completions", {"model": MODEL, "prompt": long_prompt}), 400, "prompt"
    )
    assert error["code"] == "context_length_exceeded"
    huge = "word " * 20_000  # > 64 KiB
    assert_error(post(server, "/completions", {"model": MODEL, "prompt": huge}), 413)
    wait_idle(engine)


def test_unknown_model(server):
    error = assert_error(
        post(server, "/chat/completions", {"model": "gpt-9", "messages": CHAT}), 404, "model"
    )
    assert error["code"] == "model_not_found"


def test_missing_and_invalid_key(server):
    body = {"model": MODEL, "messages": CHAT}
    assert assert_error(post(server, "/chat/completions", body, headers={}), 401)["code"] == (
        "missing_api_key"
    )
    bad = {"Authorization": "Bearer sk-nope"}
    assert assert_error(post(server, "/chat/completions", body, headers=bad), 401)["code"] == (
        "invalid_api_key"
    )
    assert_error(post(server, "/chat/completions", body, headers={"Authorization": "Basic x"}), 401)
    assert httpx.get(server.v1 + "/models").status_code == 401


def test_openai_client_sees_typed_errors(server):
    client = openai.OpenAI(base_url=server.v1, api_key=ALICE_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=-3)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0).models.list()


def test_unknown_route_and_method(server):
    assert_error(httpx.get(server.v1 + "/nope"), 404)
    assert_error(httpx.get(server.v1 + "/chat/completions", headers=AUTH), 405)
