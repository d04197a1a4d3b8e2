"""`vllm serve --kv-transfer-config` with the kvtier connector answers the openai client; two
tenants (vLLM's `cache_salt`, kvtier's namespace) never share KV: after vLLM's prefix cache
is emptied, a tenant's repeated prompt is filled by kvtier (usage.prompt_tokens_details
counts it as cached), the other tenant's same prompt is computed from scratch, and every
answer is the same greedy text. vLLM's /metrics carries kvtier's series under kvtier serve's
names, and its log kvtier's stats line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.server.serve_process import metric

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
def serve_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-serve")


@pytest.fixture(scope="module")
def server(serve_dir):
    need_vllm()
    from kvtier.models.embedded import ensure_embedded_model

    tmp = serve_dir
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
        "VLLM_LOG_STATS_INTERVAL": "2",  # the stats line (with kvtier's) every 2 s
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


LEDGER = " ".join(
    f"Entry {i}: the courier signs for parcel {i} at the loading dock." for i in range(40)
)
SOURCES = ("device", "host", "disk", "remote", "recomputed")


def sources_on(text: str) -> dict[str, float]:
    name = "kvtier:prompt_tokens_by_source_total"
    return {source: metric(text, name, source=source) for source in SOURCES}


def turn_counted(server: str, before: dict[str, float], prompt_tokens: int) -> dict[str, float]:
    """The change of kvtier's prompt-token series once a turn's prompt is all counted: vLLM
    records a step's stats in its front end beside (not before) the answer it sends."""
    deadline = time.monotonic() + 30
    while True:
        now = sources_on(httpx.get(f"{server}/metrics", timeout=10).text)
        change = {source: now[source] - before[source] for source in SOURCES}
        if sum(change.values()) >= prompt_tokens or time.monotonic() > deadline:
            return change
        time.sleep(0.5)


def families(text: str) -> dict[str, tuple[str, frozenset[str], frozenset[str]]]:
    """kvtier's series in a /metrics text: name -> (type, sample names, label names)."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("kvtier:"):
            samples = [s for s in family.samples if not s.name.endswith("_created")]
            labels = frozenset(label for s in samples for label in s.labels)
            out[family.name] = (family.type, frozenset(s.name for s in samples), labels)
    return out


def serve_families() -> dict[str, tuple[str, frozenset[str], frozenset[str]]]:
    """The same series as `kvtier serve` exposes them (one of each, every label in use)."""
    from kvtier.engine.outputs import EngineStats
    from kvtier.server.metrics import ServerMetrics

    metrics = ServerMetrics("smollm2")
    metrics.prompt_tokens_by_source.labels("smollm2", "acme", "host").inc(128)
    figures = {"used_bytes": 1, "capacity_bytes": 2, "chunks": 1, "bytes_read": 1}
    figures |= {"read_seconds": 1, "bytes_written": 1, "write_seconds": 1}
    tiers = {"policy": "retain", "decisions": {"keep": 1}, "tiers": {"host": figures}}
    stats = EngineStats(0, 0, 16, 0, 0, 0.0, 0, 0, 0, 0, 0, tiers=tiers)
    return families(metrics.render(stats, []).decode())


def test_kvtier_series_in_vllm_metrics_under_serve_names(server, serve_dir):
    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    question = {"role": "user", "content": LEDGER + " Which entry is the last one?"}

    def turn(messages: list[dict]) -> tuple[str, int, int]:
        reply = client.chat.completions.create(
            model="smollm2",
            messages=messages,
            max_tokens=12,
            temperature=0,
            extra_body={"kv_transfer_params": {"session_id": "ledger-1"}},
        )
        details = reply.usage.prompt_tokens_details
        cached = (details.cached_tokens if details else 0) or 0
        return reply.choices[0].message.content, reply.usage.prompt_tokens, cached

    before = sources_on(httpx.get(f"{server}/metrics", timeout=10).text)
    # a first turn: nothing to restore, its prompt recomputed
    answer, prompt, cached = turn([question])
    assert cached == 0
    first = turn_counted(server, before, prompt)
    assert first == {**dict.fromkeys(SOURCES, 0), "recomputed": prompt}

    # vLLM's cache emptied, the conversation resumes: its prefix comes from the host tier
    assert httpx.post(f"{server}/reset_prefix_cache", timeout=30).status_code == 200
    text = httpx.get(f"{server}/metrics", timeout=10).text
    before, restored_before = sources_on(text), metric(text, "kvtier:restored_chunks_total")
    vllm_host_before = metric(text, "vllm:prompt_tokens_cached_by_source_total", source="host")
    follow_up = {"role": "user", "content": "And which entry comes first?"}
    _, prompt, cached = turn([question, {"role": "assistant", "content": answer}, follow_up])
    assert cached >= 128
    resumed = turn_counted(server, before, prompt)
    assert resumed["host"] == cached  # what vLLM's usage counts as cached, kvtier restored
    assert resumed["recomputed"] == prompt - cached
    assert resumed["device"] == resumed["disk"] == resumed["remote"] == 0

    text = httpx.get(f"{server}/metrics", timeout=10).text
    assert metric(text, "kvtier:restored_chunks_total") - restored_before == cached // 128
    # vLLM's own series names the tier too (get_external_cache_hit_sources)
    vllm_host = metric(text, "vllm:prompt_tokens_cached_by_source_total", source="host")
    assert vllm_host - vllm_host_before == cached
    assert metric(text, "kvtier:load_seconds_total") > 0
    assert metric(text, "kvtier:tier_read_bytes_total", tier="host") > 0
    assert metric(text, "kvtier:written_through_chunks_total") > 0
    used = metric(text, "kvtier:tier_used_bytes", tier="host")
    # the budget: host_bytes, less what whole chunk slots leave unused
    assert 0 < used <= metric(text, "kvtier:tier_capacity_bytes", tier="host") <= 256 << 20
    assert metric(text, "kvtier:restore_failures_total") == 0

    # the names, types and labels kvtier serve uses: one dashboard reads both
    vllm, serve = families(text), serve_families()
    shared = {
        "prompt_tokens_by_source", "tier_used_bytes", "tier_capacity_bytes", "tier_chunks",
        "tier_read_bytes", "tier_read_seconds", "tier_written_bytes", "tier_write_seconds",
        "tier_errors", "policy_decisions",
    }  # fmt: skip
    for name in (f"kvtier:{s}" for s in shared):
        assert name in vllm and name in serve, name
        kind, samples, labels = vllm[name]
        assert kind == serve[name][0], name
        if samples:  # a counter is exposed with `_total` by both
            assert samples == serve[name][1], name
            assert labels - {"engine"} == serve[name][2] - {"tenant"}, name

    # vLLM's stats line carries kvtier's counts
    log = serve_dir / "serve.log"
    deadline = time.monotonic() + 30
    while "prompt_tokens_by_source{source=host}=" not in log.read_text():
        assert time.monotonic() < deadline, "no kvtier counts in vLLM's stats line"
        time.sleep(1)
    line = next(x for x in log.read_text().splitlines() if "source=host}=" in x)
    assert "KV Transfer metrics: " in line
