"""vLLM with the kvtier connector and only a Redis tier (a real redis-server on loopback): a
resumed turn loads from Redis; with the server stopped, the next resumed turn's loads fail,
are counted and recomputed, and the outputs stay vLLM's own."""

from __future__ import annotations

import shutil
import socket

import pytest

from .conftest import computed, loadable, run_driver

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_run(tmp_path_factory) -> dict:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make system)")
    tmp = tmp_path_factory.mktemp("vllm-redis")
    return run_driver(tmp, "redis", "--redis-port", str(free_port()))


def test_a_resumed_turn_loads_from_redis(redis_run, baseline):
    first, second = redis_run["turns"][:2]
    assert second["output"] == baseline["turns"][1]["output"]
    expected = loadable(computed(first), second["prompt_tokens"])
    assert second["tokens"]["remote"] == expected > 0
    assert second["tier_errors"] == 0


def test_a_stopped_redis_costs_recompute_not_correctness(redis_run, baseline):
    third = redis_run["turns"][2]
    assert third["output"] == baseline["turns"][2]["output"]
    assert third["tokens"].get("remote", 0) == 0
    assert third["tokens"]["recomputed"] == third["prompt_tokens"]
    assert third["counters"]["restore_failures"] >= 1
    assert third["tier_errors"] > 0
    assert third["counters"]["write_through_failures"] >= 1  # its chunks could not be kept
