"""Fit a hardware profile to measured engine steps: what `kvtier calibrate` calls.

The step model says a step of S sequences attending to K keys in all takes `overhead +
per_seq x S + per_key x K + max(FLOPs / R_c, bytes / R_m)` on one device (`step_model.py`), so
five numbers describe a machine: the per-step, per-sequence and per-key overheads, and the
compute rate R_c and memory rate R_m that real steps reach. Given timed prefill steps (tokens,
context position, seconds) and decode steps (batch, context per sequence, seconds) of a known
model, the fit alternates two moves until they agree: put each step on the side of the
roofline the current estimate says binds it, then solve `seconds = overhead + per_seq x S +
per_key x K + FLOPs / R_c` (compute-bound steps) and `... + bytes / R_m` (memory-bound ones)
together by non-negative least squares on relative errors (a 60 ms decode step counts as much
as a 2 s prefill). The alternation can settle in a poor split, so it starts from three (prefill
on compute and decode on memory, everything on compute, everything on memory) and keeps the
fit with the smallest relative error under the model's own max.

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
    rows = []  # sequences, keys, FLOPs, bytes, seconds
    for tokens, position, seconds in measurements.prefill:
        chunk = ((tokens, position),)
        rows.append(
            (
                1,
                position + tokens,
                model.flops(0, 0, chunk),
                model.memory_bytes(0, 0, chunk),
                seconds,
            )
        )
    for batch, context, seconds in measurements.decode:
        keys = batch * (context + 1)  # each sequence attends to its context and the new token
        rows.append(
            (batch, keys, model.flops(batch, keys), model.memory_bytes(batch, keys), seconds)
        )
    table = np.array(rows, dtype=float)
    seconds = table[:, 4]
    if (seconds <= 0).any() or not np.isfinite(seconds).all():
        raise KvtierError("measured step times must be finite and above zero")
    device = base.device()
    defaults = (1 / device.peak_flops, 1 / device.memory_bandwidth)
    prefill = np.arange(len(rows)) < len(measurements.prefill)
    starts = (prefill, np.ones(len(rows), dtype=bool), np.zeros(len(rows), dtype=bool))
    fits = [_alternate(table, start, defaults) for start in starts]
    overhead, per_sequence, per_key, per_flop, per_byte = min(fits, key=lambda f: _error(table, f))
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
        key_overhead_s=per_key,
        interconnect=base.interconnect,
        links=base.links,
    )


Fit = tuple[float, float, float, float, float]  # overhead, per sequence, per key, s/FLOP, s/B


def _alternate(table: np.ndarray, compute_bound: np.ndarray, defaults: tuple[float, float]) -> Fit:
    sequences, keys, flops, nbytes, seconds = table.T
    per_flop, per_byte = defaults
    weight = 1 / seconds  # least squares on relative errors
    fit: Fit = (0.0, 0.0, 0.0, per_flop, per_byte)
    for _ in range(MAX_ROUNDS):
        features = np.column_stack(
            [np.ones(len(table)), sequences, keys, flops * compute_bound, nbytes * ~compute_bound]
        )
        solved = _nonnegative_lstsq(features * weight[:, None], seconds * weight)
        overhead, per_sequence, per_key, fitted_flop, fitted_byte = solved
        # a side no step is bound by keeps the base profile's rate: the data cannot see it
        per_flop = fitted_flop if compute_bound.any() and fitted_flop > 0 else per_flop
        per_byte = fitted_byte if (~compute_bound).any() and fitted_byte > 0 else per_byte
        fit = (overhead, per_sequence, per_key, per_flop, per_byte)
        bound = flops * per_flop >= nbytes * per_byte
        if (bound == compute_bound).all():
            break
        compute_bound = bound
    return fit


def _error(table: np.ndarray, fit: Fit) -> float:
    """Sum of squared relative errors of the step model (with its max) under `fit`."""
    sequences, keys, flops, nbytes, seconds = table.T
    overhead, per_sequence, per_key, per_flop, per_byte = fit
    predicted = (
        overhead
        + per_sequence * sequences
        + per_key * keys
        + np.maximum(flops * per_flop, nbytes * per_byte)
    )
    return float((((predicted - seconds) / seconds) ** 2).sum())
