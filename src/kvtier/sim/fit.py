"""Fit a hardware profile to measured engine steps: what `kvtier calibrate` will call.

The step model says a step of S sequences takes `overhead + per_seq x S + max(FLOPs / R_c,
bytes / R_m)` on one device (`step_model.py`), so four numbers describe a machine: the per-step
and per-sequence overheads, the compute rate R_c and the memory rate R_m that real steps reach.
Given timed prefill steps (tokens, context position, seconds) and decode steps (batch, context
per sequence, seconds) of a known model, the fit alternates two moves until they agree: put
each step on the side of the roofline the current estimate says binds it (prefill starts on
compute, decode on memory), then solve `seconds = overhead + per_seq x S + FLOPs / R_c`
(compute-bound steps) and `... + bytes / R_m` (memory-bound ones) together by non-negative
least squares.

The result is a profile whose accelerator numbers *are* the effective rates (efficiencies 1),
with the base profile's memory size, interconnect and links.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.errors import KvtierError
from kvtier.plan.geometry import ModelGeometry
from kvtier.policy.cost_model import _nonnegative_lstsq
from kvtier.sim.profile import AcceleratorSpec, Efficiency, HardwareProfile
from kvtier.sim.step_model import StepModel

MAX_ROUNDS = 20


@dataclass(frozen=True)
class Measurements:
    prefill: Sequence[tuple[int, int, float]]  # (tokens, context position, seconds) per step
    decode: Sequence[tuple[int, int, float]]  # (batch, context tokens per sequence, seconds)


def fit_profile(
    measurements: Measurements,
    geometry: ModelGeometry,
    base: HardwareProfile,
    *,
    name: str | None = None,
) -> HardwareProfile:
    """A profile of the machine that ran `geometry` in these measured steps (one device)."""
    if len(measurements.prefill) < 2 or len(measurements.decode) < 2:
        raise KvtierError(
            "fitting a hardware profile needs 2 prefill and 2 decode measurements at least, got "
            f"{len(measurements.prefill)} and {len(measurements.decode)}"
        )
    model = StepModel(base, geometry)
    rows = []  # sequences, FLOPs, bytes, seconds
    for tokens, position, seconds in measurements.prefill:
        chunk = ((tokens, position),)
        rows.append((1, model.flops(0, 0, chunk), model.memory_bytes(0, 0, chunk), seconds))
    for batch, context, seconds in measurements.decode:
        keys = batch * (context + 1)  # each sequence attends to its context and the new token
        rows.append((batch, model.flops(batch, keys), model.memory_bytes(batch, keys), seconds))
    sequences, flops, nbytes, seconds = np.array(rows, dtype=float).T
    if (seconds <= 0).any() or not np.isfinite(seconds).all():
        raise KvtierError("measured step times must be finite and above zero")
    compute_bound = np.arange(len(rows)) < len(measurements.prefill)
    device = base.device()
    per_flop, per_byte = 1 / device.peak_flops, 1 / device.memory_bandwidth
    overhead = per_sequence = 0.0
    for _ in range(MAX_ROUNDS):
        features = np.column_stack(
            [np.ones(len(rows)), sequences, flops * compute_bound, nbytes * ~compute_bound]
        )
        overhead, per_sequence, fitted_flop, fitted_byte = _nonnegative_lstsq(features, seconds)
        # a side no step is bound by keeps the base profile's rate: the data cannot see it
        per_flop = fitted_flop if compute_bound.any() and fitted_flop > 0 else per_flop
        per_byte = fitted_byte if (~compute_bound).any() and fitted_byte > 0 else per_byte
        bound = flops * per_flop >= nbytes * per_byte
        if (bound == compute_bound).all():
            break
        compute_bound = bound
    return HardwareProfile(
        name=name or f"{base.name}-fitted",
        description=(
            f"fitted to {len(measurements.prefill)} prefill and {len(measurements.decode)} "
            f"decode steps of {geometry.name} (kvtier.sim.fit), from {base.name}"
        ),
        sources=[f"measured steps of {geometry.name}", *base.sources],
        accelerator=AcceleratorSpec(
            name=f"{base.name}, measured",
            peak_flops=1 / per_flop,
            memory_bandwidth=1 / per_byte,
            memory_bytes=device.memory_bytes,
        ),
        efficiency=Efficiency(compute=1.0, memory=1.0),
        step_overhead_s=overhead,
        sequence_overhead_s=per_sequence,
        interconnect=base.interconnect,
        links=base.links,
    )
