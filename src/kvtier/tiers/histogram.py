"""A latency histogram with fixed buckets, cheap enough to observe every tier operation."""

from __future__ import annotations

import bisect
import threading

# Upper bounds in seconds, 1-2.5-5 per decade from 10 us to 10 s: the span between a host copy of
# one block and a Redis call that hits its timeout. Fixed bounds make histograms from different
# tiers and processes addable, and map one-to-one onto Prometheus `le` labels.
DEFAULT_BOUNDS_S: tuple[float, ...] = (
    *(m * 10.0**e for e in range(-5, 1) for m in (1.0, 2.5, 5.0)),
    10.0,
)


class LatencyHistogram:
    """Counts of observations per bucket; quantiles are read as a bucket's upper bound."""

    def __init__(self, bounds_s: tuple[float, ...] = DEFAULT_BOUNDS_S) -> None:
        self.bounds_s = bounds_s
        # One extra bucket for observations above the last bound (Prometheus' +Inf).
        self.counts = [0] * (len(bounds_s) + 1)
        self.count = 0
        self.sum_s = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        index = bisect.bisect_left(self.bounds_s, seconds)
        with self._lock:
            self.counts[index] += 1
            self.count += 1
            self.sum_s += seconds

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding the q-th observation (inf past the last bound)."""
        with self._lock:
            if self.count == 0:
                return 0.0
            rank = q * self.count
            seen = 0
            for index, count in enumerate(self.counts):
                seen += count
                if seen >= rank and count:
                    return self.bounds_s[index] if index < len(self.bounds_s) else float("inf")
        return float("inf")

    def snapshot(self) -> dict[str, object]:
        """Count, sum, p50/p99 and cumulative bucket counts keyed by upper bound."""
        cumulative, total = {}, 0
        with self._lock:
            for bound, count in zip((*self.bounds_s, float("inf")), self.counts, strict=True):
                total += count
                cumulative[f"{bound:g}"] = total
            count, sum_s = self.count, self.sum_s
        return {
            "count": count,
            "sum_s": sum_s,
            "p50_s": self.quantile(0.5),
            "p99_s": self.quantile(0.99),
            "buckets": cumulative,
        }
