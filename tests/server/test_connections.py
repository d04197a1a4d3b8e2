"""Connections that send nothing, or their request a byte at a time, do not deny service:
they are closed after the header timeout, an idle one makes room for a new connection when
the server is full, and one client address cannot hold every connection.

Real sockets on loopback against uvicorn serving the real app around the real model, as
`kvtier serve` configures it. Sources 127.0.0.2 and up are other loopback addresses (Linux
routes all of 127/8 to lo), so one test process plays several clients.
"""

from __future__ import annotations

import contextlib
import resource
import selectors
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from kvtier.server.app import create_app
from tests.server.conftest import (
    ALICE_KEY,
    MODEL,
    Server,
    start_server,
    stop_server,
    tenant_config,
    wait_idle,
)

pytestmark = pytest.mark.slow

HEADER_TIMEOUT_S = 2.0
ALICE = {"Authorization": f"Bearer {ALICE_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module", autouse=True)
def enough_file_descriptors() -> None:
    # Client and server ends of every socket live in this process: two descriptors each.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


@pytest.fixture(scope="module")
def guarded(engine) -> Iterator[Server]:
    """The default connection limits (512; 128 per address), a 2 s header timeout."""
    srv, thread = start_server(create_app(engine, tenant_config(header_timeout_s=HEADER_TIMEOUT_S)))
    yield srv
    stop_server(srv, thread)


def open_sockets(srv: Server, count: int, source: str = "127.0.0.1") -> list[socket.socket]:
    url = urlsplit(srv.base_url)
    return [
        socket.create_connection((url.hostname, url.port), source_address=(source, 0))
        for _ in range(count)
    ]


def wait_closed(socks: list[socket.socket], timeout: float) -> tuple[int, list[bytes]]:
    """How many of `socks` the server closed within `timeout`, and what it sent on them."""
    selector = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, bytearray())
    closed, answers = 0, []
    deadline = time.monotonic() + timeout
    while closed < len(socks) and time.monotonic() < deadline:
        for key, _ in selector.select(0.2):
            try:
                data = key.fileobj.recv(4096)
            except ConnectionResetError:
                data = b""
            if data:
                key.data.extend(data)
                continue
            selector.unregister(key.fileobj)
            closed += 1
            answers.append(bytes(key.data))
    selector.close()
    return closed, answers


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def test_520_idle_sockets_do_not_deny_service(guarded, engine):
    flood = open_sockets(guarded, 520)
    try:
        real = httpx.post(guarded.v1 + "/chat/completions", json=CHAT, headers=ALICE, timeout=60)
        assert real.status_code == 200, real.text
        closed, answers = wait_closed(flood, HEADER_TIMEOUT_S + 15)
        assert closed == len(flood)
        assert set(answers) == {b""}  # nothing was asked, nothing is answered
    finally:
        close_all(flood)
    wait_idle(engine)


def test_idle_sockets_from_many_addresses_make_room_for_a_real_client(guarded, engine):
    # 65 from each of 8 addresses: under the per-address limit, over the server's
    flood = [s for i in range(2, 10) for s in open_sockets(guarded, 65, f"127.0.0.{i}")]
    try:
        real = httpx.post(guarded.v1 + "/chat/completions", json=CHAT, headers=ALICE, timeout=60)
        assert real.status_code == 200, real.text
        closed, _ = wait_closed(flood, HEADER_TIMEOUT_S + 15)
        assert closed == len(flood)
    finally:
        close_all(flood)
    wait_idle(engine)


def trickle(socks: list[socket.socket], text: bytes, every_s: float, until: float) -> None:
    """Send `text` a byte at a time on every socket still open."""
    for byte in text:
        if time.monotonic() > until:
            return
        for sock in socks:
            with contextlib.suppress(OSError):  # closed by the server: what is wanted
                sock.sendall(bytes([byte]))
        time.sleep(every_s)


def test_a_request_head_trickled_a_byte_at_a_time_is_cut_off(guarded):
    fresh = open_sockets(guarded, 20, "127.0.0.10")
    # A kept-alive connection that has had its answer, then trickles its next request.
    kept = open_sockets(guarded, 1, "127.0.0.11")
    kept[0].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while not answer.endswith(b'{"status":"ok"}'):
        answer += kept[0].recv(4096)
    assert answer.startswith(b"HTTP/1.1 200")
    socks = fresh + kept
    try:
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 200
        started = time.monotonic()
        trickle(socks, head, 0.25, started + HEADER_TIMEOUT_S + 3)
        closed, answers = wait_closed(socks, 5)
        assert closed == len(socks)
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 8
    finally:
        close_all(socks)


def test_one_address_cannot_hold_every_connection(engine):
    config = tenant_config(max_connections=24, body_timeout_s=60.0, header_timeout_s=60.0)
    srv, thread = start_server(create_app(engine, config))
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {ALICE_KEY}\r\nContent-Length: 200\r\n\r\n"
    ).encode()
    flood = open_sockets(srv, 30, "127.0.0.12")
    more: list[socket.socket] = []
    try:
        for sock in flood:
            sock.sendall(head)  # a request whose body never comes
        # the address keeps a quarter of 24: its newest 6, now busy
        closed, _ = wait_closed(flood, 3)
        assert closed == 30 - 6
        more = open_sockets(srv, 5, "127.0.0.12")
        closed, answers = wait_closed(more, 10)
        assert closed == 5
        assert all(a.startswith(b"HTTP/1.1 503") for a in answers), answers
        real = httpx.post(srv.v1 + "/chat/completions", json=CHAT, headers=ALICE, timeout=60)
        assert real.status_code == 200, real.text
    finally:
        close_all(flood + more)
        stop_server(srv, thread)
    wait_idle(engine)
