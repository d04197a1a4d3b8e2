"""How a resumed turn gets its history's KV back: load each chunk, recompute it, or both at once.

The bidirectional plan is Cake's (Jin et al., "Compute Or Load KV Cache? Why Not Both?",
ICML'25): the GPU recomputes chunks from the front while the link loads chunks from the back,
and the two meet at a split s. Chunk i's KV depends on the KV of every chunk before it, so
recomputing it needs chunks 0..i-1 on the device first; loading needs nothing. Recomputing a
prefix [0, s) and loading the suffix back to front therefore never makes either side wait:

    seconds(s) = max(sum of recompute over [0, s), sum of load over [s, n))

minimised over s. Loading back to front is what keeps the meeting point free: the chunks just
after s arrive last, when the front is nearly done. Chunks already on the device cost nothing
either way. The planner assumes one link: loads from host, disk and remote are serialised (they
share the PCIe link into the device), and recomputes run one after another.

Chunks stored nowhere must be recomputed, wherever they are. A missing chunk inside the loaded
suffix waits until every chunk before it is on the device: those are loaded first, in order,
the rest back to front, and the makespan comes from a step-by-step schedule. The planner tries
every split, including s = 0 (pure load: recompute only what is missing) and s = n (pure
recompute), so its plan is never slower than either under the cost model.

The plan is the model's prediction of where the two sides meet; an executor that recomputes
forward and loads backward until they meet (as Cake does) adapts to the real speeds.

An engine that takes loaded KV only right after its own prefix hits, before the forward
(vLLM's connector interface), cannot recompute a front and load a back. For it,
`plan_prefix_restore` weighs the plans it can run: load a leading run of stored chunks, then
prefill the rest, one after the other:

    seconds(t) = sum of load over [0, t) + sum of recompute over [t, n)

minimised over t up to the first chunk stored nowhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Literal

from kvtier.policy.cost_model import CostModel
from kvtier.policy.forms import chunk_restore_s
from kvtier.policy.view import ChunkView
from kvtier.vocab import DEVICE

PlanKind = Literal["load", "recompute", "bidirectional", "prefix"]


@dataclass(frozen=True)
class RestorePlan:
    kind: PlanKind
    # positions [0, split) are recomputed unless on the device already; for a "prefix" plan,
    # [0, split) are loaded and [split, n) recomputed
    split: int
    recompute: tuple[int, ...]  # chunk indices to prefill, in order
    loads: tuple[int, ...]  # chunk indices to load, in issue order
    compute_s: float  # total recompute time
    load_s: float  # total load time
    seconds: float  # when the whole history is on the device


@dataclass(frozen=True)
class _Costs:
    chunks: tuple[ChunkView, ...]
    compute: tuple[float, ...]  # per position; 0 for chunks on the device
    load: tuple[float, ...]  # per position; 0 on the device, inf when stored nowhere

    @classmethod
    def of(cls, chunks: Sequence[ChunkView], model: CostModel) -> _Costs:
        ordered = tuple(sorted(chunks, key=lambda c: c.index))
        compute = tuple(
            0.0 if c.tier == DEVICE else model.chunk_recompute_s(c.tokens, c.token_start)
            for c in ordered
        )
        load = tuple(math.inf if c.tier is None else chunk_restore_s(model, c) for c in ordered)
        return cls(ordered, compute, load)

    @property
    def last_missing(self) -> int:
        """Position of the last chunk stored nowhere, -1 if none."""
        return max((i for i, c in enumerate(self.chunks) if c.tier is None), default=-1)


def plan_restore(chunks: Sequence[ChunkView], model: CostModel) -> RestorePlan:
    """The fastest plan over every split; ties go to the one that recomputes less, since
    recompute takes GPU time from other requests and loading does not."""
    costs = _Costs.of(chunks, model)
    n = len(costs.chunks)
    compute_prefix = [0.0, *accumulate(costs.compute)]
    load_suffix = [0.0, *accumulate(reversed(costs.load))][::-1]
    best_split, best_seconds = 0, math.inf
    for split in range(n + 1):
        if split > costs.last_missing:
            seconds = max(compute_prefix[split], load_suffix[split])
        else:
            seconds = _schedule(costs, split)[2]
        if seconds < best_seconds:
            best_split, best_seconds = split, seconds
    return _plan(costs, best_split)


def pure_load(chunks: Sequence[ChunkView], model: CostModel) -> RestorePlan:
    """Load everything stored; recompute only the chunks stored nowhere."""
    return _plan(_Costs.of(chunks, model), 0)


def pure_recompute(chunks: Sequence[ChunkView], model: CostModel) -> RestorePlan:
    """Recompute everything not on the device."""
    costs = _Costs.of(chunks, model)
    return _plan(costs, len(costs.chunks))


def plan_prefix_restore(chunks: Sequence[ChunkView], model: CostModel) -> RestorePlan:
    """The fastest plan that loads a leading run of chunks and recomputes the rest after it
    (loads and prefill in sequence); ties go to the one that recomputes less."""
    costs = _Costs.of(chunks, model)
    n = len(costs.chunks)
    first_missing = next((i for i, c in enumerate(costs.chunks) if c.tier is None), n)
    compute_suffix = [0.0, *accumulate(reversed(costs.compute))][::-1]
    best_cut, best_seconds, loaded_s = 0, compute_suffix[0], 0.0
    for cut in range(1, first_missing + 1):
        loaded_s += costs.load[cut - 1]
        if loaded_s + compute_suffix[cut] <= best_seconds:
            best_cut, best_seconds = cut, loaded_s + compute_suffix[cut]
    positions = range(n)
    loads = [i for i in positions if i < best_cut and costs.chunks[i].tier != DEVICE]
    recompute = [i for i in positions if i >= best_cut and costs.chunks[i].tier != DEVICE]
    kind: PlanKind = "recompute" if not loads else "load" if not recompute else "prefix"
    return _result(costs, kind, best_cut, recompute, loads, best_seconds)


def _plan(costs: _Costs, split: int) -> RestorePlan:
    recompute, loads, seconds = _schedule(costs, split)
    n = len(costs.chunks)
    kind: PlanKind = "load" if split == 0 else "recompute" if split == n else "bidirectional"
    return _result(costs, kind, split, recompute, loads, seconds)


def _result(
    costs: _Costs,
    kind: PlanKind,
    split: int,
    recompute: list[int],
    loads: list[int],
    seconds: float,
) -> RestorePlan:
    """The plan of these positions, named by the chunks' own indices."""
    index = [chunk.index for chunk in costs.chunks]
    return RestorePlan(
        kind=kind,
        split=split,
        recompute=tuple(index[i] for i in recompute),
        loads=tuple(index[i] for i in loads),
        compute_s=sum(costs.compute[i] for i in recompute),
        load_s=sum(costs.load[i] for i in loads),
        seconds=seconds,
    )


def _schedule(costs: _Costs, split: int) -> tuple[list[int], list[int], float]:
    """(positions to recompute, positions to load in issue order, makespan) for a split."""
    chunks = costs.chunks
    recompute = [
        i for i, c in enumerate(chunks) if (i < split and c.tier != DEVICE) or c.tier is None
    ]
    loaded = [i for i, c in enumerate(chunks) if i >= split and c.tier not in (DEVICE, None)]
    last_recompute = recompute[-1] if recompute else -1
    # chunks some recompute depends on go first, in order; the rest from the back
    early = [i for i in loaded if i < last_recompute]
    late = [i for i in reversed(loaded) if i > last_recompute]
    arrival: dict[int, float] = {}
    link = 0.0
    for i in early + late:
        link += costs.load[i]
        arrival[i] = link
    gpu = 0.0
    ready = 0.0  # when every early load before the current chunk has arrived
    early_iter = iter(early)
    pending = next(early_iter, None)
    for i in recompute:
        while pending is not None and pending < i:
            ready = arrival[pending]
            pending = next(early_iter, None)
        gpu = max(gpu, ready) + costs.compute[i]
    return recompute, early + late, max(gpu, link)
