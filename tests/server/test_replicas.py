"""Two `kvtier serve` replicas sharing one redis-server behind nginx with the shipped
configuration (deploy/nginx/kvtier.conf): a conversation sticks to one replica; when that
replica is killed, nginx sends the next turn to the other, which restores the history that
the dead one wrote to Redis, and answers as a server that recomputes it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.serve_process import (
    FIRST,
    SMALL_POOL,
    ServeProcess,
    Turn,
    chat,
    metric,
    second_turn,
)
from tests.tiers.conftest import RedisServer, free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from local_nginx import start_nginx

pytestmark = pytest.mark.slow

NGINX = shutil.which("nginx")


@pytest.fixture
def nginx(tmp_path: Path):
    """start(replica addresses) -> nginx's base URL; stopped at the end of the test."""
    if NGINX is None:
        if os.environ.get("CI"):  # CI installs it (make system): missing there is a failure
            pytest.fail("nginx is not installed in CI (make system installs it)")
        pytest.skip("nginx is not installed (apt-get install nginx)")
    processes: list[subprocess.Popen] = []

    def start(replicas: list[str]) -> str:
        port = free_port()
        processes.append(start_nginx(tmp_path / "nginx", replicas, port))
        return f"http://127.0.0.1:{port}"

    yield start
    for process in processes:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[RedisServer, list[ServeProcess]]]:
    # The global budget lives in Redis itself (docs/serve.md, "Replicas sharing Redis").
    redis = RedisServer(tmp_path / "redis", None, "--maxmemory", "64mb")
    redis.start()
    redis.client().config_set("maxmemory-policy", "allkeys-lru")
    flags = [
        *SMALL_POOL,
        "--host-bytes",
        "0",
        "--remote-url",
        redis.url,
        "--remote-bytes",
        "32MiB",
        "--tiers-set",  # the test counts tokens read from Redis; a loaded machine can be slow
        "remote_timeout_s=5",
        "--write-through",  # a finished turn is in Redis at once, not when it is evicted
        "--encrypt-key-file",
        str(tmp_path / "master.key"),  # one key for both: they read each other's values
        "--create-key",
    ]
    servers = [ServeProcess(tmp_path / f"replica-{i}.log", *flags) for i in range(2)]
    try:
        yield redis, [server.start() for server in servers]
    finally:
        for server in servers:
            server.stop()
        redis.stop()


def served_by(servers: list[ServeProcess]) -> ServeProcess:
    """The replica that has served prompt tokens (the only one, in this test)."""
    busy = [s for s in servers if metric(s.metrics(), "kvtier:prompt_tokens_total") > 0]
    assert len(busy) == 1
    return busy[0]


def wait_for_keys(redis: RedisServer, count: int, timeout: float = 30.0) -> None:
    """Write-through runs in the background: wait until Redis holds the turn's chunks."""
    deadline = time.monotonic() + timeout
    with redis.client() as client:
        while client.dbsize() < count:
            assert time.monotonic() < deadline, f"only {client.dbsize()} keys in redis"
            time.sleep(0.05)


def test_a_killed_replica_s_session_resumes_on_the_other_from_redis(
    replicas, nginx, reference: tuple[Turn, Turn]
):
    redis, servers = replicas
    base_url = nginx([s.base_url.removeprefix("http://") for s in servers])

    first = chat(base_url, "a", [{"role": "user", "content": FIRST}])
    assert first.text == reference[0].text
    home = served_by(servers)
    wait_for_keys(redis, count=4)  # the 141-token prompt + 8 answer tokens: 4 chunks of 32

    home.kill()
    survivor = next(s for s in servers if s is not home)
    second = second_turn(base_url, first)

    assert served_by([survivor]) is survivor
    assert second.sources["remote"] >= 128, second.sources
    assert second.sources["device"] == 0  # nothing of this session was ever on its device
    assert second.text == reference[1].text
    remote = metric(survivor.metrics(), "kvtier:prompt_tokens_by_source_total", source="remote")
    assert remote == second.sources["remote"]
