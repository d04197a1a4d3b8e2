"""When each session's turns arrive: what the oracle policy is told, in the benchmark and the
simulator alike."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.workload.model import Request


def next_arrivals(requests: Sequence[Request]) -> dict[str, list[float]]:
    """Session id -> sorted trace arrival times of its turns, relative to the first arrival:
    what `OraclePolicy(next_arrivals)` is told. `replay` updates the lists in place when a
    closed-loop turn's real send time becomes known, so the oracle sees the actual future."""
    origin = min((r.arrival_s for r in requests), default=0.0)
    arrivals: dict[str, list[float]] = {}
    for request in requests:
        arrivals.setdefault(request.session_id, []).append(request.arrival_s - origin)
    return {session: sorted(times) for session, times in arrivals.items()}
