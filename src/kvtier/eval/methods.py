"""Which engine configurations an evaluation runs: methods x compression ratios.

A plain press name ("snapkv") runs once per non-zero ratio; ratio 0 is the shared full-cache
baseline (the engine guarantees compression ratio 0 equals no compression). A fully written
method ("snapkv:0.5", "streaming_llm@512", "kivi4", "snapkv:0.5+kivi4") runs once as given.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import KvtierError

FULL = "full"
DEFAULT_RATIOS = (0.0, 0.25, 0.5, 0.75, 0.875)
_FIXED = re.compile(r".*[:@+].*|kivi\d+")


@dataclass(frozen=True)
class MethodRun:
    method: str  # what the user named: "snapkv", "kivi4", "full"
    ratio: float | None  # the share of KV removed; None where the method has no ratio
    spec: str  # the string handed to kvtier.compress.parse_method

    @property
    def label(self) -> str:
        return self.spec


def check_ratios(ratios: Sequence[float]) -> list[float]:
    if not ratios:
        raise KvtierError("give at least one compression ratio")
    for ratio in ratios:
        if not (math.isfinite(ratio) and 0.0 <= ratio < 1.0):
            raise KvtierError(
                f"compression ratio must be in [0, 1) (share of the KV removed), got {ratio:g}"
            )
    return sorted(set(ratios))


def plan_runs(methods: Sequence[str], ratios: Sequence[float]) -> list[MethodRun]:
    """The runs to make, full-cache baseline first; every method is validated here, before
    any model is loaded."""
    ratios = check_ratios(ratios)
    names = [m.strip().lower() for m in methods if m.strip()]
    if not names:
        raise KvtierError("give at least one method")
    runs: list[MethodRun] = []
    if FULL in names or 0.0 in ratios:
        runs.append(MethodRun(FULL, 0.0, FULL))
    for name in names:
        if name == FULL:
            continue
        if _FIXED.fullmatch(name):
            parse(name)  # validates
            runs.append(MethodRun(name, _single_ratio(name), name))
            continue
        if name == "kivi":
            raise KvtierError("method 'kivi' needs a bit width: kivi8, kivi4 or kivi2")
        parse(name)  # an unknown name fails here, before any ratio is attached
        for ratio in ratios:
            if ratio > 0:
                spec = f"{name}:{ratio:g}"
                parse(spec)
                runs.append(MethodRun(name, ratio, spec))
    return list(dict.fromkeys(runs))  # drop repeats, keep order


def parse(spec: str) -> Any:
    """`kvtier.compress.parse_method(spec)`: a CompressionConfig, or None for full cache."""
    if spec == FULL:
        return None
    try:
        from kvtier.compress import parse_method
    except ImportError as exc:
        raise KvtierError(
            f"method {spec!r} needs kvtier.compress, which this installation lacks ({exc}); "
            "only 'full' is available"
        ) from None
    return parse_method(spec)


def _single_ratio(spec: str) -> float | None:
    match = re.fullmatch(r"[a-z_]+:([0-9.]+)", spec)
    return float(match.group(1)) if match else None
