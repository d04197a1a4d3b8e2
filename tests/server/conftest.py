"""A real uvicorn server on a free loopback port, in a thread, around one shared engine
of the default dtype."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvtier.settings.server import ServerConfig, TenantConfig
from tests.host_dtype import BLOCK_BYTES

NUM_BLOCKS = 96
MODEL = "smollm2"
ALICE_KEY = "sk-alice"
BOB_KEY = "sk-bob"
CAROL_KEY = "sk-carol"
ADMIN_KEY = "sk-admin"
BOB_QUOTA_BLOCKS = 6


@dataclass
class Server:
    base_url: str
    app: object
    uvicorn: object

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"


def start_server(app) -> tuple[Server, threading.Thread]:
    """Served as `kvtier serve` serves it (its uvicorn settings), on a free port."""
    import uvicorn

    from kvtier.server.command import listen, uvicorn_config

    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    config = uvicorn_config(app, app.state.kvtier.config, sock, log_level="warning")
    config.timeout_graceful_shutdown = 5
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    return Server(f"http://127.0.0.1:{port}", app, server), thread


def stop_server(server: Server, thread: threading.Thread) -> None:
    server.uvicorn.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="session")
def engine():
    from kvtier.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(kv_cache_bytes=NUM_BLOCKS * BLOCK_BYTES, max_num_seqs=32))
    yield engine
    engine.close()


def tenant_config(**overrides) -> ServerConfig:
    values = dict(
        model_name=MODEL,
        tenants={
            "alice": TenantConfig("alice", ALICE_KEY),
            "bob": TenantConfig("bob", BOB_KEY, BOB_QUOTA_BLOCKS * BLOCK_BYTES),
            "carol": TenantConfig("carol", CAROL_KEY),  # no quota: the control
        },
        admin_key=ADMIN_KEY,
        max_concurrent_requests=32,
        max_prompt_tokens=1024,
        max_body_bytes=64 * 1024,
        max_tokens_default=8,
    )
    values.update(overrides)
    return ServerConfig(**values)


@pytest.fixture(scope="module")
def server(engine) -> Iterator[Server]:
    """Two tenants (bob has a quota), an admin key, 32 concurrent requests."""
    from kvtier.server.app import create_app

    srv, thread = start_server(create_app(engine, tenant_config()))
    yield srv
    stop_server(srv, thread)


def wait_idle(engine, timeout: float = 20.0) -> None:
    """Aborts are applied by the step thread: wait until nothing is in flight."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if not engine.has_unfinished_requests() and stats.kv_blocks_used == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {engine.stats()}")


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The tier tests' conversation (serve_process.py) on a `kvtier serve` without tiers:
    its resumed turn is recomputed. Their answers must equal these."""
    from tests.server.serve_process import SMALL_POOL, ServeProcess, conversation

    log = tmp_path_factory.mktemp("reference") / "serve.log"
    server = ServeProcess(log, *SMALL_POOL, "--host-bytes", "0").start()
    try:
        first, second = conversation(server.base_url)
    finally:
        server.stop()
    assert "tiers: none" in server.output
    assert second.sources["recomputed"] > 0
    assert second.sources["host"] == second.sources["disk"] == second.sources["remote"] == 0
    return first, second
