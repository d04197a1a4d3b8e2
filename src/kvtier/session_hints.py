"""Words every layer shares about a session's future: how a turn ended and what the client
says about the next one (the engine records them, the policies read them, workloads and
traces carry them)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

# How a turn's reply ended, as the server saw it: a tool call (the agent comes back when the
# tool returns), an answer (a person reads it, and may never come back), or the length limit.
EndKind = Literal["tool_call", "answer", "length"]
END_KINDS: tuple[str, ...] = get_args(EndKind)


@dataclass(frozen=True)
class SessionHints:
    """What a client says about its session's future, with its latest request (all optional).

    - `close`: the session is over; its KV is worth nothing to it any more.
    - `expect_return_s`: the next turn is expected this many seconds after this one ends
      (an agent knows its tool's usual duration).
    - `priority`: each level doubles the value the cost policy puts on the session's latency;
      LRU-based policies evict lower priorities first.
    - `pin`: never moved or dropped while the hint holds (bounded by the tenant's quota).
    - `ttl_s`: kept in place for at least this long after the session goes idle.
    """

    close: bool = False
    expect_return_s: float | None = None
    priority: int = 0
    pin: bool = False
    ttl_s: float | None = None

    @property
    def pins(self) -> bool:
        """Whether the hints hold the session in place: `pin`, unless `close` says it is over
        (close wins, on every path)."""
        return self.pin and not self.close

    @property
    def empty(self) -> bool:
        return self == NO_HINTS

    def given(self) -> dict[str, Any]:
        """The fields set away from their defaults: the `kvtier_session` object a client sends
        (and a trace records) for these hints."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != f.default
        }


NO_HINTS = SessionHints()
