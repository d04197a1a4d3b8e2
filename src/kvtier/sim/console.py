"""What `kvtier simulate` says on screen besides the results tables: the set-up it simulates,
and per run whether the replicas kept up with the arrivals and why requests failed.

A run is called overloaded when serving the requests took more than `OVERLOAD_RATIO` times the
span of their arrivals: the queue then grows through the trace, and latencies measure the queue,
not the cache policy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.plan.kv_dtypes import get_kv_dtype
from kvtier.plan.planner import weight_bytes
from kvtier.results.records import STORE_TIERS, RequestRecord, RunRecords
from kvtier.sim.deployment import Deployment
from kvtier.sim.step_model import StepModel
from kvtier.units import format_bytes, format_seconds
from kvtier.workload.model import Request

OVERLOAD_RATIO = 1.5


@dataclass(frozen=True)
class Load:
    """How much a run's arrivals asked of a replica, against what it served."""

    span_s: float  # first to last arrival in the workload
    duration_s: float  # first arrival to last finish, simulated
    offered_tokens_s: float  # prompt tokens per second per replica the arrivals bring
    capacity_tokens_s: float  # prompt tokens per second a replica prefills in full steps
    step_tokens: int  # tokens per step (--max-num-batched-tokens)

    @property
    def ratio(self) -> float:
        return self.duration_s / self.span_s if self.span_s > 0 else 0.0

    @property
    def overloaded(self) -> bool:
        return self.ratio > OVERLOAD_RATIO


def setup_lines(
    deployment: Deployment, requests: Sequence[Request], policies: Sequence[str]
) -> list[str]:
    """The deployment and workload in a few lines, before any run."""
    d, g = deployment, deployment.geometry
    weights = weight_bytes(g, get_kv_dtype("bf16")) / d.tp
    tiers = ", ".join(
        f"{tier} {format_bytes(d.tiers[tier])}" if tier in d.tiers else f"{tier} none"
        for tier in STORE_TIERS
    )
    toggles = {
        "policy timer": "after steps" if d.timer_after_steps else "on its clock",
        "shared prefixes": "on" if d.shared_prefixes else "off",
        "write-through": "on" if d.write_through else "off",
        "keep moved": "on" if d.keep_moved else "off",
    }
    sessions = len({r.session_id for r in requests})
    return [
        f"simulating {g.name} ({format_bytes(d.bytes_per_token)} of bf16 KV per token) on "
        f"{d.gpus} x {d.profile.name}, {_count(d.replicas, 'replica')} of tensor parallel {d.tp}",
        f"  per replica: device KV pool {format_bytes(d.device_kv_bytes)} (weights "
        f"{format_bytes(weights)} per GPU); {tiers}",
        f"  scheduler: {d.max_num_seqs:,} running requests, {d.max_num_batched_tokens:,} "
        f"tokens per step, chunks of {d.chunk_tokens:,} tokens, resumed after "
        f"{d.session_resume_after_s:g} s; " + "; ".join(f"{k}: {v}" for k, v in toggles.items()),
        f"  workload: {len(requests):,} requests in {sessions:,} conversations over "
        f"{format_seconds(_span(requests))}; policies: {', '.join(policies)}",
    ]


def load_of(run: RunRecords, requests: Sequence[Request], deployment: Deployment) -> Load:
    span = _span(requests)
    prompt_tokens = sum(r.prompt_tokens for r in requests)
    model = StepModel(deployment.profile, deployment.geometry, deployment.tp)
    batch = deployment.max_num_batched_tokens
    return Load(
        span_s=span,
        duration_s=run.duration_s,
        offered_tokens_s=prompt_tokens / span / deployment.replicas if span > 0 else 0.0,
        capacity_tokens_s=batch / model.prefill_s(batch),
        step_tokens=batch,
    )


def run_note(run: RunRecords, load: Load) -> dict[str, Any]:
    """What results.json keeps of a run beyond its summary (config.runs): load and failures."""
    return {
        "trace_span_s": load.span_s,
        "overload_ratio": round(load.ratio, 3),
        "overloaded": load.overloaded,
        "offered_prompt_tokens_s": load.offered_tokens_s,
        "prefill_capacity_tokens_s": load.capacity_tokens_s,
        "failed_by_reason": {
            reason: len(group) for reason, group in failures_by_reason(run.requests).items()
        },
    }


def failures_by_reason(records: Sequence[RequestRecord]) -> dict[str, list[RequestRecord]]:
    """Failed requests grouped by the reason their error starts with (before its first ':')."""
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        if record.failed:
            reason = (record.error or "no reason given").partition(":")[0]
            groups.setdefault(reason, []).append(record)
    return groups


def run_warnings(run: RunRecords, load: Load) -> list[str]:
    """`warning:` lines for an overloaded run and for failed requests, one per reason."""
    lines = []
    if load.overloaded:
        ttft = sorted(r.first_token_s - r.arrival_s for r in run.requests if r.first_token_s)
        median = f"; median TTFT {format_seconds(ttft[len(ttft) // 2])}" if ttft else ""
        lines.append(
            f"warning: {run.policy}: overloaded: requests arrived over "
            f"{format_seconds(load.span_s)} and took {format_seconds(load.duration_s)} to serve "
            f"({load.ratio:.1f}x){median}. Arrivals bring {load.offered_tokens_s:,.0f} prompt "
            f"tokens/s per replica; a replica prefills about {load.capacity_tokens_s:,.0f} "
            f"in full {load.step_tokens:,}-token steps. Latencies measure the queue: add "
            "replicas (--gpus with --tp) or thin the workload"
        )
    failed = failures_by_reason(run.requests)
    counts = Counter({reason: len(group) for reason, group in failed.items()})
    for reason, count in counts.most_common():
        example = failed[reason][0]
        detail = (example.error or "").partition(":")[2].strip()
        lines.append(
            f"warning: {run.policy}: {count:,} of {len(run.requests):,} requests failed, "
            f"{reason} (e.g. {example.request_id}" + (f": {detail})" if detail else ")")
        )
    return lines


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _span(requests: Sequence[Request]) -> float:
    arrivals = [r.arrival_s for r in requests]
    return max(arrivals) - min(arrivals) if arrivals else 0.0
