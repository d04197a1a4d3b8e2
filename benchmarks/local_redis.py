"""A throwaway redis-server on a free loopback port for the benchmarks (no persistence, data in
`directory`). The test suite has its own fixture (tests/tiers/conftest.py) that can also stop,
freeze and restart the server."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def start_redis(directory: Path, timeout_s: float = 10.0) -> tuple[subprocess.Popen, str]:
    """(the server process, its redis:// URL); the caller terminates the process."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [shutil.which("redis-server") or "redis-server", "--port", str(port)]
    command += ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(directory)]
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline or process.poll() is not None:
                    process.kill()
                    raise RuntimeError(f"redis-server on port {port} did not start") from None
                time.sleep(0.02)
    finally:
        client.close()
    return process, f"redis://127.0.0.1:{port}/0"
