"""`kvtier serve` with tiers and the cost policy: a session pushed off the device comes back
from host, disk or Redis (the usage split says which) with the answer the server gives
without tiers, where it recomputes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.host_dtype import AUTO_DTYPE
from tests.server.serve_process import (
    BIN,
    SMALL_POOL,
    ServeProcess,
    Turn,
    conversation,
    first_turn,
    metric,
    second_turn,
)
from tests.tiers.conftest import RedisServer

pytestmark = pytest.mark.slow


def check_restored(turns: tuple[Turn, Turn], reference: tuple[Turn, Turn], tier: str) -> None:
    first, second = turns
    assert first.text == reference[0].text
    assert second.sources[tier] >= 128, second.sources  # the first turn's history, at least
    assert second.text == reference[1].text  # restored KV gives the recomputed answer
    # every prompt token not recomputed counts as cached, restored ones too
    total = sum(second.sources.values())
    assert second.cached_tokens == total - second.sources["recomputed"]
    assert second.cached_tokens > reference[1].cached_tokens


def test_host_tier_restores_a_session_pushed_off_the_device(tmp_path: Path, reference):
    server = ServeProcess(tmp_path / "serve.log", *SMALL_POOL, "--host-bytes", "64MiB").start()
    try:
        turns = conversation(server.base_url)
        metrics = server.metrics()
    finally:
        server.stop()
    check_restored(turns, reference, "host")
    # dtype auto: what this host multiplies natively, and the pool sized for it in blocks
    assert f"{AUTO_DTYPE} on " in server.output
    assert re.search(r" on cpu, prefill attention by (kernel|torch)\n", server.output)
    assert "device KV pool: 16 blocks x 16 tokens" in server.output
    assert "tiers: host 67.1 MB" in server.output
    assert "policy: cost" in server.output
    restored = metric(metrics, "kvtier:prompt_tokens_by_source_total", source="host")
    assert restored == turns[1].sources["host"]
    assert metric(metrics, "kvtier:tier_capacity_bytes", tier="host") > 0
    assert metric(metrics, "kvtier:tier_used_bytes", tier="host") > 0


def test_a_request_that_loads_from_no_tier_recomputes_and_answers_the_same(
    tmp_path: Path, reference
):
    server = ServeProcess(tmp_path / "serve.log", *SMALL_POOL, "--host-bytes", "64MiB").start()
    try:
        first = first_turn(server.base_url)
        bad = [
            ({"kv_load_tiers": ["gpu"]}, "no tier 'gpu' here (tiers: host)"),
            ({"kv_load_tiers": [1]}, "a list of tier names"),
            ({"max_load_tokens": -5}, "a non-negative integer"),
        ]
        for params, words in bad:
            response = httpx.post(
                server.base_url + "/v1/completions",
                json={"model": "smollm2", "prompt": "hi", "kv_transfer_params": params},
                timeout=60,
            )
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert words in error["message"]
            assert error["param"].startswith("kv_transfer_params.")
        second = second_turn(server.base_url, first, {"kv_transfer_params": {"kv_load_tiers": []}})
    finally:
        server.stop()
    assert second.sources["host"] == 0
    assert second.sources == reference[1].sources  # as a server without tiers recomputes
    assert second.text == reference[1].text


def test_disk_tier_restores_it(tmp_path: Path, reference):
    flags = ["--host-bytes", "0", "--disk-dir", str(tmp_path / "kv"), "--disk-bytes", "64MiB"]
    server = ServeProcess(tmp_path / "serve.log", *SMALL_POOL, *flags).start()
    try:
        turns = conversation(server.base_url)
    finally:
        server.stop()
    check_restored(turns, reference, "disk")
    assert f"disk 67.1 MB in {tmp_path / 'kv'} (persistent)" in server.output


def test_redis_tier_restores_it(tmp_path: Path, reference):
    redis = RedisServer(tmp_path / "redis").start()
    flags = ["--host-bytes", "0", "--remote-url", redis.url, "--remote-bytes", "64MiB"]
    # A Redis call past its timeout (0.25 s) is recomputed, as it should be; on a loaded
    # 2-core host one put once took longer, and the turn recomputed a chunk. Timeouts have
    # their own tests (tests/tiers/test_redis.py); this one is about the restore.
    flags += ["--tiers-set", "remote_timeout_s=10"]
    server = ServeProcess(tmp_path / "serve.log", *SMALL_POOL, *flags).start()
    try:
        turns = conversation(server.base_url)
        metrics = server.metrics()
    finally:
        server.stop()
        redis.stop()
    check_restored(turns, reference, "remote")
    assert metric(metrics, "kvtier:prompt_tokens_by_source_total", source="remote") > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--host-bytes", "lots"], "tiers.host_bytes (from --host-bytes): "),
        (["--disk-bytes", "1GiB"], "tiers.disk_bytes (from --disk-bytes): needs tiers.disk_dir"),
        (["--encrypt"], "tiers.encrypt (from --encrypt): needs tiers.encrypt_key_file"),
        (["--tiers-set", "chunk_tokens=0"], "tiers.chunk_tokens must be >= 1"),
        (["--tiers-set", "colour=blue"], "tiers.colour (from --tiers-set colour=blue): unknown"),
        (["--encrypt-key-file", "/nonexistent/key"], "key file /nonexistent/key does not exist"),
        (["--policy", "nope"], "nope"),
        (["--policy-set", "interval_s=-1"], "policy.interval_s"),
    ],
)
def test_bad_tier_and_policy_settings_are_one_line_and_exit_2(flags, message):
    result = subprocess.run(
        [str(BIN / "kvtier"), "serve", "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier: error: "), result.stderr
    assert message in lines[0]
