"""Connection hygiene in front of the app: what an open connection that sends no request may
cost the server.

uvicorn counts every open connection against its limit (`max_connections`, 503 beyond) and
times out neither a connection that never sends a request nor one that trickles its request
headers a byte at a time (any byte re-arms its keep-alive timer), so a few hundred sockets
that send nothing would hold every slot for as long as they stay open. This protocol, a
subclass of uvicorn's h11 protocol, adds three rules. A connection is *idle* while it has
no request in progress: before its first request's headers are in, and between requests.

- A connection whose request head is not complete `header_timeout_s` after it opened, or
  after the first byte of a later request on a kept-alive connection, is closed: a 408 when
  part of a request came, silently otherwise. (Silence between requests is uvicorn's
  keep-alive timeout to end.)
- A new connection that would reach `max_connections` closes the connection idle the
  longest, so idle sockets never keep a real client out; only busy connections count
  towards a full server.
- One client address holds at most `max_per_address` connections: beyond, its new
  connection closes that address's longest-idle one, or, when all of them are busy, is
  answered 503 and closed. One address cannot take the whole of `max_connections`.

The address is the TCP peer's: behind a reverse proxy every client shares the proxy's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    max_per_address: int
    header_timeout_s: float


class ConnectionGuard:
    """What the connections of one server share: how many each address holds, and which are
    idle, longest-idle first."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open_by_address: dict[str, int] = {}
        self.idle: dict[GuardedProtocol, None] = {}  # insertion order: longest idle first
        self.num_open = 0
        self._warned_at = -float("inf")

    def opened(self, conn: GuardedProtocol) -> bool:
        """Count a new connection, making room for it; False: refuse it (its address holds
        its limit of connections, all busy)."""
        held = self.open_by_address.get(conn.address, 0)
        if held >= self.limits.max_per_address:
            victim = self._longest_idle(conn.address)
            if victim is None:
                self._warn_refused(conn.address)
                return False
            victim.close_idle("its address opened another connection")
        # uvicorn answers 503 once its open connections, this one included, reach the limit
        # (those closed here are gone before this one's request is read)
        if self.num_open + 1 >= self.limits.max_connections:
            victim = self._longest_idle(None)
            if victim is not None:
                victim.close_idle("the server needs its slot")
        self.num_open += 1
        self.open_by_address[conn.address] = self.open_by_address.get(conn.address, 0) + 1
        self.idle[conn] = None
        return True

    def closed(self, conn: GuardedProtocol) -> None:
        """Forget a connection: closed by the client, by uvicorn, or here."""
        self.num_open -= 1
        self.idle.pop(conn, None)
        left = self.open_by_address[conn.address] - 1
        if left:
            self.open_by_address[conn.address] = left
        else:
            del self.open_by_address[conn.address]

    def now_idle(self, conn: GuardedProtocol) -> None:
        self.idle.pop(conn, None)
        self.idle[conn] = None  # to the end: idle the shortest

    def no_longer_idle(self, conn: GuardedProtocol) -> None:
        self.idle.pop(conn, None)

    def _warn_refused(self, address: str) -> None:
        # once a minute at most: a flood refused one connection at a time would fill the log
        now = time.monotonic()
        if now - self._warned_at >= 60:
            self._warned_at = now
            log.warning(
                "refusing connections from %s: it holds its %d, all busy "
                "(max_connections_per_address)",
                address,
                self.limits.max_per_address,
            )

    def _longest_idle(self, address: str | None) -> GuardedProtocol | None:
        for conn in self.idle:
            if address is None or conn.address == address:
                return conn
        return None


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol under a `ConnectionGuard` (the class attribute, one per server:
    `guarded_protocol` makes the subclass). It relies on uvicorn calling
    `on_response_complete` at the end of each response and on `cycle.response_complete`."""

    guard: ConnectionGuard

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.address = ""
        self.counted = False  # in the guard's counts
        self.partial = False  # bytes of a request came while idle
        self.header_timer: asyncio.TimerHandle | None = None

    @property
    def is_idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.address = self.client[0] if self.client else ""
        self.counted = self.guard.opened(self)
        if not self.counted:
            body = b"too many connections from this address"
            transport.write(_response(503, "Service Unavailable", body))
            transport.close()
            return
        self._start_header_timer()  # uvicorn times out no connection that never speaks

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        was_idle = self.is_idle
        super().data_received(data)
        if not was_idle:
            return
        if self.is_idle:
            self.partial = True
            if self.header_timer is None:
                # a kept-alive connection's next request began: any byte stops uvicorn's
                # keep-alive timer, so a trickle would hold the connection for ever
                self._start_header_timer()
        else:
            self._stop_header_timer()
            self.guard.no_longer_idle(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.is_idle and not self.transport.is_closing():
            # silence from here on is uvicorn's keep-alive timeout to end
            self.partial = False
            self.guard.now_idle(self)

    def close_idle(self, reason: str) -> None:
        """Close this idle connection: a 408 if part of a request came, else nothing."""
        self._forget()
        if self.transport.is_closing():
            return
        log.debug("closing an idle connection from %s: %s", self.address, reason)
        if self.partial:
            self.transport.write(_response(408, "Request Timeout", b"request not received"))
        self.transport.close()

    def _forget(self) -> None:
        self._stop_header_timer()
        if self.counted:
            self.counted = False
            self.guard.closed(self)

    def _start_header_timer(self) -> None:
        timeout = self.guard.limits.header_timeout_s
        self.header_timer = self.loop.call_later(timeout, self._header_timeout)

    def _stop_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _header_timeout(self) -> None:
        self.header_timer = None
        if self.is_idle:
            self.close_idle("no request head within the header timeout")


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedProtocol]:
    """A protocol class for `uvicorn.Config(http=...)` whose connections share one guard."""
    return type("GuardedProtocol", (GuardedProtocol,), {"guard": ConnectionGuard(limits)})


def _response(status: int, reason: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
