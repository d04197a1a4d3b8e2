"""What recomputing, loading and holding KV cost, in one currency: seconds of latency.

Recompute (prefill of tokens [p, p + t) given the KV of [0, p) on the device):

    recompute_s(t, p) = a + b * t + c * t * (2p + t) / 2

`a` is the fixed cost of a prefill call, `b` the per-token cost (matrix multiplies: 2 FLOPs per
active parameter per token), `c` the cost of one causal query-key pair summed over layers;
t * (2p + t) / 2 is the number of pairs the t new queries attend to, so a chunk's cost grows
with its position. Splitting a prefill into chunks adds up exactly, except that `a` is paid
once: `chunk_recompute_s` is the marginal cost without it (a resumed turn prefills its new
prompt anyway, so it pays `a` whatever the history costs).

Load from tier T to the device: `latency_T + bytes / bandwidth_T`. The per-operation latency
makes the effective bandwidth a function of transfer size (Hockney's n_1/2 = latency x
bandwidth: a transfer that size reaches half the sustained rate).

Holding `n` bytes in tier T for `s` seconds at occupancy u costs `n * s * price_T(u)`,

    price_T(u) = rent_T * (base_T + max(0, u - headroom_T) / (1 - u)) + floor  (u capped at 0.99)

Space is paid for whether used or not, so its price is what it denies others: nothing while
the tier has headroom, rising without bound as it fills (the 1/(1 - u) of a queue's delay).
`base` (0 by default) charges a share of the rent at any occupancy; the device's next arrivals
are priced by demand in the cost policy's auction instead (a constant 1% device share demoted
idle KV from devices with room). Host, disk and remote space is bought as a budget, so while it
has room holding KV there denies nobody anything (headroom 0.9 there: pricing their dollar
rents or any contention sent long-idle sessions to NVMe while DRAM sat free, which cost latency
and saved no money). `floor` is the least any byte costs anywhere, equal in
every tier so it never picks between them (0 by default): a floor frees KV a session is
unlikely to come back for from a tier with room, which buys no latency and, the space being
paid for anyway, no money, while the predictor's cut-off age already drops what it counts as
never returning (0.1% of host DRAM's rent dropped sessions idle 20-60 minutes from a device
with hundreds of GB free, and the few that came back were recomputed: docs/cost-model.md).
A chunk stored in a quantized form (int8 / int4, docs/tiers.md "Forms") moves and holds fewer
bytes, and pays its codec: `decode_s` when it is restored (on the restore's path, so TTFT) and
`encode_s` when it is demoted (on the mover's worker, so worker time, not TTFT). Codec speeds
are bytes of full-precision KV per second (`CodecSpeed`): measured on this machine's CPU
(`MEASURED_CPU_CODECS`), or derived for an accelerator from its memory bandwidth
(`CodecSpeed.memory_bound`: a codec kernel streams its input and output once; encoding reads its
input twice, for the group ranges and for the codes).

`rent_T` converts money to seconds at the exchange rate 1 s of latency = 1 s of GPU time:
rent_T = 3600 * ($ per GB-hour of tier T) / ($ per GPU-hour). docs/cost-model.md has the numbers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvtier.errors import KvtierError
from kvtier.plan.hardware import DEFAULT_EFFICIENCY, LINKS
from kvtier.policy.ledger import form_bytes
from kvtier.vocab import FULL

if TYPE_CHECKING:
    from kvtier.plan.geometry import ModelGeometry
    from kvtier.plan.hardware import Accelerator

GB = 1e9
MAX_OCCUPANCY = 0.99  # where the congestion factor stops growing, so prices stay finite

# Dollar prices behind the default rents; order-of-magnitude cloud list prices, replace them
# with your own in [policy.cost] (docs/cost-model.md derives each).
DEFAULT_GPU_DOLLARS_PER_HOUR = 2.5  # one H100 on demand
DEFAULT_DOLLARS_PER_GB_HOUR = {
    "device": 2.5 / 80,  # the GPU's price spread over its 80 GB of HBM
    "host": 0.008,  # DRAM in a memory-optimised instance
    "disk": 0.08 / 730,  # block SSD at $0.08 per GB-month
    "remote": 0.02,  # a managed in-memory cache (Redis)
}
# Occupancy (by KV no policy may move) below which a tier's space costs nothing: device HBM
# once active requests hold half of it; budgeted tiers only near full (the auction shares them).
DEFAULT_HEADROOM = {"device": 0.5, "host": 0.9, "disk": 0.9, "remote": 0.9}
# Share of the rent charged even with headroom left: none. Space with room denies nobody
# anything; the device's coming arrivals bid for it in the cost policy's auction (demand.py),
# and the predictor's cut-off age still drops what never returns.
DEFAULT_BASE_SHARE = {"device": 0.0, "host": 0.0, "disk": 0.0, "remote": 0.0}
# The least a GB-hour costs in any tier with room: none (see the module docstring).
DEFAULT_FLOOR_DOLLARS_PER_GB_HOUR = 0.0


def _bandwidth(key: str) -> float:
    return next(link.bandwidth for link in LINKS if link.key == key)


@dataclass(frozen=True)
class TierLink:
    """The path from a tier to the device: `latency_s + bytes / bandwidth`."""

    bandwidth: float  # bytes/s a bulk transfer sustains
    latency_s: float = 0.0  # per operation

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency_s < 0:
            raise KvtierError(
                f"a tier link needs bandwidth > 0 and latency >= 0, got {self.bandwidth} B/s "
                f"and {self.latency_s} s"
            )

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float]]) -> TierLink:
        """Least-squares latency and bandwidth from measured (bytes, seconds) transfers, e.g. a
        tier's latency histogram; needs two sizes at least."""
        data = np.array(list(samples), dtype=float).reshape(-1, 2)
        if len(np.unique(data[:, 0])) < 2:
            raise KvtierError("fitting a tier link needs transfers of at least two sizes")
        features = np.column_stack([np.ones(len(data)), data[:, 0]])
        latency, per_byte = _nonnegative_lstsq(features, data[:, 1])
        if per_byte <= 0:
            raise KvtierError("transfer times do not grow with size; cannot fit a bandwidth")
        return cls(bandwidth=1 / per_byte, latency_s=latency)


