"""A restore counts against the tenant that asked for it: blocks loaded from the host tier
belong to the requesting tenant's quota, however long the restored history, so a tenant that
resumes long sessions recycles its own cache and never evicts another tenant's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.server.serve_process import BLOCK_BYTES, TEXT, ServeProcess

pytestmark = pytest.mark.slow

QUOTA_BLOCKS = 8
# 160 blocks hold the other tenant's document (44), the quota (8) and one running turn of
# ~1,160 tokens (73): whatever else stays on device is a quota that did not hold.
FLAGS = [
    "--threads",
    "1",
    "--kv-cache-bytes",
    str(160 * BLOCK_BYTES),
    "--log-level",
    "warning",
    "--tenant",
    f"acme:sk-acme:{QUOTA_BLOCKS * BLOCK_BYTES}",
    "--tenant",
    "beta:sk-beta",
    "--host-bytes",
    "1GiB",
    # LRU offload moves nothing that the device still has room for: what leaves it here is
    # pushed out by the pool, not chosen by a policy
    "--policy",
    "offload",
]


def _words(count: int, skip: int) -> str:
    return " ".join((TEXT / "plain_english.txt").read_text().split()[skip : skip + count])


def chat(base_url: str, key: str, session: str, content: str) -> dict[str, int]:
    client = OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=300)
    response = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": content}],
        max_tokens=4,
        temperature=0,
        extra_headers={"X-Session-ID": session},
    )
    assert response.usage is not None
    return (response.usage.model_extra or {})["kvtier"]["prompt_token_sources"]


def cached_blocks(base_url: str) -> dict[str, int]:
    tenants = httpx.get(base_url + "/admin/tenants", timeout=30).json()["data"]
    return {t["tenant"]: t["cached_blocks"] for t in tenants}


def test_long_restores_count_to_the_requesting_tenant_and_spare_the_others(tmp_path: Path):
    server = ServeProcess(tmp_path / "serve.log", *FLAGS).start()
    try:
        document = "Summarise: " + _words(600, skip=1700)
        chat(server.base_url, "sk-beta", "doc", document)
        for index in range(4):
            # ~1,160 tokens: a restore of 64 blocks, more than one step's 512 tokens
            text = f"Session {index}. " + _words(1000, skip=index * 300)
            chat(server.base_url, "sk-acme", f"s{index}", text)
            resumed = chat(server.base_url, "sk-acme", f"s{index}", text)
            assert resumed["host"] >= 1000, resumed
            blocks = cached_blocks(server.base_url)
            assert set(blocks) == {"acme", "beta"}, blocks  # nothing filled by nobody
            assert blocks["acme"] <= QUOTA_BLOCKS, blocks
        again = chat(server.base_url, "sk-beta", "doc", document)
    finally:
        server.stop()
    assert again["device"] >= 700, again  # beta's document never left the device
