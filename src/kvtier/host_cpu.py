"""The host's CPU as benchmarks record it: its model and the instruction sets a CPU engine's
speed depends on.

Timings differ between hosts far more than between runs: vLLM-CPU's prefill runs about five
times faster on a CPU with AMX tiles than on one without, and kvtier's prefill attention
kernel does not use them. So every speed figure says which CPU it is from (`describe()`), and
results files keep the same in a `cpu` field (`as_dict()`).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

# the CPU flags the engine's and vLLM-CPU's kernels choose paths by
FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class HostCpu:
    model: str
    cores: int
    # those of FEATURES the CPU has, in FEATURES' order; None: not known (no /proc/cpuinfo)
    features: tuple[str, ...] | None

    @property
    def amx(self) -> bool | None:
        return None if self.features is None else "amx_bf16" in self.features

    @property
    def native_bf16(self) -> bool:
        """Whether the CPU multiplies bf16 in hardware (AVX512_BF16 or AMX); False where its
        features are unknown."""
        return self.features is not None and bool({"avx512_bf16", "amx_bf16"} & set(self.features))

    def describe(self) -> str:
        """One line: `AMD EPYC, 2 cores; avx2, avx512f, avx512_bf16, avx512_vnni; no AMX`."""
        head = f"{self.model}, {self.cores} cores"
        if self.features is None:
            return f"{head}; CPU features unknown"
        listed = ", ".join(self.features) or "none of " + ", ".join(FEATURES)
        return f"{head}; {listed}; {'AMX' if self.amx else 'no AMX'}"

    def as_dict(self) -> dict[str, object]:
        features = None if self.features is None else list(self.features)
        return {"model": self.model, "cores": self.cores, "features": features}


def host_cpu(cpuinfo: Path = CPUINFO) -> HostCpu:
    """This host's CPU, from `cpuinfo` (Linux's /proc/cpuinfo); elsewhere, or unreadable, the
    platform's processor name and its features unknown."""
    cores = os.cpu_count() or 1
    try:
        text = cpuinfo.read_text()
    except OSError:
        return HostCpu(platform.processor() or "unknown CPU", cores, None)
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
        if model and flags:
            break
    return HostCpu(model or "unknown CPU", cores, tuple(f for f in FEATURES if f in flags))
