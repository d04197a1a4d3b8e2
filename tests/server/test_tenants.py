"""Tenant isolation (salted namespaces), quotas under a flooding tenant, the admin API."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from kvtier.server.app import create_app
from tests.server.conftest import (
    ADMIN_KEY,
    ALICE_KEY,
    BLOCK_BYTES,
    BOB_KEY,
    BOB_QUOTA_BLOCKS,
    CAROL_KEY,
    MODEL,
    start_server,
    stop_server,
    tenant_config,
    wait_idle,
)

pytestmark = pytest.mark.slow

PREFIX = (
    "You are the support assistant of the Riverside public library. Opening hours are 9 to "
    "18 on weekdays and 10 to 14 on Saturdays; the library is closed on Sundays. Members may "
    "borrow up to twelve items for three weeks and renew them twice online. Late fees are "
    "twenty cents per item per day. Answer in one sentence."
)


def chat(base: str, key: str, content: str, max_tokens: int = 2, session: str | None = None):
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": PREFIX}, {"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        extra_headers={"X-Session-ID": session} if session else None,
    )


def cached(resp) -> int:
    return resp.usage.prompt_tokens_details.cached_tokens


def admin(server, method: str, path: str, key: str = ADMIN_KEY) -> httpx.Response:
    return httpx.request(method, server.base_url + path, headers={"Authorization": f"Bearer {key}"})


def flood(server, key: str, n: int = 14) -> None:
    """n distinct long prompts, 4 at a time: more blocks than the pool holds."""

    async def main() -> None:
        async with openai.AsyncOpenAI(
            base_url=server.v1, api_key=key, max_retries=0, timeout=120
        ) as client:
            sem = asyncio.Semaphore(4)

            async def one(i: int) -> None:
                words = " ".join(f"item{i}-{j}" for j in range(30))
                async with sem:
                    await client.completions.create(
                        model=MODEL, prompt=f"Flood {i}: {words}", max_tokens=1
                    )

            await asyncio.gather(*(one(i) for i in range(n)))

    asyncio.run(main())


def test_no_cross_tenant_prefix_hits(server, engine):
    engine.reset_prefix_cache()
    assert cached(chat(server.v1, ALICE_KEY, "When are you open?")) == 0
    assert cached(chat(server.v1, ALICE_KEY, "When are you open?")) > 0  # alice hits
    assert cached(chat(server.v1, BOB_KEY, "When are you open?")) == 0  # bob does not
    wait_idle(engine)


def test_quota_protects_other_tenants_cache(server, engine):
    engine.reset_prefix_cache()
    chat(server.v1, ALICE_KEY, "Can I renew online?")
    flood(server, BOB_KEY)  # over the pool size, but bob recycles his own quota
    wait_idle(engine)
    assert cached(chat(server.v1, ALICE_KEY, "Can I renew online?")) >= 64
    tenants = {t["tenant"]: t for t in admin(server, "GET", "/admin/tenants").json()["data"]}
    bob = tenants["bob"]
    assert bob["quota_bytes"] == BOB_QUOTA_BLOCKS * BLOCK_BYTES
    assert bob["idle_bytes"] <= bob["quota_bytes"]
    assert bob["quota_evictions"] > 0
    assert tenants["alice"]["idle_blocks"] > 0


def test_without_quota_a_flood_evicts_others(server, engine):
    """The control: carol has no quota, so the same flood pushes alice's prefix out."""
    engine.reset_prefix_cache()
    chat(server.v1, ALICE_KEY, "Can I renew online?")
    flood(server, CAROL_KEY)
    wait_idle(engine)
    assert cached(chat(server.v1, ALICE_KEY, "Can I renew online?")) == 0


def test_admin_api(server, engine):
    engine.reset_prefix_cache()
    assert admin(server, "GET", "/admin/tenants", key=ALICE_KEY).status_code == 401
    assert httpx.get(server.base_url + "/admin/tenants").status_code == 401
    chat(server.v1, ALICE_KEY, "How many items?", session="s1")
    evicted = admin(server, "POST", "/admin/tenants/alice/sessions/s1/evict").json()
    assert evicted["evicted_blocks"] > 0
    assert cached(chat(server.v1, ALICE_KEY, "How many items?", session="s2")) == 0
    assert admin(server, "POST", "/admin/tenants/alice/clear").json()["evicted_blocks"] > 0
    assert cached(chat(server.v1, ALICE_KEY, "How many items?")) == 0
    missing = admin(server, "POST", "/admin/tenants/nobody/clear")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "tenant_not_found"
    wait_idle(engine)


def test_pin_survives_a_flood(server, engine):
    engine.reset_prefix_cache()
    chat(server.v1, ALICE_KEY, "Are you open on Sundays?", session="vip")
    pinned = admin(server, "POST", "/admin/tenants/alice/sessions/vip/pin").json()
    assert pinned["pinned_blocks"] > 0
    flood(server, CAROL_KEY)  # no quota: would evict alice's prefix (see the control above)
    assert cached(chat(server.v1, ALICE_KEY, "Are you open on Sundays?")) >= 64
    unpinned = admin(server, "POST", "/admin/tenants/alice/sessions/vip/unpin").json()
    assert unpinned["unpinned_blocks"] == pinned["pinned_blocks"]
    # bob's quota bounds what he may pin (his idle cache is already held to the quota)
    chat(server.v1, BOB_KEY, "Fees? " + "please " * 100, session="big")
    first = admin(server, "POST", "/admin/tenants/bob/sessions/big/pin").json()
    assert first["pinned_blocks"] == BOB_QUOTA_BLOCKS  # the quota dropped the rest already
    chat(server.v1, BOB_KEY, "Hours? " + "please " * 100, session="big2")
    refused = admin(server, "POST", "/admin/tenants/bob/sessions/big2/pin")
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "quota_exceeded"
    admin(server, "POST", "/admin/tenants/bob/clear")  # unpins too
    wait_idle(engine)


def test_one_tenant_cannot_take_every_request_slot(engine):
    """Four requests in flight, three tenants: one tenant gets at most two of them, so a
    flood from it leaves room for the others."""
    srv, thread = start_server(create_app(engine, tenant_config(max_concurrent_requests=4)))
    long_stream = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }

    async def main() -> tuple[list[int], int, list[dict]]:
        async with httpx.AsyncClient(base_url=srv.v1, timeout=120) as http:
            alice = {"Authorization": f"Bearer {ALICE_KEY}"}
            streams = [
                http.stream("POST", "/chat/completions", json=long_stream, headers=alice)
                for _ in range(4)
            ]
            responses = [await s.__aenter__() for s in streams]  # answered: running or 429
            try:
                refused = [r for r in responses if r.status_code == 429]
                errors = [json.loads(await r.aread())["error"] for r in refused]
                bob = await http.post(
                    "/chat/completions",
                    json={**long_stream, "max_tokens": 2, "stream": False},
                    headers={"Authorization": f"Bearer {BOB_KEY}"},
                )
            finally:
                for stream in streams:
                    await stream.__aexit__(None, None, None)  # alice's streams end: aborted
            return [r.status_code for r in responses], bob.status_code, errors

    try:
        statuses, bob_status, errors = asyncio.run(main())
    finally:
        stop_server(srv, thread)
    assert sorted(statuses) == [200, 200, 429, 429]
    assert all(e["type"] == "rate_limit_error" and "this tenant" in e["message"] for e in errors)
    assert bob_status == 200
    wait_idle(engine)
