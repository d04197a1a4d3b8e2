"""Fixtures for the tier tests: real redis-server processes on loopback ports, random payloads."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch

from kvtier.tiers import Payload

REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    """A loopback port that is free, and so is port + 10000 (a cluster node's bus port)."""
    while True:
        port = random.randrange(20000, 55000)
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port


class RedisServer:
    """One redis-server child process without persistence; can be stopped, paused, restarted."""

    def __init__(self, directory: Path, port: int | None = None, *extra: str) -> None:
        if REDIS_SERVER is None:
            if os.environ.get("CI"):  # CI installs it (make system): missing there is a failure
                pytest.fail("redis-server is not installed in CI (make system installs it)")
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        self.directory = directory
        self.port = port or free_port()
        self.extra = extra
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=0.2, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        """Freeze the server: connections stay open but nothing answers (a slow server)."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the session; tests that stop or pause a server use `own_redis`."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server, emptied for this test."""
    with redis_server.client() as client:
        client.flushall()
    return redis_server.url


@pytest.fixture
def spawn_redis(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start servers this test alone uses (it may kill, pause and restart them):
    spawn_redis(*extra_args); all are stopped at the end of the test."""
    servers: list[RedisServer] = []

    def spawn(*extra: str) -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(servers)}", None, *extra)
        servers.append(server)
        return server.start()

    yield spawn
    for server in servers:
        if server.process is not None and server.process.poll() is None:
            server.resume()  # a paused server does not die of SIGKILL until it runs again
        server.stop()


@pytest.fixture
def own_redis(spawn_redis: Callable[..., RedisServer]) -> RedisServer:
    return spawn_redis()


@pytest.fixture
def make_payload() -> Callable[..., Payload]:
    """Random K/V-shaped payloads: make_payload(tokens, dtype=torch.bfloat16, seed=0)."""

    def make(tokens: int = 16, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Payload:
        generator = torch.Generator().manual_seed(seed)
        # 2 (K, V) x layers x kv heads x head dim per token: a small model's geometry.
        kv = torch.randn((2, 4, 2, 32, tokens), generator=generator).to(dtype)
        return Payload.of(kv)

    return make


def same_bytes(a: Payload | None, b: Payload) -> bool:
    """Bit-exact equality of two payloads' bytes and metadata."""
    return (
        a is not None
        and a.data is not None
        and b.data is not None
        and (a.form, a.dtype, a.shape, a.nbytes) == (b.form, b.dtype, b.shape, b.nbytes)
        and torch.equal(a.data.cpu(), b.data.cpu())
    )


@pytest.fixture
def same() -> Callable[[Payload | None, Payload], bool]:
    return same_bytes


def forge_layered_record(raw: bytes, change: Callable[[bytearray, int], None]) -> bytes:
    """A signed layered record whose body `change(body, layer_bytes)` edited, with its layer
    checksums, body checksum and head checksum all recomputed (what anyone who can write the
    store can do) and its signature left as it was (what only the key holder can make)."""
    import xxhash

    from kvtier.tiers.record import encode_head, parse_head

    head = parse_head(raw)
    body = bytearray(raw[head.head_len : head.head_len + head.body_len])
    layers = len(head.layer_sums)
    step = head.body_len // layers
    change(body, step)
    sums = tuple(
        xxhash.xxh3_64_intdigest(bytes(body[i * step : (i + 1) * step])) for i in range(layers)
    )
    meta, flags, at, mac = head.meta, head.flags, head.written_at, head.mac
    new_head = encode_head(
        head.key, head.namespace, meta, body, flags, at, mac, sums, key_id=head.key_id
    )
    return new_head + bytes(body)


@pytest.fixture
def forge_layered() -> Callable[[bytes, Callable[[bytearray, int], None]], bytes]:
    return forge_layered_record
