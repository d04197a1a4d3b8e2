"""`vllm serve --kv-transfer-config` with the kvtier connector answers the openai client; two
tenants (vLLM's `cache_salt`, kvtier's namespace) never share KV: after vLLM's prefix cache
is emptied, a tenant's repeated prompt is filled by kvtier (usage.prompt_tokens_details
counts it as cached), the other tenant's same prompt is computed from scratch, and every
answer is the same greedy text."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import httpx
import pytest
from openai import OpenAI

from .conftest import REPO, VLLM_PYTHON, need_vllm

pytestmark = pytest.mark.slow

DOCUMENT = " ".join(
    f"Clause {i}: the tenant keeps its own ledger of shipments, invoices and returns."
    for i in range(40)
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_vllm()
    from kvtier.models.embedded import ensure_embedded_model

    tmp = tmp_path_factory.mktemp("vllm-serve")
    port = free_port()
    transfer = {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "tiers": {"host_bytes": "256MiB", "chunk_tokens": 128},
            "policy": {"name": "retain"},
        },
    }
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "src"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
    }
    log = (tmp / "serve.log").open("w")
    process = subprocess.Popen(
        [
            # `vllm serve` itself: vllm-cpu 0.32.0's `vllm` command fails on its own version
            # lookup (the distribution is named vllm-cpu); this module takes the same flags
            str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(ensure_embedded_model()),
            "--served-model-name", "smollm2", "--port", str(port), "--host", "127.0.0.1",
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
            "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(transfer),
        ],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while True:
            if process.poll() is not None:
                tail = (tmp / "serve.log").read_text()[-3000:]
                pytest.fail(f"vllm serve exited {process.returncode}: {tail}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("vllm serve did not become healthy in 600 s")
            time.sleep(1)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def ask(client: OpenAI, tenant: str) -> tuple[str, int]:
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": DOCUMENT + " Which clause mentions returns?"}],
        max_tokens=12,
        temperature=0,
        extra_body={"cache_salt": tenant, "kv_transfer_params": {"session_id": f"{tenant}-1"}},
    )
    details = reply.usage.prompt_tokens_details
    return reply.choices[0].message.content, (details.cached_tokens if details else 0) or 0


def test_two_tenants_through_the_openai_client(server):
    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    first, cached = ask(client, "acme")
    assert cached == 0
    assert httpx.post(f"{server}/reset_prefix_cache", timeout=30).status_code == 200
    again, cached_again = ask(client, "acme")
    assert again == first
    assert cached_again >= 128  # vLLM's cache was empty: these came from kvtier's host tier
    other, cached_other = ask(client, "beta")
    assert other == first
    assert cached_other == 0  # the same prompt under another tenant: nothing shared
