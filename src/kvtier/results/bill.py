"""What a run's KV management cost in money: the GPU time spent recomputing history that was
not kept, and the memory each tier held, priced at `[policy.cost]`'s dollars.

- **Recompute**: each request's recomputed history tokens, priced by the cost model as one
  prefill of that many tokens from position 0 (without the per-call cost, which the turn pays
  for its new prompt anyway), times the GPUs of a replica that all run it.
- **Holding**: GB-hours per tier, the time integral of the occupancy samples (trapezoids
  between samples), at that tier's $ per GB-hour. Device KV is priced at its share of the GPU's
  price (HBM is part of the GPU that is rented anyway: the device line says what the KV held
  there would cost if that memory were sold by the GB).
- **Per unit**: the total per 1M prompt tokens served, and per session-hour (the time from a
  conversation's first arrival to its last answer, summed over conversations).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any

from kvtier.policy.config import PolicyConfig
from kvtier.policy.cost_model import DEFAULT_DOLLARS_PER_GB_HOUR, GB, CostModel, CostProfile
from kvtier.policy.metrics import Calibration
from kvtier.results.records import RunRecords


@dataclass(frozen=True)
class Bill:
    recompute_gpu_s: float
    gb_hours: dict[str, float]  # per tier, device included
    recompute_dollars: float
    holding_dollars: dict[str, float]  # per tier
    prompt_tokens: int
    session_hours: float

    @property
    def dollars(self) -> float:
        return self.recompute_dollars + sum(self.holding_dollars.values())

    @property
    def per_million_prompt_tokens(self) -> float:
        return self.dollars / self.prompt_tokens * 1e6 if self.prompt_tokens else 0.0

    @property
    def per_session_hour(self) -> float:
        return self.dollars / self.session_hours if self.session_hours else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "dollars": self.dollars,
            "per_million_prompt_tokens": self.per_million_prompt_tokens,
            "per_session_hour": self.per_session_hour,
        }

    def line(self) -> str:
        held = ", ".join(f"{tier} {hours:,.1f}" for tier, hours in self.gb_hours.items())
        return (
            f"recompute {self.recompute_gpu_s:,.1f} GPU-s (${self.recompute_dollars:,.4f}); "
            f"GB-hours {held} (${sum(self.holding_dollars.values()):,.4f}); "
            f"${self.per_million_prompt_tokens:,.4f} per 1M prompt tokens, "
            f"${self.per_session_hour:,.4f} per session-hour"
        )


def bill(
    run: RunRecords,
    model: CostModel,
    gpus_per_replica: int,
    gpu_dollars_per_hour: float,
    dollars_per_gb_hour: Mapping[str, float],
) -> Bill:
    recompute_s = sum(
        model.chunk_recompute_s(r.restored_tokens.get("recomputed", 0), 0)
        for r in run.requests
        if not r.failed
    )
    gpu_s = recompute_s * gpus_per_replica
    gb_hours = _gb_hours(run)
    holding = {tier: hours * dollars_per_gb_hour.get(tier, 0.0) for tier, hours in gb_hours.items()}
    spans: dict[str, tuple[float, float]] = {}
    for r in run.requests:
        end = r.finish_s if r.finish_s is not None else r.arrival_s
        first, last = spans.get(r.session_id, (r.arrival_s, end))
        spans[r.session_id] = (min(first, r.arrival_s), max(last, end))
    return Bill(
        recompute_gpu_s=gpu_s,
        gb_hours=gb_hours,
        recompute_dollars=gpu_s / 3600 * gpu_dollars_per_hour,
        holding_dollars=holding,
        prompt_tokens=sum(r.prompt_tokens for r in run.requests if not r.failed),
        session_hours=sum(last - first for first, last in spans.values()) / 3600,
    )


def priced(
    run: RunRecords, profile: CostProfile, config: PolicyConfig, gpus_per_replica: int = 1
) -> Bill:
    """`bill` at `config`'s `[policy.cost]` prices, recompute timed by `profile` (the
    simulator's hardware model, or the engine's measured prefill costs in `kvtier bench`)."""
    dollars = {**DEFAULT_DOLLARS_PER_GB_HOUR, **config.cost.dollars_per_gb_hour}
    return bill(
        run,
        config.cost_model(profile),
        gpus_per_replica,
        config.cost.gpu_dollars_per_hour,
        dollars,
    )


def money_notes(
    notes: MutableMapping[str, Any],
    run: RunRecords,
    profile: CostProfile,
    config: PolicyConfig,
    calibration: Calibration | None,
    gpus_per_replica: int = 1,
) -> list[str]:
    """The run's bill (`priced`) and, when its policy predicts reuse, how well calibrated
    the predictions were: written into `notes` (the run's entry in a results file's
    `config.runs`: `bill`, `prediction`) and returned as console lines. `kvtier simulate`
    and `kvtier bench` both report them so."""
    money = priced(run, profile, config, gpus_per_replica)
    notes["bill"] = money.to_dict()
    lines = [f"{run.policy}: bill: {money.line()}"]
    if calibration is not None:
        # how well the policy's P(return within its horizon) matched what happened
        lines.append(f"{run.policy}: reuse predictions: {calibration.line()}")
        notes["prediction"] = calibration.summary()
    return lines


def _gb_hours(run: RunRecords) -> dict[str, float]:
    samples = run.occupancy
    totals: dict[str, float] = {}
    for before, after in pairwise(samples):
        dt = after.t_s - before.t_s
        for tier in set(before.used_bytes) | set(after.used_bytes):
            mean = (before.used_bytes.get(tier, 0) + after.used_bytes.get(tier, 0)) / 2
            totals[tier] = totals.get(tier, 0.0) + mean * dt
    return {tier: byte_s / GB / 3600 for tier, byte_s in sorted(totals.items())}
