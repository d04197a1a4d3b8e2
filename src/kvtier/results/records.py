"""What one run of a workload under one policy produced: a record per request, and per run the
traffic of each tier, the policy's decisions, tier occupancy over time and pooled inter-token
latencies. `kvtier simulate` and `kvtier bench` both fill these, so their outputs diff.

Times are seconds on the run's clock (trace time for both: the benchmark's replay clock skips
idle stretches, the simulator's clock is virtual); lengths are tokens; sizes are bytes.

Where a turn's history came from (`restored_tokens`, tokens per source):

- `device`: found in device memory (a prefix-cache hit);
- `host`, `disk`, `remote`: loaded from that tier;
- `recomputed`: KV the session had produced before but no tier held any more (or the restore
  planner chose to recompute), prefilled again.

Prompt tokens outside these (the new message, and any history never computed before) are plain
prefill. Turn kinds are the engine's: `new` (a session's first turn), `continuing` (within
`resume_after_s` of the previous turn's end), `resumed` (later).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kvtier.vocab import LOWER_TIERS, SOURCES

SCHEMA = "kvtier.results/1"

TurnKind = Literal["new", "continuing", "resumed"]
TURN_KINDS: tuple[TurnKind, ...] = ("new", "continuing", "resumed")
STORE_TIERS = LOWER_TIERS  # tiers below the device, fastest first
RESTORE_SOURCES = SOURCES


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    session_id: str
    tenant: str
    turn_index: int
    turn_kind: TurnKind
    arrival_s: float  # when the request was sent
    prompt_tokens: int
    output_tokens: int  # tokens generated (0 when it failed before the first)
    scheduled_s: float | None = None  # first scheduled: admitted to the running batch
    first_token_s: float | None = None
    finish_s: float | None = None
    restored_tokens: dict[str, int] = field(default_factory=dict)  # RESTORE_SOURCES -> tokens
    # Inter-token gaps of this request. A benchmark measures them; the simulator leaves them out
    # (millions of them) and pools them per run in RunRecords.itl_pooled instead.
    itl_s: list[float] | None = None
    max_itl_s: float | None = None  # the longest gap: this request's worst stall
    failed: bool = False
    error: str | None = None

    @property
    def cached_tokens(self) -> int:
        """History tokens whose KV was found stored somewhere (device or a lower tier)."""
        return sum(self.restored_tokens.get(source, 0) for source in ("device", *STORE_TIERS))

    @property
    def tokens_recomputed(self) -> int:
        return self.restored_tokens.get("recomputed", 0)

    @property
    def history_tokens(self) -> int:
        return self.cached_tokens + self.tokens_recomputed

    @property
    def restore_source(self) -> str | None:
        """Where most of the history came from (ties: the slower source); None without history."""
        counts = [(self.restored_tokens.get(s, 0), i, s) for i, s in enumerate(RESTORE_SOURCES)]
        tokens, _, source = max(counts)
        return source if tokens > 0 else None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2el_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "session_id": self.session_id,
            "tenant": self.tenant,
            "turn_index": self.turn_index,
            "turn_kind": self.turn_kind,
            "arrival_s": self.arrival_s,
            "scheduled_s": self.scheduled_s,
            "first_token_s": self.first_token_s,
            "finish_s": self.finish_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "restored_tokens": dict(self.restored_tokens),
            "itl_s": self.itl_s,
            "max_itl_s": self.max_itl_s,
            "failed": self.failed,
            "error": self.error,
        }


@dataclass(slots=True)
class TierTraffic:
    """Bytes through one tier over a run. Every byte written in leaves by a read (a load to the
    device or a demotion below), a drop, or is still resident at the end:
    `bytes_written == bytes_read + bytes_dropped + resident_bytes`."""

    capacity_bytes: int
    bytes_written: int = 0
    bytes_read: int = 0
    bytes_dropped: int = 0
    resident_bytes: int = 0
    writes: int = 0
    reads: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "capacity_bytes": self.capacity_bytes,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "bytes_dropped": self.bytes_dropped,
            "resident_bytes": self.resident_bytes,
            "writes": self.writes,
            "reads": self.reads,
        }


@dataclass(slots=True)
class OccupancySample:
    t_s: float
    used_bytes: dict[str, int]  # tier (device included) -> bytes held


@dataclass
class RunRecords:
    """One policy's run. `itl_pooled` holds (gap seconds, count) pairs of every request's
    inter-token gaps; None means "pool the requests' own `itl_s`" (what a benchmark records)."""

    policy: str
    duration_s: float
    requests: list[RequestRecord]
    tiers: dict[str, TierTraffic] = field(default_factory=dict)
    decisions: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> tier -> count
    occupancy: list[OccupancySample] = field(default_factory=list)
    itl_pooled: list[tuple[float, int]] | None = None

    def itl_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """Every inter-token gap as (values, counts), from the pool or from the requests that
        completed (the same requests vLLM's benchmark pools)."""
        if self.itl_pooled is not None:
            pooled = np.array(self.itl_pooled, dtype=float).reshape(-1, 2)
            return pooled[:, 0], pooled[:, 1]
        gaps = [gap for r in self.requests if not r.failed for gap in (r.itl_s or ())]
        values = np.array(gaps, dtype=float)
        return values, np.ones_like(values)
