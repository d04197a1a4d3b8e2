"""Press names -> press objects, and the short method strings CLIs accept.

`parse_method` reads what a user types: "full" (no compression), "snapkv:0.5" (a press and
its ratio), "streaming_llm@512" (a press keeping 512 tokens), "kivi4" / "kivi:4" (KIVI at
4 bits), "lowrank:0.5" / "lowrank@r32" (low rank removing half the bytes / keeping rank 32),
pipelines joined with "+" ("snapkv:0.5+kivi4"), and the scenario presets by name
("edge_device", see `presets.py`).
"""

from __future__ import annotations

import re
from typing import Any

from kvtier.compress.config import EVICTION_PRESSES, PRESS_NAMES, CompressionConfig, PressSpec
from kvtier.compress.fitted_bases import FIT_OPTIONS, LowRankFit, ready_basis
from kvtier.compress.presets import PRESETS
from kvtier.compress.presses.base import EvictionPress
from kvtier.compress.presses.h2o import H2OPress
from kvtier.compress.presses.kivi import KiviPress
from kvtier.compress.presses.knorm import KnormPress
from kvtier.compress.presses.lowrank import LowRankPress
from kvtier.compress.presses.scissorhands import ScissorhandsPress
from kvtier.compress.presses.snapkv import SnapKVPress
from kvtier.compress.presses.streaming_llm import StreamingLLMPress
from kvtier.compress.presses.tova import TOVAPress
from kvtier.errors import KvtierError

EVICTION_CLASSES: dict[str, type[EvictionPress]] = {
    "streaming_llm": StreamingLLMPress,
    "h2o": H2OPress,
    "scissorhands": ScissorhandsPress,
    "snapkv": SnapKVPress,
    "tova": TOVAPress,
    "knorm": KnormPress,
}
assert set(EVICTION_CLASSES) == set(EVICTION_PRESSES)


def build_eviction_press(spec: PressSpec) -> EvictionPress:
    """The press object of an eviction spec; unknown options are a clear error."""
    cls = EVICTION_CLASSES[spec.name]
    try:
        return cls(ratio=spec.ratio, keep_tokens=spec.keep_tokens, **spec.options)
    except TypeError as exc:
        raise KvtierError(f"press {spec.name!r}: bad options {spec.options!r} ({exc})") from None


def build_kivi_press(spec: PressSpec) -> KiviPress:
    try:
        return KiviPress(**spec.options)
    except TypeError as exc:
        raise KvtierError(f"press 'kivi': bad options {spec.options!r} ({exc})") from None


LOWRANK_OPTIONS = ("rank", *FIT_OPTIONS, "residual", "sinks")


def build_lowrank_press(spec: PressSpec) -> LowRankPress:
    """Options: rank, grouping ("layer" | "head"), model (a folder; None: the embedded
    model), calibration (a text name), calibration_tokens, residual and sinks (recent and
    first tokens kept exact). The basis must be ready (see compress/fitted_bases.py); `rank`,
    else the ratio, sets the rank."""
    unknown = sorted(set(spec.options) - set(LOWRANK_OPTIONS))
    if unknown:
        raise KvtierError(
            f"press 'lowrank': unknown options {unknown}; known: {', '.join(LOWRANK_OPTIONS)}"
        )
    basis = ready_basis(LowRankFit.of(spec))
    rank = basis.rank_for(spec.ratio, spec.options.get("rank"))
    exact = {k: v for k, v in spec.options.items() if k in ("residual", "sinks")}
    return LowRankPress(basis, rank, **exact)


_KIVI_SHORT = re.compile(r"kivi(\d+)")


def parse_method(method: str) -> CompressionConfig | None:
    """A CLI method string -> the pipeline it names (None for "full": no compression)."""
    text = method.strip().lower()
    if text in ("full", "none", ""):
        return None
    if text == "auto":
        raise KvtierError(
            "'auto' picks a preset from a workload, so it is not a method by itself: use "
            'kvtier.bench.auto_compression.choose_for_workload (or [compression] preset = "auto" '
            "with kvtier bench), then pass the preset it names"
        )
    text = PRESETS.get(text, text)
    return CompressionConfig(presses=[_parse_one(part.strip()) for part in text.split("+")])


def _parse_one(part: str) -> PressSpec:
    short = _KIVI_SHORT.fullmatch(part)
    if short:
        return PressSpec(name="kivi", options={"bits": int(short.group(1))})
    name, keep, ratio = part, None, 0.0
    if "@" in part:
        name, _, value = part.partition("@")
        if name == "lowrank":
            return _parse_lowrank_rank(value, part)
        keep = _number(value, int, part)
    elif ":" in part:
        name, _, value = part.partition(":")
        if name == "kivi":
            return PressSpec(name="kivi", options={"bits": _number(value, int, part)})
        ratio = _number(value, float, part)
    if name not in PRESS_NAMES:
        raise KvtierError(
            f"unknown compression method {part!r}; use 'full', '<press>:<ratio>', "
            f"'<press>@<tokens>', 'kivi<bits>' or 'lowrank@r<rank>' with press one of "
            f"{', '.join(PRESS_NAMES)}"
        )
    return PressSpec(name=name, ratio=ratio, keep_tokens=keep)


def _parse_lowrank_rank(value: str, part: str) -> PressSpec:
    if not value.startswith("r"):
        raise KvtierError(
            f"method {part!r}: low rank keeps every token; write 'lowrank@r<rank>' "
            "(e.g. lowrank@r32) or 'lowrank:<ratio>'"
        )
    rank = _number(value[1:], int, part)
    if rank < 1:
        raise KvtierError(f"method {part!r}: the rank must be a positive integer")
    return PressSpec(name="lowrank", options={"rank": rank})


def _number(value: str, kind: type, part: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise KvtierError(f"method {part!r}: {value!r} is not a {kind.__name__}") from None
