"""How far one result file is from another: the simulator's prediction against a real run.

For every policy present in both, each compared figure gets the relative error
`(simulated - measured) / measured`: positive means the simulator is pessimistic (slower, more
bytes), negative optimistic. Compared: mean, median and p99 of TTFT, TPOT and ITL; request and
output throughput; bytes read from and written to each lower tier. A measured value of 0 gives
an error of 0 when the simulation also says 0, and None (undefined) otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.errors import KvtierError
from kvtier.results.records import SCHEMA, STORE_TIERS

VALIDATION_SCHEMA = "kvtier.validation/1"
LATENCY_FIELDS = tuple(
    f"{stat}_{metric}_ms"
    for metric in ("ttft", "tpot", "itl")
    for stat in ("mean", "median", "p99")
)
THROUGHPUT_FIELDS = ("request_throughput", "output_throughput")


def compare(simulated: Mapping[str, Any], measured: Mapping[str, Any]) -> dict[str, Any]:
    """Relative errors per policy of two result documents (results.json contents)."""
    sim, real = _summaries(simulated, "simulated"), _summaries(measured, "measured")
    policies: dict[str, dict[str, dict[str, float | None]]] = {}
    for policy in (p for p in sim if p in real):
        rows = {}
        for name in (*LATENCY_FIELDS, *THROUGHPUT_FIELDS):
            rows[name] = _row(sim[policy].get(name), real[policy].get(name))
        for tier in STORE_TIERS:
            sim_tier = sim[policy].get("tier_bytes", {}).get(tier)
            real_tier = real[policy].get("tier_bytes", {}).get(tier)
            if sim_tier is None or real_tier is None:
                continue
            for field in ("bytes_read", "bytes_written"):
                rows[f"{tier}_{field}"] = _row(sim_tier.get(field), real_tier.get(field))
        policies[policy] = rows
    return {
        "schema": VALIDATION_SCHEMA,
        "policies": policies,
        "only_simulated": sorted(p for p in sim if p not in real),
        "only_measured": sorted(p for p in real if p not in sim),
    }


def _summaries(document: Mapping[str, Any], which: str) -> dict[str, Mapping[str, Any]]:
    if document.get("schema") != SCHEMA:
        raise KvtierError(
            f"the {which} results have schema {document.get('schema')!r}, expected {SCHEMA!r}"
        )
    return {run["policy"]: run["summary"] for run in document.get("runs", [])}


def _row(simulated: float | None, measured: float | None) -> dict[str, float | None]:
    if simulated is None or measured is None:
        error = None
    elif measured == 0:
        error = 0.0 if simulated == 0 else None
    else:
        error = (simulated - measured) / measured
    return {"simulated": simulated, "measured": measured, "relative_error": error}