# Latencies are assumptions of the right order (a PCIe copy launch, an NVMe read, a Redis round
# trip on a LAN); `kvtier calibrate` measures both numbers.
DEFAULT_LINKS = {
    "host": TierLink(_bandwidth("pcie4"), 10e-6),
    "disk": TierLink(_bandwidth("nvme4"), 100e-6),
    "remote": TierLink(_bandwidth("100gbe"), 1e-3),
}


@dataclass(frozen=True)
class CodecSpeed:
    """A stored form's codec speed, in bytes of full-precision KV per second."""

    encode_bytes_per_s: float
    decode_bytes_per_s: float

    def __post_init__(self) -> None:
        if not (self.encode_bytes_per_s > 0 and self.decode_bytes_per_s > 0):
            raise KvtierError(
                f"codec speeds must be > 0 bytes/s, got encode {self.encode_bytes_per_s} and "
                f"decode {self.decode_bytes_per_s}"
            )

    @classmethod
    def memory_bound(cls, bandwidth: float, form: str) -> CodecSpeed:
        """A codec kernel limited by memory traffic: per full byte, decoding reads the form's
        bytes and writes the full ones; encoding reads the full bytes twice (group ranges,
        then codes) and writes the form's."""
        ratio = form_bytes(1 << 20, FULL, form) / (1 << 20)
        return cls(bandwidth / (2 + ratio), bandwidth / (1 + ratio))


# benchmarks/resume.py's codec timing (docs/tiers.md "Forms"): one 256-token chunk of SmolLM2
# KV (5,898,240 bytes of bf16) on this project's 2-vCPU VM, one torch thread, medians of 7:
# encode 12.5 ms (int8) / 10.1 ms (int4), decode 8.9 / 2.1 ms (INT4's fused decode,
# compress/fused.py; benchmarks/records/2026-12-01-fused-int4-decode.md).
_CHUNK = 5_898_240
MEASURED_CPU_CODECS = {
    "int8": CodecSpeed(_CHUNK / 12.5e-3, _CHUNK / 8.9e-3),
    "int4": CodecSpeed(_CHUNK / 10.1e-3, _CHUNK / 2.1e-3),
}
# a fused codec kernel reaches about half of peak memory bandwidth (an assumption; no GPU here)
CODEC_MEMORY_EFFICIENCY = 0.5


