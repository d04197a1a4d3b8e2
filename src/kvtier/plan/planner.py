"""The capacity plan: per context length, how big one sequence's KV is, how many fit where, and
whether reloading it over each link beats recomputing it.

Recompute is a prefill of the whole sequence. Its cost, for T tokens:

    FLOPs = 2 x N_active x T  +  sum over layers of 2 x P(T) x heads x (d_qk + d_v)

- the first term is the matrix multiplies (two FLOPs per parameter per token; N_active excludes
  the embedding and LM head, and counts only routed top-k + shared experts for MoE);
- the second is attention, QK^T and AV, over P(T) causal query-key pairs per layer:
  P = T^2 / 2 for a global layer and W^2 / 2 + (T - W) x W for a sliding layer past its window
  W. For dense attention (d_qk = d_v = head_dim) a global layer costs 2 x T^2 x heads x head_dim.

    seconds = FLOPs / (gpus x peak bf16 FLOP/s x efficiency)

with efficiency the share of peak a long prefill reaches (hardware.DEFAULT_EFFICIENCY = 0.5).
Loading is `bytes / link bandwidth`. Both ignore latency and overlap: this is the bulk cost a
restore planner weighs, not a latency prediction.

Capacity: device memory is `gpus x memory - weights`, with weights = total parameters x weight
bytes (tensor parallelism splits both); activations, the CUDA context and paging waste are not
subtracted, so device counts are an upper bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import KvtierError
from kvtier.plan.geometry import ModelGeometry
from kvtier.plan.hardware import LINKS, Accelerator, Link, transfer_seconds
from kvtier.plan.kv_dtypes import WEIGHT_DTYPES, KVDtype, get_kv_dtype
from kvtier.units import check_context

WEIGHT_GROUP_SIZE = 128  # AWQ/GPTQ's usual group when weights are integer-quantized
GPU_COUNTS = (1, 2, 4, 8)  # tensor-parallel sizes tried when the GPU count is left to us


@dataclass(frozen=True)
class LoadTime:
    link: Link
    seconds: float
    beats_recompute: bool


@dataclass(frozen=True)
class ContextPlan:
    tokens: int
    kv_bytes: int
    average_bytes_per_token: float
    device_fit: int  # sequences of this length that fit beside the weights
    tier_fit: int | None  # sequences that fit in the extra tier, if one was given
    recompute_flops: float
    recompute_seconds: float
    loads: tuple[LoadTime, ...]

    @property
    def fastest_load(self) -> LoadTime:
        return min(self.loads, key=lambda load: load.seconds)


@dataclass(frozen=True)
class Plan:
    geometry: ModelGeometry
    kv_dtype: KVDtype
    group_size: int
    weight_dtype: KVDtype
    accelerator: Accelerator
    gpus: int
    efficiency: float
    tier_bytes: int | None
    bytes_per_token: float
    weight_bytes: int
    device_free_bytes: int  # device memory left for KV after the weights
    contexts: tuple[ContextPlan, ...]
    # when the weights do not fit: the widest narrower weight format whose weights would
    weight_dtype_that_fits: KVDtype | None = None

    @property
    def device_bytes(self) -> int:
        return self.gpus * self.accelerator.memory_bytes


def weight_bytes(geometry: ModelGeometry, dtype: KVDtype) -> int:
    return int(geometry.num_parameters * dtype.bytes_per_element(WEIGHT_GROUP_SIZE))


def weight_dtype_that_fits(
    geometry: ModelGeometry, dtype: KVDtype, device_bytes: int
) -> KVDtype | None:
    """The widest weight format narrower than `dtype` whose weights fit in `device_bytes`
    (fp8 before int8 at the same width: no group scales)."""
    narrower = sorted(
        (get_kv_dtype(name) for name in WEIGHT_DTYPES if get_kv_dtype(name).bits < dtype.bits),
        key=lambda d: -d.bits,
    )
    return next((d for d in narrower if weight_bytes(geometry, d) < device_bytes), None)


def gpus_for_weights(nbytes: int, accelerator: Accelerator) -> int:
    """Fewest GPUs (a tensor-parallel size) whose memory holds the weights with room to spare;
    the largest size when none does."""
    for gpus in GPU_COUNTS:
        if gpus * accelerator.memory_bytes > nbytes:
            return gpus
    return GPU_COUNTS[-1]


def attention_pairs(tokens: int, window: int | None) -> float:
    """Causal query-key pairs one layer computes for a prefill of `tokens` tokens."""
    if window is None or tokens <= window:
        return tokens * tokens / 2
    return window * window / 2 + (tokens - window) * window


def prefill_flops(geometry: ModelGeometry, tokens: int) -> float:
    """FLOPs to recompute the KV of `tokens` tokens; the formula is in the module docstring."""
    g = geometry
    per_pair = 2 * g.num_attention_heads * (g.head_dim + (g.v_head_dim or g.head_dim))
    global_layers = g.num_layers - g.num_sliding_layers
    pairs = global_layers * attention_pairs(tokens, None)
    pairs += g.num_sliding_layers * attention_pairs(tokens, g.sliding_window)
    return 2 * g.num_active_parameters * tokens + per_pair * pairs


def recompute_seconds(
    flops: float, accelerator: Accelerator, gpus: int, efficiency: float
) -> float:
    return flops / (gpus * accelerator.peak_flops * efficiency)


def plan(
    geometry: ModelGeometry,
    contexts: Sequence[int],
    *,
    kv_dtype: KVDtype,
    weight_dtype: KVDtype,
    accelerator: Accelerator,
    group_size: int,
    efficiency: float,
    gpus: int | None = None,
    tier_bytes: int | None = None,
    links: Sequence[Link] = LINKS,
) -> Plan:
    """Plan every context length; `gpus=None` picks the fewest GPUs that hold the weights."""
    if not contexts:
        raise KvtierError("give at least one context length")
    for tokens in contexts:
        check_context(tokens)
    if group_size <= 0:
        raise KvtierError(f"group size must be at least 1 element, not {group_size}")
    if not 0 < efficiency <= 1:
        raise KvtierError(f"efficiency is a share of peak FLOP/s in (0, 1], not {efficiency}")
    if gpus is not None and gpus <= 0:
        raise KvtierError(f"GPU count must be at least 1, not {gpus}")
    weights = weight_bytes(geometry, weight_dtype)
    gpus = gpus or gpus_for_weights(weights, accelerator)
    device_bytes = gpus * accelerator.memory_bytes
    device_free = max(0, device_bytes - weights)

    planned = []
    for tokens in contexts:
        nbytes = geometry.kv_bytes(tokens, kv_dtype, group_size)
        flops = prefill_flops(geometry, tokens)
        recompute = recompute_seconds(flops, accelerator, gpus, efficiency)
        loads = []
        for link in links:
            seconds = transfer_seconds(nbytes, link.bandwidth)
            loads.append(LoadTime(link, seconds, seconds < recompute))
        planned.append(
            ContextPlan(
                tokens=tokens,
                kv_bytes=nbytes,
                average_bytes_per_token=nbytes / tokens,
                device_fit=device_free // nbytes,
                tier_fit=None if tier_bytes is None else tier_bytes // nbytes,
                recompute_flops=flops,
                recompute_seconds=recompute,
                loads=tuple(loads),
            )
        )
    return Plan(
        geometry=geometry,
        kv_dtype=kv_dtype,
        group_size=group_size,
        weight_dtype=weight_dtype,
        accelerator=accelerator,
        gpus=gpus,
        efficiency=efficiency,
        tier_bytes=tier_bytes,
        bytes_per_token=geometry.bytes_per_token(kv_dtype, group_size),
        weight_bytes=weights,
        device_free_bytes=device_free,
        contexts=tuple(planned),
        weight_dtype_that_fits=(
            weight_dtype_that_fits(geometry, weight_dtype, device_bytes)
            if not device_free
            else None
        ),
    )
