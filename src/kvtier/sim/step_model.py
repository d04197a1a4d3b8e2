"""How long one engine step takes on a hardware profile: a roofline of FLOPs and bytes.

A step runs `B` decode tokens (sequence i attends to `L_i` keys, `C = sum L_i`) and prefill
chunks (`t_j` tokens starting at position `p_j`) on one tensor-parallel group of `tp` GPUs:

    FLOPs  = f_tok x (B + sum t_j) + f_pair x (C - B/2 + sum t_j (2 p_j + t_j) / 2)
    bytes  = W + kv x (C + sum p_j) + win x (B + #chunks with p_j > 0) + kv x (B + sum t_j)
    step_s = overhead + per_seq x (B + #chunks) + per_key x (C + sum (p_j + t_j))
             + max(FLOPs / (tp x peak x e_c), bytes / (tp x hbm x e_m)) + comm
    comm   = 2 x layers x (lat_ic + 2 (tp - 1) / tp x (B + sum t_j) x hidden x 2 B / bw_ic)

- `f_tok`, `f_pair`: FLOPs per token (2 per active parameter, plus sliding-window attention)
  and per causal query-key pair over the global layers: the cost model's own decomposition
  (`CostProfile.from_geometry`), read off at 1 FLOP/s. A decode token at position L - 1 makes
  L - 1/2 pairs, a chunk t (2p + t) / 2.
- `W`: the weights (bf16), read once per step by everyone in the batch; `kv`: KV bytes per
  token of the global layers, read for every key a query attends to and written for every new
  token; `win`: a sliding-window layer stack's full window per sequence.
- `per_key`: time per key a query gathers outside the roofline (a decode's whole context, a
  chunk's keys up to its end); the CPU engine gathers paged KV into contiguous tensors before
  attention, at well under memory speed and not overlapped with the GEMMs. 0 on GPU profiles.
- Each term has its efficiency (`e_c` of peak FLOP/s, `e_m` of HBM bandwidth): prefill is
  compute-bound, decode memory-bound, and the max picks whichever binds.
- Tensor parallelism divides FLOPs and bytes by `tp` and adds two ring all-reduces of the
  activations per layer (Megatron-LM), not overlapped with compute.

Transfers between a tier and the device take `latency + bytes / bandwidth` per chunk (the
`TierLink` of the cost model), so a chunk of n bytes moves at n / (latency + n / bandwidth).

`cost_profile()` hands the policies and the restore planner the same prefill coefficients:
a = overhead + per_seq + all-reduce latencies, b = f_tok / compute rate + all-reduce bytes
per token + per_key, c = f_pair / compute rate (the compute-bound line; short prefills are
slower here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvtier.errors import KvtierError
from kvtier.plan.geometry import ModelGeometry
from kvtier.plan.hardware import Accelerator
from kvtier.plan.kv_dtypes import get_kv_dtype
from kvtier.plan.planner import weight_bytes
from kvtier.policy.cost_model import CostProfile
from kvtier.sim.profile import HardwareProfile, TierPath

ACTIVATION_BYTES = 2  # bf16 activations in the all-reduces
_UNIT = Accelerator("unit", "1 FLOP/s", 1.0, 1, 1.0)  # turns the cost model's seconds into FLOPs

Chunk = tuple[int, int]  # (tokens, start position) of a prefill chunk


class StepModel:
    def __init__(self, profile: HardwareProfile, geometry: ModelGeometry, tp: int = 1) -> None:
        if tp < 1:
            raise KvtierError(f"tensor-parallel size must be at least 1, not {tp}")
        if tp > 1 and profile.interconnect is None:
            raise KvtierError(
                f"hardware profile {profile.name} has no [interconnect]; it runs one GPU per "
                f"replica, not tensor parallelism over {tp}"
            )
        self.profile, self.geometry, self.tp = profile, geometry, tp
        device = profile.device()
        self.compute_rate = tp * device.peak_flops * profile.efficiency.compute
        self.memory_rate = tp * device.memory_bandwidth * profile.efficiency.memory
        unit = CostProfile.from_geometry(geometry, _UNIT, efficiency=1.0)
        self.flops_per_token, self.flops_per_pair = unit.prefill_token_s, unit.prefill_pair_s
        self.weight_bytes = weight_bytes(geometry, get_kv_dtype("bf16"))
        self.kv_bytes_per_token = geometry.bytes_per_token("bf16")
        per_layer_token = geometry.kv_elements_per_layer_token * 2
        window_tokens = geometry.sliding_window or 0
        self.window_bytes = per_layer_token * geometry.num_sliding_layers * window_tokens
        if tp > 1:
            ic = profile.interconnect
            self.comm_fixed_s = 2 * geometry.num_layers * ic.latency_s
            ring = 2 * (tp - 1) / tp
            per_token = ring * geometry.hidden_size * ACTIVATION_BYTES / ic.bandwidth
            self.comm_per_token_s = 2 * geometry.num_layers * per_token
        else:
            self.comm_fixed_s = self.comm_per_token_s = 0.0
        self.overhead_s = profile.step_overhead_s
        self.sequence_s = profile.sequence_overhead_s
        self.key_s = profile.key_overhead_s
        self.paths: dict[str, TierPath] = profile.tier_paths()
        self._lines: dict[int, tuple[float, float, float, float, float]] = {}

    # -- one step ----------------------------------------------------------------------

    def flops(self, decodes: int, decode_context: int, chunks: Sequence[Chunk] = ()) -> float:
        tokens = decodes + sum(t for t, _ in chunks)
        pairs = decode_context - decodes / 2 + sum(t * (2 * p + t) / 2 for t, p in chunks)
        return self.flops_per_token * tokens + self.flops_per_pair * pairs

    def memory_bytes(
        self, decodes: int, decode_context: int, chunks: Sequence[Chunk] = ()
    ) -> float:
        tokens = decodes + sum(t for t, _ in chunks)
        keys = decode_context + sum(p for _, p in chunks)
        windows = decodes + sum(1 for _, p in chunks if p > 0)
        kv = self.kv_bytes_per_token * (keys + tokens) + self.window_bytes * windows
        return self.weight_bytes + kv

    def comm_s(self, tokens: int) -> float:
        return self.comm_fixed_s + self.comm_per_token_s * tokens if tokens else 0.0

    def step_s(self, decodes: int, decode_context: int, chunks: Sequence[Chunk] = ()) -> float:
        """One step with `decodes` decode tokens over `decode_context` keys in all, and
        prefill `chunks`."""
        compute = self.flops(decodes, decode_context, chunks) / self.compute_rate
        memory = self.memory_bytes(decodes, decode_context, chunks) / self.memory_rate
        tokens = decodes + sum(t for t, _ in chunks)
        sequences = decodes + len(chunks)
        keys = decode_context + sum(t + p for t, p in chunks)
        return (
            self.overhead_s
            + self.sequence_s * sequences
            + self.key_s * keys
            + max(compute, memory)
            + self.comm_s(tokens)
        )

    def prefill_s(self, tokens: int, context_pos: int = 0) -> float:
        """A step that only prefills `tokens` tokens at [context_pos, context_pos + tokens)."""
        return self.step_s(0, 0, ((tokens, context_pos),))

    # -- runs of identical decode steps ------------------------------------------------

    def decode_run_s(self, decodes: int, context: int, steps: int) -> tuple[float, float]:
        """(total, last step) seconds of `steps` decode-only steps of `decodes` sequences,
        the first over `context` keys in all; every step adds one key per sequence. Exact:
        each term is linear in the keys, so the sum splits where the max changes sides."""
        fixed, a1, b1, a2, b2 = self._decode_lines(decodes)
        total = steps * fixed + _sum_of_max(a1, b1, a2, b2, context, decodes, steps)
        keys = context + (steps - 1) * decodes
        return total, fixed + max(a1 + b1 * keys, a2 + b2 * keys)

    def decode_steps_within(self, decodes: int, context: int, seconds: float, limit: int) -> int:
        """Fewest decode steps (at most `limit`) that last at least `seconds`: the run that
        ends at the first step boundary at or after an event `seconds` from now."""
        fixed, a1, b1, a2, b2 = self._decode_lines(decodes)

        def total(steps: int) -> float:
            return steps * fixed + _sum_of_max(a1, b1, a2, b2, context, decodes, steps)

        if total(limit) < seconds:
            return limit
        low, high = 1, limit
        while low < high:
            middle = (low + high) // 2
            if total(middle) >= seconds:
                high = middle
            else:
                low = middle + 1
        return low

    def _decode_lines(self, decodes: int) -> tuple[float, float, float, float, float]:
        """A decode-only step of `decodes` sequences over x keys takes
        fixed + max(a1 + b1 x, a2 + b2 x) (compute, memory; the per-key time, outside the
        max, is added to both slopes); cached per batch size."""
        lines = self._lines.get(decodes)
        if lines is None:
            c0 = self.flops(decodes, 0) / self.compute_rate
            m0 = self.memory_bytes(decodes, 0) / self.memory_rate
            lines = self._lines[decodes] = (
                self.overhead_s + self.sequence_s * decodes + self.comm_s(decodes),
                c0,
                self.flops(decodes, 1) / self.compute_rate - c0 + self.key_s,
                m0,
                self.memory_bytes(decodes, 1) / self.memory_rate - m0 + self.key_s,
            )
        return lines

    # -- what the policies price ---------------------------------------------------------

    def transfer_s(self, nbytes: float, tier: str, *, write: bool = False) -> float:
        path = self.paths[tier]
        return (path.write if write else path.read).seconds(nbytes)

    def cost_profile(self) -> CostProfile:
        """Prefill and link costs for the policies and the restore planner, from this model."""
        return CostProfile(
            prefill_fixed_s=self.overhead_s + self.sequence_s + self.comm_fixed_s,
            prefill_token_s=(
                self.flops_per_token / self.compute_rate + self.comm_per_token_s + self.key_s
            ),
            prefill_pair_s=self.flops_per_pair / self.compute_rate,
            links={tier: path.read for tier, path in self.paths.items()},
            codecs=self.profile.codec_speeds(self.tp),
        )


def _sum_of_max(a1: float, b1: float, a2: float, b2: float, x0: int, dx: int, n: int) -> float:
    """sum over i < n of max(a1 + b1 x_i, a2 + b2 x_i) with x_i = x0 + i dx (dx > 0)."""

    def linear_sum(a: float, b: float, start: int, stop: int) -> float:
        count = stop - start
        if count <= 0:
            return 0.0
        return count * a + b * (count * x0 + dx * (start + stop - 1) * count / 2)

    if b1 == b2:
        a, b = (a1, b1) if a1 >= a2 else (a2, b2)
        return linear_sum(a, b, 0, n)
    if b1 > b2:  # make line 1 the flatter one: it wins left of the crossing
        a1, b1, a2, b2 = a2, b2, a1, b1
    crossing = (a1 - a2) / (b2 - b1)  # x where the steeper line overtakes
    split = min(n, max(0, math.ceil((crossing - x0) / dx)))
    return linear_sum(a1, b1, 0, split) + linear_sum(a2, b2, split, n)
