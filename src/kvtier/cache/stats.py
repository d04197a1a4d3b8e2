"""The tiered connector's report (`Engine.stats().tiers`): shaped here, off the hot path."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvtier.tiers import Mover, TieredStore

# A tier's traffic in the report: (field, the metric series both `kvtier serve` and the vLLM
# connector export it as, its help text), so the two expositions name it alike.
TIER_TRAFFIC = (
    ("bytes_read", "tier_read_bytes", "Bytes read from a KV tier (restores, prefetches, moves)."),
    ("read_seconds", "tier_read_seconds", "Seconds spent reading from a KV tier."),
    (
        "bytes_written",
        "tier_written_bytes",
        "Bytes written to a KV tier (write-through, spills, moves).",
    ),
    ("write_seconds", "tier_write_seconds", "Seconds spent writing to a KV tier."),
)

_TIER_FIELDS = (
    "used_bytes",
    "capacity_bytes",
    "chunks",
    "copies",
    "bytes_read",
    "bytes_written",
    "hits",
    "misses",
    "errors",
    "errors_by_reason",
)


def connector_stats(
    *,
    policy: str,
    tokens: Counter[str],
    decisions: Counter[str],
    policy_runs: Counter[str],
    counters: Counter[str],
    store: TieredStore,
    mover: Mover,
    tier_forms: dict[str, str],
    writes_in_flight: int,
) -> dict[str, Any]:
    snapshot = store.snapshot()
    tiers = {
        name: {
            **{key: tier[key] for key in _TIER_FIELDS if key in tier},
            # seconds spent in the tier's reads and writes (all of them: restores, prefetches,
            # write-through, moves between tiers)
            "read_seconds": tier["get_latency"]["sum_s"],
            "write_seconds": tier["put_latency"]["sum_s"],
        }
        for name, tier in snapshot["tiers"].items()
    }
    moves = {
        name: {"ops": move["ops"], "bytes": move["bytes"], "failures": move["failures"]}
        for name, move in snapshot["moves"].items()
    }
    recodes = {
        name: {"ops": r["ops"], "bytes_in": r["bytes"], "seconds": r["latency"]["sum_s"]}
        for name, r in snapshot["recodes"].items()
    }
    return {
        "policy": policy,
        "tokens": dict(tokens),
        "decisions": dict(decisions),
        "policy_runs": dict(policy_runs),
        "counters": dict(counters),
        "tiers": tiers,
        "moves": moves,
        "forms": dict(tier_forms),
        "recodes": recodes,
        "mover": {**mover.counts, "writes_in_flight": writes_in_flight},
    }
