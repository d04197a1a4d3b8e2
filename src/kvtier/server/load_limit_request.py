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

from kvtier.load_limit import LoadLimit, parse_load_limit
from kvtier.server.api_errors import APIError

FIELD = "kv_transfer_params"


def read_load_limit(given: Mapping[str, Any] | None, tier_names: Sequence[str]) -> LoadLimit:
    limit, problems = parse_load_limit(given or {}, tier_names)
    if problems:
        key, why = problems[0]
        raise APIError(400, f"{FIELD}.{key}: {why}", param=f"{FIELD}.{key}", code="invalid_value")
    return limit
