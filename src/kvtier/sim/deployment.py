"""What is simulated: a model on a hardware profile, split into replicas of `tp` GPUs, each with
a device KV pool and its own host / disk / remote tiers, and the engine's scheduling knobs.

Every budget is per replica. By default a replica gets one tensor-parallel group of all the
GPUs (one replica), and its device KV pool is what vLLM would give it: 90% of the GPUs' memory
(`gpu_memory_utilization`) minus the bf16 weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kvtier.errors import KvtierError
from kvtier.plan.geometry import ModelGeometry
from kvtier.plan.kv_dtypes import get_kv_dtype
from kvtier.plan.planner import weight_bytes
from kvtier.results.records import STORE_TIERS
from kvtier.sim.profile import HardwareProfile

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of device memory the engine takes


@dataclass(frozen=True)
class Deployment:
    profile: HardwareProfile
    geometry: ModelGeometry
    gpus: int = 1
    tp: int = 0  # GPUs per replica; 0: all of them (one replica)
    device_kv_bytes: int = 0  # per replica; 0: vLLM's share of memory after the weights
    tier_bytes: dict[str, int] = field(default_factory=dict)  # host/disk/remote, per replica
    block_size: int = 16  # device page ([scheduling] block_size)
    chunk_tokens: int = 256  # unit of movement between tiers
    max_num_seqs: int = 256  # running requests per replica (vLLM's default)
    max_num_batched_tokens: int = 8192  # tokens per step (decodes first, then prefill chunks)
    session_resume_after_s: float = 30.0  # a longer gap makes a turn "resumed", not "continuing"
    # Short of device memory, the engine asks the policy for the waiting request's need plus
    # this share of the pool, so that it is not back at the very next admission (each call
    # looks at every stored chunk).
    pressure_headroom: float = 0.05
    # kvtier's engine calls its policy runner after each step, so an idle engine runs no
    # policy; True mirrors that (a tick that finds the replica idle waits for its next step),
    # False runs the policy on its timer whatever the replica does.
    timer_after_steps: bool = False
    # Write-through (LMCache's default, SGLang HiCache's write_through): at the end of each
    # turn, full chunks without a copy are written to the top lower tier in the background
    # while they stay on the device, so a later demotion there frees device memory at once.
    # The copies fill space the policies see as free and are dropped first when it is needed.
    write_through: bool = False
    # A chunk moved off the device keeps its pages there as a clean copy until the pool needs
    # them (vLLM's prefix cache keeps a freed block's contents until it reuses the block): the
    # space counts as free, and a turn that resumes before it is reused finds its KV there.
    keep_moved: bool = False
    # The engine's prefix cache also finds blocks other conversations computed (a system
    # prompt, a shared document). True models that for leading blocks: see docs/simulate.md.
    shared_prefixes: bool = False

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise KvtierError(f"--gpus must be at least 1, not {self.gpus}")
        tp = self.tp or self.gpus
        if tp < 1 or self.gpus % tp:
            raise KvtierError(f"--tp {tp} must divide the GPU count {self.gpus}")
        object.__setattr__(self, "tp", tp)
        unknown = set(self.tier_bytes) - set(STORE_TIERS)
        if unknown:
            raise KvtierError(f"unknown tiers {sorted(unknown)}; lower tiers: {STORE_TIERS}")
        missing = [t for t, size in self.tier_bytes.items() if size and t not in self.profile.links]
        if missing:
            raise KvtierError(f"hardware profile {self.profile.name} has no link for {missing}")
        if self.chunk_tokens % self.block_size:
            raise KvtierError(
                f"chunk tokens ({self.chunk_tokens}) must be a multiple of the block size "
                f"({self.block_size})"
            )
        if not 1 <= self.max_num_seqs <= self.max_num_batched_tokens:
            raise KvtierError(
                f"need 1 <= max_num_seqs ({self.max_num_seqs}) <= max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): every running decode gets a token each step"
            )
        if not 0 <= self.pressure_headroom < 1:
            raise KvtierError(
                f"pressure headroom is a share in [0, 1), not {self.pressure_headroom}"
            )
        if self.device_kv_bytes <= 0:
            object.__setattr__(self, "device_kv_bytes", self.default_device_kv_bytes())

    @property
    def replicas(self) -> int:
        return self.gpus // self.tp

    @property
    def tiers(self) -> dict[str, int]:
        """Lower tiers that exist (budget above zero), fastest first."""
        return {t: self.tier_bytes[t] for t in STORE_TIERS if self.tier_bytes.get(t, 0) > 0}

    def default_device_kv_bytes(self) -> int:
        memory = self.tp * self.profile.device().memory_bytes * GPU_MEMORY_UTILIZATION
        room = int(memory - weight_bytes(self.geometry, get_kv_dtype("bf16")))
        if room <= 0:
            raise KvtierError(
                f"{self.geometry.name}'s weights do not fit in {GPU_MEMORY_UTILIZATION:.0%} of "
                f"{self.tp} x {self.profile.name}; use more GPUs per replica (--tp) or give "
                "--device-kv-bytes"
            )
        return room

    @cached_property
    def bytes_per_token(self) -> int:
        """bf16 KV bytes of one token (what each further token adds, sliding windows full)."""
        return int(self.geometry.bytes_per_token("bf16"))

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of `tokens` tokens of KV in whole device pages (what a pool or a chunk holds)."""
        return -(-tokens // self.block_size) * self.block_size * self.bytes_per_token

    def describe(self) -> dict[str, Any]:
        return {
            "hardware": self.profile.name,
            "model": self.geometry.name,
            "gpus": self.gpus,
            "tp": self.tp,
            "replicas": self.replicas,
            "device_kv_bytes": self.device_kv_bytes,
            "tier_bytes": self.tiers,
            "links": {
                tier: {"bandwidth": p.read.bandwidth, "latency_s": p.read.latency_s}
                for tier, p in self.profile.tier_paths().items()
                if tier in self.tiers
            },
            # results.json keys (schema kvtier.results/1): the names the files have always had
            "block_tokens": self.block_size,
            "chunk_tokens": self.chunk_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_batched_tokens": self.max_num_batched_tokens,
            "resume_after_s": self.session_resume_after_s,
            "pressure_headroom": self.pressure_headroom,
            "timer_after_steps": self.timer_after_steps,
            "write_through": self.write_through,
            "keep_moved": self.keep_moved,
            "shared_prefixes": self.shared_prefixes,
        }
