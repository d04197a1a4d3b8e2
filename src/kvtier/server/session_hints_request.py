"""A request's session hints, as `kvtier serve` reads them: the body's `kvtier_session`
object, the `X-Session-*` headers, and Dynamo's `nvext.agent_hints`.

Each field is validated where it was given (`policy.config.parse_session_hints`), so a 400
names the body field or header that was wrong; then the spellings merge field by field, the
body's `kvtier_session` over Dynamo's `nvext.agent_hints` over the headers. Hints only mean
something for a session: given without one (no `X-Session-ID`, no `user`), they are a 400.

Of Dynamo's agent hints only `priority` is read: both say "higher is more important", and
Dynamo's wider integer range is clamped to kvtier's. `osl` (expected output length),
`speculative_prefill`, `strict_priority` and `latency_sensitivity` (the router's queue) say
nothing about keeping a session's KV, and are ignored like any other key there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import KvtierError
from kvtier.policy.config import RequestOverrides, parse_session_hints
from kvtier.server.api_errors import APIError
from kvtier.session_hints import NO_HINTS, SessionHints

HEADERS = {
    "X-Session-Close": "close",
    "X-Session-Expect-Return": "expect_return_s",
    "X-Session-Priority": "priority",
    "X-Session-Pin": "pin",
    "X-Session-TTL": "ttl_s",
}
DYNAMO_PRIORITY = "nvext.agent_hints.priority"


def _priority_bound(name: str) -> int:
    constraints = RequestOverrides.model_fields["priority"].metadata
    return next(getattr(c, name) for c in constraints if hasattr(c, name))


# kvtier's priority range, as RequestOverrides defines it: Dynamo's is clamped into it
PRIORITY_RANGE = (_priority_bound("ge"), _priority_bound("le"))


@dataclass(frozen=True)
class RequestHints:
    """The merged hints, and for each field given the body field or header it came from."""

    hints: SessionHints = NO_HINTS
    given: Mapping[str, str] = field(default_factory=dict)


def read_session_hints(
    headers: Mapping[str, str], body: Any, session_id: str | None
) -> RequestHints:
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    for header, name in HEADERS.items():
        text = headers.get(header)
        if text is not None:
            values[name], given[name] = _checked(name, text, f"{header} header"), header
    priority = _dynamo_priority(body.nvext)
    if priority is not None:
        values["priority"], given["priority"] = priority, DYNAMO_PRIORITY
    for name, value in (body.kvtier_session or {}).items():
        param = f"kvtier_session.{name}"
        values[name], given[name] = _checked(name, value, param), param
    if not given:
        return RequestHints()
    if session_id is None:
        raise APIError(
            400,
            f"session hints ({', '.join(sorted(set(given.values())))}) need a session: "
            "send X-Session-ID or user",
            param=next(iter(given.values())),
            code="session_required",
        )
    return RequestHints(SessionHints(**values), given)


def _checked(name: str, value: Any, param: str) -> Any:
    """`value` as the hint `name` holds it, or a 400 naming `param`."""
    try:
        return getattr(parse_session_hints({name: value}), name)
    except KvtierError as exc:
        # "invalid session hints: request.<name>: <why>" -> the same, naming the spelling
        why = str(exc).split(f"request.{name}: ", 1)[-1]
        raise APIError(
            400,
            f"invalid session hints: {param}: {why}",
            param=param.removesuffix(" header"),
            code="invalid_value",
        ) from None


def _dynamo_priority(nvext: Mapping[str, Any] | None) -> int | None:
    agent_hints = (nvext or {}).get("agent_hints")
    if agent_hints is None:
        return None
    if not isinstance(agent_hints, Mapping):
        raise APIError(
            400,
            "nvext.agent_hints must be an object",
            param="nvext.agent_hints",
            code="invalid_value",
        )
    priority = agent_hints.get("priority")
    if priority is None:
        return None
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise APIError(
            400,
            f"{DYNAMO_PRIORITY} must be an integer, got {priority!r}",
            param=DYNAMO_PRIORITY,
            code="invalid_value",
        )
    low, high = PRIORITY_RANGE
    return min(max(priority, low), high)