def memory_bound_codecs(bandwidth: float) -> dict[str, CodecSpeed]:
    """Every stored form's codec at `bandwidth` bytes/s of effective memory traffic."""
    return {form: CodecSpeed.memory_bound(bandwidth, form) for form in MEASURED_CPU_CODECS}


@dataclass(frozen=True)
class CostProfile:
    """Measured (or derived) speeds: prefill coefficients and each tier's link to the device."""

    prefill_fixed_s: float  # a
    prefill_token_s: float  # b
    prefill_pair_s: float  # c, per causal query-key pair, all layers
    links: Mapping[str, TierLink] = field(default_factory=lambda: dict(DEFAULT_LINKS))
    # stored form -> codec speed; the default is this machine's CPU, measured
    codecs: Mapping[str, CodecSpeed] = field(default_factory=lambda: dict(MEASURED_CPU_CODECS))

    def __post_init__(self) -> None:
        coefficients = (self.prefill_fixed_s, self.prefill_token_s, self.prefill_pair_s)
        if any(not math.isfinite(x) or x < 0 for x in coefficients):
            raise KvtierError(f"prefill coefficients must be finite and >= 0, got {coefficients}")

    @classmethod
    def from_measurements(
        cls,
        samples: Iterable[tuple[int, int, float]],
        links: Mapping[str, TierLink] | None = None,
    ) -> CostProfile:
        """Fit a, b, c by least squares (kept non-negative) to measured prefills given as
        (tokens, context_pos, seconds): prefilling `tokens` tokens on top of `context_pos`."""
        data = np.array(list(samples), dtype=float).reshape(-1, 3)
        if len(data) < 3:
            raise KvtierError(
                f"fitting prefill costs needs 3 measurements at least, got {len(data)}"
            )
        tokens, position, seconds = data.T
        if (tokens <= 0).any() or (position < 0).any() or not np.isfinite(seconds).all():
            raise KvtierError("prefill measurements need tokens > 0, context_pos >= 0, finite s")
        features = np.column_stack(
            [np.ones(len(data)), tokens, tokens * (2 * position + tokens) / 2]
        )
        a, b, c = _nonnegative_lstsq(features, seconds)
        return cls(a, b, c, dict(DEFAULT_LINKS if links is None else links))

    @classmethod
    def from_geometry(
        cls,
        geometry: ModelGeometry,
        accelerator: Accelerator,
        *,
        gpus: int = 1,
        efficiency: float = DEFAULT_EFFICIENCY,
        links: Mapping[str, TierLink] | None = None,
    ) -> CostProfile:
        """Coefficients from FLOPs, the planner's prefill model (kvtier.plan.planner): b from
        2 x active parameters, c from QK^T and AV over the global layers. Sliding-window layers
        attend to at most `window` keys, which is linear in tokens, so they join b."""
        rate = gpus * accelerator.peak_flops * efficiency
        g = geometry
        per_pair = 2 * g.num_attention_heads * (g.head_dim + (g.v_head_dim or g.head_dim))
        global_layers = g.num_layers - g.num_sliding_layers
        per_token = 2 * g.num_active_parameters
        per_token += per_pair * g.num_sliding_layers * (g.sliding_window or 0)
        return cls(
            prefill_fixed_s=0.0,
            prefill_token_s=per_token / rate,
            prefill_pair_s=per_pair * global_layers / rate,
            links=dict(DEFAULT_LINKS if links is None else links),
            codecs=memory_bound_codecs(
                gpus * accelerator.memory_bandwidth * CODEC_MEMORY_EFFICIENCY
            ),
        )


