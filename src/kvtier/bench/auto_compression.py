"""The `auto` preset: pick a scenario preset from what a workload is observed to do, and say why.

A preset cannot be chosen from the request alone: whether compression is worth its accuracy
cost depends on the traffic around it (do turns come back to earlier KV? does the KV in
flight fit the device?). `choose_preset` reads a few numbers that a trace, a generated
workload (`WorkloadObservations.from_analysis`) or a live server can supply and applies the
rules of docs/compression.md ("Scenario presets"), first match wins. The answer is a preset
name (or "full": no compression), its pipeline, and a sentence a person can check.

It never picks `long_code` or `accuracy_critical_reasoning`: content and intent are not in
lengths and timings, so those are for a user to name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.compress.presets import PRESETS
from kvtier.errors import KvtierError

if TYPE_CHECKING:
    from kvtier.analyze.metrics import Analysis
    from kvtier.plan.geometry import ModelGeometry
    from kvtier.workload.model import Workload

FULL = "full"
# Below this share of the device KV budget the KV in flight fits with room to spare.
ROOMY_PRESSURE = 0.5
# Above this, removing half of every request's KV (the ratio-0.5 presets) still overflows.
OVERFLOW_PRESSURE = 2.0
# Turns that return to a session's earlier KV: from this share on, the workload is a chat.
MULTI_TURN_SHARE = 0.5
RESUME_SHARE = 0.25
# A median turn this long is a long-document workload (RULER's 4K and up).
LONG_CONTEXT_TOKENS = 4096


@dataclass(frozen=True)
class WorkloadObservations:
    """What `auto` looks at. Shares are of all turns; lengths are tokens."""

    turns: int
    context_tokens_p50: float  # a turn's prompt (history included) + answer, median
    context_tokens_max: int  # the longest turn
    multi_turn_share: float  # turns after a session's first (continuing or resumed)
    resume_share: float  # turns that come back after a pause (the KV may have moved)
    # Peak KV of the turns in flight over the device KV budget; None where unknown.
    memory_pressure: float | None = None
    # The longest turn's KV over the device KV budget (> 1: one session alone overflows).
    longest_turn_pressure: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if self.turns < 1:
            raise KvtierError(f"auto needs at least one observed turn, got {self.turns}")
        for name in ("multi_turn_share", "resume_share"):
            share = getattr(self, name)
            if not 0.0 <= share <= 1.0:
                raise KvtierError(f"{name} must be a share in [0, 1], got {share!r}")
        if self.resume_share > self.multi_turn_share:
            raise KvtierError(
                f"resume_share ({self.resume_share}) cannot exceed multi_turn_share "
                f"({self.multi_turn_share}): a resumed turn is a later turn of its session"
            )
        for name in ("memory_pressure", "longest_turn_pressure"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise KvtierError(f"{name} must be >= 0 (or None: unknown), got {value!r}")

    @classmethod
    def from_analysis(cls, analysis: Analysis, device_kv_bytes: int) -> WorkloadObservations:
        """From `kvtier.analyze` figures of a trace or generated workload and the device KV
        budget (e.g. the engine's `kv_cache_bytes`)."""
        if device_kv_bytes <= 0:
            raise KvtierError(f"device KV budget must be positive, got {device_kv_bytes}")
        kinds = analysis.kinds
        median = analysis.prompt_tokens.p50 + analysis.output_tokens.p50
        return cls(
            turns=kinds.total,
            context_tokens_p50=median,
            context_tokens_max=analysis.kv.longest_context_tokens,
            multi_turn_share=kinds.share(kinds.continuing + kinds.resumed),
            resume_share=kinds.share(kinds.resumed),
            memory_pressure=analysis.kv.active_peak_bytes / device_kv_bytes,
            longest_turn_pressure=analysis.kv.longest_context_bytes / device_kv_bytes,
            source=analysis.source,
        )


@dataclass(frozen=True)
class AutoChoice:
    preset: str  # a key of PRESETS, or "full"
    method: str  # what `parse_method` reads: the preset's pipeline, or "full"
    reason: str  # one paragraph: the rule that fired and the numbers it fired on

    def __str__(self) -> str:
        return f"{self.preset} ({self.method}): {self.reason}"


def choose_preset(observed: WorkloadObservations) -> AutoChoice:
    """The preset the rules of docs/compression.md give for `observed` (first match wins)."""
    facts = _facts(observed)
    pressure, longest = observed.memory_pressure, observed.longest_turn_pressure
    if longest is not None and longest > 1.0:
        return _choice(
            "edge_device",
            f"the longest turn ({observed.context_tokens_max:,} tokens) needs {longest:.1f}x "
            "the device KV budget on its own; only a constant-size cache (sinks + recent "
            "window) stops a session's KV from growing with its length",
            facts,
        )
    if pressure is not None and pressure < ROOMY_PRESSURE:
        return _choice(
            FULL,
            f"the KV in flight peaks at {pressure:.0%} of the device budget (under "
            f"{ROOMY_PRESSURE:.0%}): it fits with room, so compression would cost accuracy "
            "for memory nobody needs",
            facts,
        )
    if pressure is not None and pressure >= OVERFLOW_PRESSURE:
        return _choice(
            "edge_device",
            f"the KV in flight peaks at {pressure:.1f}x the device budget: even removing half "
            "of every request's KV overflows, so bound each cache to a constant size",
            facts,
        )
    if observed.multi_turn_share >= MULTI_TURN_SHARE or observed.resume_share >= RESUME_SHARE:
        return _choice(
            "multi_turn_chat",
            f"{observed.multi_turn_share:.0%} of turns continue a session and "
            f"{observed.resume_share:.0%} come back after a pause: later turns reuse the "
            "earlier turns' prefix blocks (kept in full, compression copies), so evict only "
            "mildly",
            facts,
        )
    if observed.context_tokens_p50 >= LONG_CONTEXT_TOKENS:
        return _choice(
            "long_single_request",
            f"the median turn holds {observed.context_tokens_p50:,.0f} tokens (at least "
            f"{LONG_CONTEXT_TOKENS:,}) and turns rarely return to a session: long documents "
            "with the question at the end, where query-aware eviction keeps what is asked",
            facts,
        )
    return _choice(
        "datacenter_throughput",
        "many short, mostly single-turn requests compete for device memory: halve each "
        "request's KV so more run at once",
        facts,
    )


def choose_for_workload(
    workload: Workload,
    geometry: ModelGeometry,
    device_kv_bytes: int,
    *,
    kv_dtype: str = "bf16",
    resume_after_s: float = 30.0,
) -> AutoChoice:
    """`auto`'s pick for a generated workload or trace served by a model of `geometry` with
    `device_kv_bytes` of device KV memory (what `kvtier bench` does for `preset = "auto"`)."""
    from kvtier.analyze.metrics import analyze

    analysis = analyze(workload, geometry, kv_dtype=kv_dtype, resume_after_s=resume_after_s)
    return choose_preset(WorkloadObservations.from_analysis(analysis, device_kv_bytes))


def _choice(preset: str, why: str, facts: str) -> AutoChoice:
    method = FULL if preset == FULL else PRESETS[preset]
    return AutoChoice(preset, method, f"{why} ({facts})")


def _facts(observed: WorkloadObservations) -> str:
    pressure = observed.memory_pressure
    parts = [
        f"{observed.turns:,} turns",
        f"median turn {observed.context_tokens_p50:,.0f} tokens",
        f"longest {observed.context_tokens_max:,}",
        f"{observed.multi_turn_share:.0%} later turns",
        f"{observed.resume_share:.0%} resumed",
        "memory pressure unknown" if pressure is None else f"KV in flight {pressure:.0%} of device",
    ]
    return ", ".join(parts)
