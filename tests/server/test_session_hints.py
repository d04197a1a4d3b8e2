"""Session hints through `kvtier serve`: the body's `kvtier_session`, the `X-Session-*` headers
and Dynamo's `nvext.agent_hints` reach the engine's session record; bad values and hints
without a session are 400s; `pin` pins the session's device blocks within the tenant's quota
(409 up front when its other sessions hold all of it), `close` unpins and drops them."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.session_hints import SessionHints
from tests.server.conftest import (
    ADMIN_KEY,
    ALICE_KEY,
    BOB_KEY,
    BOB_QUOTA_BLOCKS,
    MODEL,
    wait_idle,
)

pytestmark = pytest.mark.slow

PREFIX = (
    "You are the planning agent of a small logistics company. Each step, you read the "
    "shipment list, pick one tool to call and explain the choice in one short sentence."
)


def complete(server, key: str, text: str, session: str | None = None, **extra):
    """A two-token completion; `extra` goes to the openai client (extra_body, extra_headers)."""
    client = openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=120)
    headers = dict(extra.pop("extra_headers", None) or {})
    if session is not None:
        headers["X-Session-ID"] = session
    return client.completions.create(
        model=MODEL,
        prompt=f"{PREFIX} {text}",
        max_tokens=2,
        temperature=0,
        extra_headers=headers,
        **extra,
    )


def post(server, key: str, body: dict, headers: dict | None = None) -> httpx.Response:
    body = {"model": MODEL, "prompt": f"{PREFIX} Step.", "max_tokens": 2, **body}
    return httpx.post(
        server.v1 + "/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
        timeout=120,
    )


def last_hints(server, session_id: str) -> SessionHints:
    """The hints the engine's session tracker recorded with the session's latest turn."""
    engine = server.app.state.kvtier.engine
    return engine.sessions.turns(session_id)[-1].hints


def scraped(server, name: str, **labels: str) -> float:
    """The sample of /metrics named `name` whose labels include `labels` (0 if none)."""
    text = httpx.get(server.base_url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return 0.0


def owned_blocks(server, tenant: str, session: str) -> list[int]:
    cache = server.app.state.kvtier.tenant_cache
    return [b for b, owner in list(cache.owner.items()) if owner == (tenant, session)]


def pinned_blocks(server, tenant: str, session: str) -> int:
    return len(server.app.state.kvtier.tenant_cache.pinned.get((tenant, session), []))


def test_every_spelling_reaches_the_engines_session_record(server, engine):
    complete(
        server,
        ALICE_KEY,
        "Step one.",
        "h-body",
        extra_body={"kvtier_session": {"expect_return_s": 30, "priority": 2, "ttl_s": 600}},
    )
    assert last_hints(server, "alice/h-body") == SessionHints(
        expect_return_s=30.0, priority=2, ttl_s=600.0
    )
    complete(
        server,
        ALICE_KEY,
        "Step one.",
        "h-headers",
        extra_headers={
            "X-Session-Expect-Return": "12.5",
            "X-Session-Priority": "-3",
            "X-Session-TTL": "60",
        },
    )
    assert last_hints(server, "alice/h-headers") == SessionHints(
        expect_return_s=12.5, priority=-3, ttl_s=60.0
    )
    # Dynamo: priority read (clamped to kvtier's 8), the router's fields ignored
    dynamo = {"agent_hints": {"priority": 10, "osl": 512, "speculative_prefill": True}}
    complete(server, ALICE_KEY, "Step one.", "h-dynamo", extra_body={"nvext": dynamo})
    assert last_hints(server, "alice/h-dynamo") == SessionHints(priority=8)
    # field by field: the body's priority over the header's, the header's ttl kept
    complete(
        server,
        ALICE_KEY,
        "Step two.",
        "h-body",
        extra_headers={"X-Session-Priority": "1", "X-Session-TTL": "60"},
        extra_body={"kvtier_session": {"priority": 4}},
    )
    assert last_hints(server, "alice/h-body") == SessionHints(priority=4, ttl_s=60.0)
    # `user` names the session when no header does
    complete(server, ALICE_KEY, "Step one.", user="h-user", extra_body={"kvtier_session": {}})
    complete(server, ALICE_KEY, "Step two.", user="h-user", extra_headers={"X-Session-Pin": "1"})
    assert last_hints(server, "alice/h-user") == SessionHints(pin=True)
    # a turn without hints records none
    complete(server, ALICE_KEY, "Step three.", "h-body")
    assert last_hints(server, "alice/h-body") == SessionHints()
    counted = {hint: scraped(server, "kvtier:session_hints_total", hint=hint) for hint in
               ("priority", "ttl_s", "pin", "close")}  # fmt: skip
    assert counted == {"priority": 4, "ttl_s": 3, "pin": 1, "close": 0}
    server.app.state.kvtier.tenant_cache.unpin_all()
    wait_idle(engine)


@pytest.mark.parametrize(
    ("body", "headers", "param", "words"),
    [
        ({"kvtier_session": {"priority": 99}}, {}, "kvtier_session.priority", "less than"),
        ({"kvtier_session": {"ttl_s": -1}}, {}, "kvtier_session.ttl_s", "greater than"),
        ({"kvtier_session": {"pinn": True}}, {}, "kvtier_session.pinn", "did you mean pin"),
        ({"kvtier_session": {"close": "maybe"}}, {}, "kvtier_session.close", "boolean"),
        ({"kvtier_session": "pin"}, {}, "kvtier_session", "dictionary"),
        ({}, {"X-Session-TTL": "soon"}, "X-Session-TTL", "number"),
        ({}, {"X-Session-Priority": "9"}, "X-Session-Priority", "less than"),
        ({}, {"X-Session-Expect-Return": "-5"}, "X-Session-Expect-Return", "greater than"),
        (
            {"nvext": {"agent_hints": {"priority": "high"}}},
            {},
            "nvext.agent_hints.priority",
            "integer",
        ),
        ({"nvext": {"agent_hints": [1]}}, {}, "nvext.agent_hints", "object"),
    ],
)
def test_a_bad_hint_is_a_400_naming_its_field(server, engine, body, headers, param, words):
    session = "bad-" + param.replace(".", "-")
    resp = post(server, ALICE_KEY, body, {"X-Session-ID": session, **headers})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param
    assert words in error["message"]
    assert engine.sessions.turns(f"alice/{session}") == []  # refused before it ran


def test_hints_without_a_session_are_a_400(server, engine):
    for body, headers in [
        ({"kvtier_session": {"close": True}}, {}),
        ({}, {"X-Session-Pin": "true"}),
        ({"nvext": {"agent_hints": {"priority": 1}}}, {}),
    ]:
        resp = post(server, ALICE_KEY, body, headers)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["code"] == "session_required"
        assert "need a session" in error["message"]
    # Dynamo's router-only hints are not session hints: no session needed
    assert post(server, ALICE_KEY, {"nvext": {"agent_hints": {"osl": 64}}}).status_code == 200
    wait_idle(engine)


def test_pin_holds_the_sessions_blocks_until_a_close_drops_them(server, engine):
    engine.reset_prefix_cache()
    client = openai.OpenAI(base_url=server.v1, api_key=ALICE_KEY, max_retries=0, timeout=120)
    stream = client.completions.create(
        model=MODEL,
        prompt=f"{PREFIX} Which truck leaves first?",
        max_tokens=2,
        temperature=0,
        stream=True,
        extra_headers={"X-Session-ID": "agent-7", "X-Session-Pin": "true"},
    )
    assert [c.choices[0].finish_reason for c in stream][-1] in ("stop", "length")
    # pinned before the stream's end reached the client
    filled = owned_blocks(server, "alice", "agent-7")
    assert filled and pinned_blocks(server, "alice", "agent-7") == len(filled)
    assert all(engine.block_pool.ref_counts[b] == 1 for b in filled)  # held by the pin alone
    engine.reset_prefix_cache()  # drops every idle block: the pinned ones are not idle
    assert owned_blocks(server, "alice", "agent-7") == filled
    again = complete(server, ALICE_KEY, "Which truck leaves first?", "agent-8")
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # from the pinned blocks
    # an admin unpin withdraws the pin from the session's record, which the retention
    # policy's view reads
    assert last_hints(server, "alice/agent-7").pin
    unpin = httpx.post(
        server.base_url + "/admin/tenants/alice/sessions/agent-7/unpin",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert unpin.json()["unpinned_blocks"] == len(filled)
    assert not last_hints(server, "alice/agent-7").pin

    complete(server, ALICE_KEY, "Which truck leaves first? Now.", "agent-7",
             extra_body={"kvtier_session": {"close": True}})  # fmt: skip
    assert pinned_blocks(server, "alice", "agent-7") == 0
    assert owned_blocks(server, "alice", "agent-7") == []  # dropped from the device
    assert last_hints(server, "alice/agent-7").close
    wait_idle(engine)
    cold = complete(server, ALICE_KEY, "Which truck leaves first?", "agent-9")
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    server.app.state.kvtier.tenant_cache.clear_tenant("alice")
    wait_idle(engine)


def test_a_pin_past_the_tenants_quota_is_a_409_and_loses_nothing(server, engine):
    engine.reset_prefix_cache()
    pin = {"kvtier_session": {"pin": True}}
    long_text = "Fees? " + "please " * 100  # more blocks than bob's quota
    complete(server, BOB_KEY, long_text, "bob-1", extra_body=pin)
    assert pinned_blocks(server, "bob", "bob-1") == BOB_QUOTA_BLOCKS  # the quota, all of it

    refused = post(server, BOB_KEY, pin, {"X-Session-ID": "bob-2"})
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("quota_exceeded", "kvtier_session.pin")
    assert engine.sessions.turns("bob/bob-2") == []  # refused before it ran
    # nothing lost: the same session without the pin, the pinned session's next pinned turn
    assert complete(server, BOB_KEY, "Hours?", "bob-2").choices[0].text is not None
    complete(server, BOB_KEY, long_text + " Thanks.", "bob-1", extra_body=pin)
    assert pinned_blocks(server, "bob", "bob-1") == BOB_QUOTA_BLOCKS
    assert scraped(server, "kvtier:request_rejected_total", tenant="bob", status="409") == 1
    # closing the pinned session makes room for another
    complete(server, BOB_KEY, "Bye.", "bob-1", extra_body={"kvtier_session": {"close": True}})
    assert pinned_blocks(server, "bob", "bob-1") == 0
    assert post(server, BOB_KEY, pin, {"X-Session-ID": "bob-2"}).status_code == 200
    assert pinned_blocks(server, "bob", "bob-2") > 0
    server.app.state.kvtier.tenant_cache.clear_tenant("bob")
    wait_idle(engine)
