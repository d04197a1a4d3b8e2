"""What one request allows a restore to load: which tiers, and how many tokens at most.

A client that knows better than the cache (a latency-critical request that must not wait on
a remote read, a benchmark that measures one tier) says so per request, in the words vLLM's
offloading connector uses in `kv_transfer_params`: `kv_load_tiers` (tier names; an empty list
loads nothing) and `max_load_tokens`. A chunk in a tier the request does not allow is treated
as stored nowhere: it is recomputed. The engine's request carries a `LoadLimit`; the restorer
reads it when it plans the request's loads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoadLimit:
    tiers: frozenset[str] | None = None  # None: every tier
    max_tokens: int | None = None  # None: no cap

    def allows(self, tier: str | None) -> bool:
        return self.tiers is None or tier in self.tiers

    @property
    def empty(self) -> bool:
        return self.tiers is None and self.max_tokens is None


NO_LOAD_LIMIT = LoadLimit()


def parse_load_limit(
    params: Mapping[str, Any], tier_names: Sequence[str]
) -> tuple[LoadLimit, list[tuple[str, str]]]:
    """The limit `params` (a request's `kv_transfer_params`) asks for, read as vLLM's
    offloading connector reads it, and what was wrong with it as (key, why) pairs: a tier
    name not here or not a string is left out (only such names: every tier), a bad cap is
    none. vLLM's connector warns about the problems and serves; `kvtier serve` refuses."""
    problems: list[tuple[str, str]] = []
    tiers: frozenset[str] | None = None
    given = params.get("kv_load_tiers")
    if given is not None:
        names = given if isinstance(given, list) else [given]
        if not all(isinstance(n, str) for n in names):
            problems.append(("kv_load_tiers", f"a list of tier names is needed, got {given!r}"))
        unknown = [n for n in names if isinstance(n, str) and n not in tier_names]
        if unknown:
            here = ", ".join(tier_names) or "none"
            problems.append(("kv_load_tiers", f"no tier {unknown[0]!r} here (tiers: {here})"))
        known = [n for n in names if isinstance(n, str) and n in tier_names]
        if known or not names:
            tiers = frozenset(known)
    cap = params.get("max_load_tokens")
    if cap is not None and (type(cap) is not int or cap < 0):
        problems.append(("max_load_tokens", f"a non-negative integer is needed, got {cap!r}"))
        cap = None
    return LoadLimit(tiers, cap), problems
