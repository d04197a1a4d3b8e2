"""How much device space new work will ask for soon: a short-horizon forecast of the KV bytes
that arriving turns bring to the device, learned from successive views.

Each turn that appears in a view (a new conversation, or a return) needs its whole context on
the device while it runs: its new tokens, plus the history that was not already there (loaded
back or recomputed). Arrivals are taken as a compound Poisson process: the rate λ is the count
over a sliding `window_s`, the sizes are those of the last `size_samples` arrivals (a longer
memory: the size distribution changes more slowly than the load). `exceedance` gives
P(bytes arriving within H > k) for a range of k, as the larger of two approximations: one
arrival larger than k (1 - exp(-λ H P(X > k)); right when λ H is about 1 or less, where what
must fit is one large context) and more than k / E[X] arrivals of the mean size (right for
many similar arrivals).

This is what prices the device by demand in the cost policy: the k-th free byte is worth
P(demand > k) times the seconds a byte spilled at allocation time adds to the turn that waits
for it, and idle KV keeps the device only while its own expected saving per byte bids more.
So idle KV holds a device with room for free, and once arrivals would need the space the
lowest bids are demoted on the timer (when links are idle) instead of being spilled on the
resumed turns' path.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from kvtier.policy.view import PolicyView, SessionView
from kvtier.policy.view_diff import Changes, diff

_SIZE = attrgetter("size_bytes")
_PROMPT_TOKENS = attrgetter("prompt_tokens")
SLICES = 32  # levels the demand curve is given at


@dataclass
class DemandForecast:
    window_s: float = 60.0  # how far back arrivals count towards the rate
    max_arrivals: int = 100_000  # memory bound on the window
    size_samples: int = 256  # recent arrival sizes kept for the single-arrival quantile
    _arrivals: deque[tuple[float, float]] = field(default_factory=deque, repr=False)
    _sum: float = 0.0
    # per session: the view last seen (views are reused until they change, so an unchanged
    # session costs one identity check), its turn count and its device bytes while idle
    _seen: dict[str, tuple[SessionView, int, int]] = field(default_factory=dict, repr=False)
    _start: float | None = None
    _sizes: deque[float] = field(default_factory=deque, repr=False)

    def observe(self, view: PolicyView, now: float, changes: Changes | None = None) -> None:
        """Record the turns that appeared since the previous view. A returning session's
        device bytes are those of the last view that showed it idle. `changes`: the view's
        against the previous one, where the caller has them already."""
        if self._start is None:
            self._start = now
        bpt = view.bytes_per_token
        seen = self._seen
        if changes is None:
            changes = diff(view.sessions, seen)
        for session_id in changes.left:  # sessions that left the view are forgotten
            seen.pop(session_id, None)
        for session in changes.changed:  # in view order, as arrivals are recorded
            before = seen.get(session.session_id)
            turns = len(session.turns)
            on_device = before[2] if before is not None else 0
            if session.idle:
                on_device = sum(map(_SIZE, session.chunks_in("device")))
            # a session first seen idle arrived before this forecast started watching
            new = before is None and not session.idle
            if bpt and turns and (new or (before is not None and turns > before[1])):
                context = sum(map(_PROMPT_TOKENS, session.turns)) * bpt
                self._add(session.turns[-1].arrival, max(0.0, context - on_device))
            seen[session.session_id] = (session, turns, on_device)
        self._expire(now)

    def exceedance(self, horizon_s: float, now: float) -> tuple[np.ndarray, np.ndarray]:
        """(k, P(bytes arriving in the next `horizon_s` > k)) on a grid of `SLICES` + 1 levels
        from 0 to where the probability is negligible: the demand curve the device's free
        space is priced by. Empty arrays before any arrival."""
        self._expire(now)
        if not self._arrivals or self._start is None:
            return np.zeros(0), np.zeros(0)
        count = len(self._arrivals) / self._span(horizon_s, now) * horizon_s  # λ H
        mean_size = self._sum / len(self._arrivals)
        sizes = np.sort(np.fromiter(self._sizes, float))
        top = max(float(sizes[-1]), 2 * (count + 4 * math.sqrt(count) + 1) * mean_size)
        levels = np.linspace(0.0, top, SLICES + 1)
        # one arrival larger than k among Poisson(λ H) arrivals
        larger = 1.0 - np.searchsorted(sizes, levels, side="right") / len(sizes)
        single = 1.0 - np.exp(-count * larger)
        # more than k / E[X] arrivals of the mean size
        needed = np.floor(levels / max(mean_size, 1.0)).astype(int)
        return levels, np.maximum(single, _poisson_above(count, needed))

    def byte_rate(self, horizon_s: float, now: float) -> float:
        """Bytes per second that arrivals have asked the device for over the window (0 before
        any): the rate at which idle KV must make way on a device that stays full."""
        self._expire(now)
        if not self._arrivals or self._start is None:
            return 0.0
        return self._sum / self._span(horizon_s, now)

    def _span(self, horizon_s: float, now: float) -> float:
        """Seconds the window covers: early on it is not full yet, so the time actually
        observed (at least one horizon)."""
        assert self._start is not None
        return min(self.window_s, max(now - self._start, horizon_s))

    def _add(self, at: float, nbytes: float) -> None:
        self._arrivals.append((at, nbytes))
        self._sum += nbytes
        self._sizes.append(nbytes)
        if len(self._sizes) > self.size_samples:
            self._sizes.popleft()
        if len(self._arrivals) > self.max_arrivals:
            self._pop()

    def _expire(self, now: float) -> None:
        while self._arrivals and self._arrivals[0][0] < now - self.window_s:
            self._pop()

    def _pop(self) -> None:
        _, nbytes = self._arrivals.popleft()
        self._sum = max(0.0, self._sum - nbytes)


def _poisson_above(mean: float, n: np.ndarray) -> np.ndarray:
    """P(Poisson(mean) > n), elementwise; 0 beyond mean + 10 sqrt(mean) + 20, where it is
    below 1e-9 (which also bounds the work)."""
    top = min(int(n.max()), int(mean + 10 * math.sqrt(mean) + 20))
    k = np.arange(top + 1)
    log_pmf = k * math.log(max(mean, 1e-300)) - mean - _log_factorials(top)
    cdf = np.cumsum(np.exp(log_pmf))
    return np.where(n > top, 0.0, np.clip(1.0 - cdf[np.minimum(n, top)], 0.0, 1.0))


# log(k!) for k = 0, 1, ...: replaced whole, never grown in place, so two policies deciding
# on two threads can at worst both rebuild it (appending to a shared list could interleave
# and shift every later entry)
_LOG_FACTORIALS = np.zeros(1)


def _log_factorials(top: int) -> np.ndarray:
    """log(k!) for k = 0 .. top, `math.lgamma(k + 1)` each, kept between calls (the demand
    curve asks for them at every decision)."""
    global _LOG_FACTORIALS
    known = _LOG_FACTORIALS
    if len(known) <= top:
        size = max(top + 1, 2 * len(known))
        known = np.array([math.lgamma(k + 1) for k in range(size)])
        _LOG_FACTORIALS = known
    return known[: top + 1]
