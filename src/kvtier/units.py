"""Quantities the planner reads from people and prints back: sizes, counts, token lengths, times.

Sizes print in decimal GB (what datasheets and disks use) next to binary GiB (what allocators and
`nvidia-smi` use), because the two differ by 7% and that is enough to change a "fits" answer.
"""

from __future__ import annotations

import math
import re

from kvtier.errors import KvtierError

GB = 10**9
GIB = 2**30

_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# Longest context accepted: 16.8M tokens, above every published model's window (Llama 4 Scout:
# 10M); beyond it the figures are a typo's, and a model's own limit is flagged in the verdict.
MAX_CONTEXT_TOKENS = 2**24
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'512GB' -> 512e9 bytes, '64GiB' -> 64 * 2**30; a bare number is bytes."""
    problem = (
        f"cannot read size {text!r}: write a number and a unit, e.g. 512GB or 64GiB "
        f"(units: {', '.join(u.upper().replace('I', 'i') for u in _SIZE_UNITS)})"
    )
    return _scaled(text, {"": 1, **_SIZE_UNITS}, problem, "size")


def parse_count(text: str) -> int:
    """'70B' -> 70e9, '135M' -> 135e6, '7.6e9' -> 7.6e9 (parameter counts)."""
    problem = f"cannot read count {text!r}: write e.g. 70B, 135M or 7.6e9"
    return _scaled(text, _COUNT_SUFFIXES, problem, "count")


def _scaled(text: str, units: dict[str, int], problem: str, what: str) -> int:
    """A number with one of `units` as a whole number above zero, or `problem` as the error."""
    match = _NUMBER_UNIT.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in units:
        raise KvtierError(problem)
    value = float(match.group(1)) * units[unit]
    if not math.isfinite(value):  # '1e400' overflows a float
        raise KvtierError(f"{what} {text!r} is too large")
    if int(value) <= 0:
        raise KvtierError(f"{what} {text!r} must be more than zero")
    return int(value)


def parse_token_counts(text: str) -> list[int]:
    """'8000,128000' -> [8000, 128000]; every entry a whole number in [1, MAX_CONTEXT_TOKENS]."""
    counts = []
    for item in text.split(","):
        item = item.strip()
        try:
            tokens = int(item)
        except ValueError:
            raise KvtierError(
                f"context length {item!r} is not a whole number of tokens (e.g. 8000,128000)"
            ) from None
        check_context(tokens)
        counts.append(tokens)
    return counts


def check_context(tokens: int) -> None:
    if not 1 <= tokens <= MAX_CONTEXT_TOKENS:
        raise KvtierError(
            f"context length {tokens:,} must be between 1 and {MAX_CONTEXT_TOKENS:,} tokens"
        )


def _three_figures(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_bytes(nbytes: float) -> str:
    """Decimal units, three significant figures: 41,943,040,000 -> '41.9 GB'."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if nbytes >= scale:
            return f"{_three_figures(nbytes / scale)} {unit}"
    return f"{nbytes:,.0f} B"


def format_gib(nbytes: float) -> str:
    """Binary units, three significant figures: 41,943,040,000 -> '39.1 GiB'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{_three_figures(nbytes / scale)} {unit}"
    return f"{nbytes:,.0f} B"


def format_count(count: float) -> str:
    """Parameter counts: 70,553,706,496 -> '70.6B'."""
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= scale:
            return f"{_three_figures(count / scale)}{suffix}"
    return f"{count:,.0f}"


def format_seconds(seconds: float) -> str:
    """About two significant figures, whole seconds from 10 s: 52 ms, 0.84 s, 2.9 s, 80 s."""
    if seconds >= 10:
        return f"{seconds:,.0f} s"
    if seconds >= 1:
        return f"{seconds:.1f} s"
    if seconds >= 0.1:
        return f"{seconds:.2f} s"
    ms = seconds * 1000
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.2g} ms"
