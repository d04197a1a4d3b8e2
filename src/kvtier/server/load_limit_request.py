"""What a request allows a restore of its history to load, as `kvtier serve` reads it: the
body's `kv_transfer_params` with vLLM's per-request keys, so one request body works against
both servers.

- `kv_load_tiers`: the tiers it may load from, by kvtier's names (`host`, `disk`, `remote`);
  `[]` loads nothing (everything not on the device is recomputed).
- `max_load_tokens`: at most this many tokens loaded (whole chunks).

vLLM warns and ignores a bad value; here it is a 400 naming the field, as every other bad
field is, since a client that asked for a bound and silently got none would measure the
wrong thing. Other keys of `kv_transfer_params` are vLLM's and ignored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.load_limit import NO_LOAD_LIMIT, LoadLimit
from kvtier.server.api_errors import APIError

FIELD = "kv_transfer_params"


def read_load_limit(given: Mapping[str, Any] | None, tier_names: Sequence[str]) -> LoadLimit:
    if not given:
        return NO_LOAD_LIMIT
    tiers = given.get("kv_load_tiers")
    cap = given.get("max_load_tokens")
    if tiers is not None:
        names = [tiers] if isinstance(tiers, str) else tiers
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            _bad("kv_load_tiers", f"a list of tier names is needed, got {tiers!r}")
        unknown = [n for n in names if n not in tier_names]
        if unknown:
            here = ", ".join(tier_names) or "none"
            _bad("kv_load_tiers", f"no tier {unknown[0]!r} here (tiers: {here})")
        tiers = frozenset(names)
    if cap is not None and (type(cap) is not int or cap < 0):
        _bad("max_load_tokens", f"a non-negative integer is needed, got {cap!r}")
    return LoadLimit(tiers, cap)


def _bad(key: str, why: str) -> None:
    raise APIError(400, f"{FIELD}.{key}: {why}", param=f"{FIELD}.{key}", code="invalid_value")