@dataclass(frozen=True)
class Prices:
    """Rent per tier in seconds per GB-hour and the occupancy below which space is free."""

    rent_s_per_gb_hour: Mapping[str, float]
    headroom: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_HEADROOM))
    base_share: float | Mapping[str, float] = field(
        default_factory=lambda: dict(DEFAULT_BASE_SHARE)
    )  # one for every tier, or per tier
    floor_s_per_gb_hour: float = 0.0

    @classmethod
    def from_dollars(
        cls,
        gpu_dollars_per_hour: float = DEFAULT_GPU_DOLLARS_PER_HOUR,
        dollars_per_gb_hour: Mapping[str, float] | None = None,
        headroom: Mapping[str, float] | None = None,
        base_share: float | Mapping[str, float] | None = None,
        floor_dollars_per_gb_hour: float = DEFAULT_FLOOR_DOLLARS_PER_GB_HOUR,
    ) -> Prices:
        """Convert money to latency at 1 s of latency = 1 s of the GPU's time."""
        dollars = {**DEFAULT_DOLLARS_PER_GB_HOUR, **(dollars_per_gb_hour or {})}
        rent = {tier: 3600 * price / gpu_dollars_per_hour for tier, price in dollars.items()}
        if base_share is None or isinstance(base_share, (int, float)):
            share = dict(DEFAULT_BASE_SHARE) if base_share is None else base_share
        else:
            share = {**DEFAULT_BASE_SHARE, **base_share}
        floor = 3600 * floor_dollars_per_gb_hour / gpu_dollars_per_hour
        return cls(rent, {**DEFAULT_HEADROOM, **(headroom or {})}, share, floor)

    def per_byte_second(self, tier: str, occupancy: float) -> float:
        u = min(max(occupancy, 0.0), MAX_OCCUPANCY)
        congestion = max(0.0, u - self.headroom.get(tier, 0.0)) / (1 - u)
        base = self.base_share
        if not isinstance(base, (int, float)):
            base = base.get(tier, DEFAULT_BASE_SHARE.get(tier, 0.0))
        rent = self.rent_s_per_gb_hour[tier] * (base + congestion) + self.floor_s_per_gb_hour
        return rent / (GB * 3600)


@dataclass(frozen=True)
class CostModel:
    profile: CostProfile
    prices: Prices = field(default_factory=Prices.from_dollars)

    def recompute_s(self, tokens: int, context_pos: int) -> float:
        """One prefill call of `tokens` tokens at positions [context_pos, context_pos + tokens)."""
        if tokens <= 0:
            return 0.0
        return self.profile.prefill_fixed_s + self.chunk_recompute_s(tokens, context_pos)

    def chunk_recompute_s(self, tokens: int, context_pos: int) -> float:
        """The same tokens as part of a larger prefill: without the per-call cost."""
        p = self.profile
        pairs = tokens * (2 * context_pos + tokens) / 2
        return p.prefill_token_s * tokens + p.prefill_pair_s * pairs

    def load_s(self, nbytes: int, tier: str) -> float:
        if tier == "device":
            return 0.0
        try:
            return self.profile.links[tier].seconds(nbytes)
        except KeyError:
            raise KvtierError(f"the cost profile has no link for tier {tier!r}") from None

    def decode_s(self, full_bytes: float, form: str) -> float:
        """Decoding a chunk of `full_bytes` (full-precision size) stored in `form`."""
        return 0.0 if form == FULL else full_bytes / self._codec(form).decode_bytes_per_s

    def encode_s(self, full_bytes: float, form: str) -> float:
        """Encoding a chunk of `full_bytes` into `form` (the mover's worker time)."""
        return 0.0 if form == FULL else full_bytes / self._codec(form).encode_bytes_per_s

    def _codec(self, form: str) -> CodecSpeed:
        try:
            return self.profile.codecs[form]
        except KeyError:
            raise KvtierError(f"the cost profile has no codec speed for form {form!r}") from None

    def hold_cost(self, nbytes: int, tier: str, seconds: float, occupancy: float) -> float:
        """Seconds-equivalent cost of keeping `nbytes` in `tier` for `seconds`."""
        return nbytes * seconds * self.prices.per_byte_second(tier, occupancy)


def _nonnegative_lstsq(features: np.ndarray, target: np.ndarray) -> tuple[float, ...]:
    """Least squares with every coefficient >= 0: the best fit over subsets of the features
    (a handful here), since a negative time per token or per byte has no meaning."""
    columns = features.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for size in range(columns, 0, -1):
        for subset in itertools.combinations(range(columns), size):
            coef, *_ = np.linalg.lstsq(features[:, subset], target, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(columns)
            full[list(subset)] = coef
            residual = float(np.sum((features @ full - target) ** 2))
            if best is None or residual < best[0] - 1e-15:
                best = (residual, full)
    if best is None:
        return (0.0,) * columns
    return tuple(float(x) for x in best[1])
