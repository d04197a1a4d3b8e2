"""RequestView: a vLLM request in the words kvtier's restore and save code uses.

`Restorer`, `Spiller` and the policy runner read a request's id, token count, block keys,
tenant and session. The keys are kvtier's own (`kvtier.engine.hashing`: BLAKE2b over the
parent key, the block's tokens and the namespace), stable across processes and machines,
so a second vLLM process with the same disk directory or Redis finds the first one's chunks;
vLLM's own block hashes are salted per process unless PYTHONHASHSEED is fixed.

Who a request belongs to:
- `kv_transfer_params` `{"tenant": ..., "session_id": ...}` when the client sends them;
- else vLLM's `cache_salt` is the tenant (vLLM isolates its own prefix cache by it, kvtier
  namespaces its keys by it: no hit across tenants);
- else the session is reconstructed from prefix chains (`SessionChains`).

What a client says about its session's future travels in `kv_transfer_params`
`{"kvtier_session": {...}}`, the fields `kvtier serve` reads from its body
(`session_hints`); the retention policy sees them with the session. What a request allows a
restore to load comes as vLLM's offloading connector takes it: `kv_load_tiers` (tier names,
`[]` loads nothing) and `max_load_tokens` (`load_limit`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.engine.hashing import extend_block_keys, namespace_bytes
from kvtier.errors import KvtierError
from kvtier.load_limit import NO_LOAD_LIMIT, LoadLimit, parse_load_limit
from kvtier.policy.config import parse_session_hints
from kvtier.session_hints import NO_HINTS, SessionHints

log = logging.getLogger(__name__)


class VllmRequest(Protocol):
    """The attributes of `vllm.v1.request.Request` this view reads."""

    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int
    cache_salt: str | None
    kv_transfer_params: dict[str, Any] | None
    block_hashes: Sequence[bytes]  # vLLM's hashes of its full blocks (read for KV events)

    @property
    def all_token_ids(self) -> Sequence[int]: ...


@dataclass
class RequestRecord:
    """What the worker side knows of a vLLM request: the scheduler side sends it over (vLLM
    may run them in two processes), its tokens extended as chunks fill up, and, with vLLM's
    KV events on, vLLM's block hashes too (`Save.block_hashes`)."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    @classmethod
    def of(cls, request: VllmRequest) -> RequestRecord:
        return cls(
            request.request_id,
            list(request.all_token_ids),
            request.num_prompt_tokens,
            request.cache_salt,
            dict(request.kv_transfer_params or {}) or None,
            request.num_computed_tokens,
        )


@dataclass
class _Metrics:
    prompt_token_sources: dict[str, int] | None = None


class RequestView:
    def __init__(
        self, request: VllmRequest, model: str, tenant: str | None, session_id: str | None
    ) -> None:
        self.request = request
        self.request_id = request.request_id
        self.tenant = tenant
        self.session_id = session_id
        self.namespace = namespace_bytes(model, tenant)
        self.block_keys: list[bytes] = []
        self.num_cached_tokens: int | None = None  # vLLM's hits + kvtier's loads, at admission
        self.load_limit = NO_LOAD_LIMIT
        self.metrics = _Metrics()

    @property
    def num_tokens(self) -> int:
        return len(self.request.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self.request.num_computed_tokens

    def keys_of_full_blocks(self, block_size: int) -> list[bytes]:
        return extend_block_keys(
            self.block_keys, self.request.all_token_ids, block_size, self.namespace
        )


def identity(request: VllmRequest) -> tuple[str | None, str | None]:
    """(tenant, session id) a request was sent with. A malformed value is ignored with a
    warning: a client's mistake must not take the engine down, and without it the request
    is served as an anonymous one."""
    params = request.kv_transfer_params or {}
    tenant = _text(params, "tenant", request.request_id) or request.cache_salt
    return tenant, _text(params, "session_id", request.request_id)


def session_hints(request: VllmRequest) -> SessionHints:
    """The session hints a request was sent with. Invalid ones are ignored with a warning,
    as a malformed identity is: the request is served, its session without hints."""
    given = (request.kv_transfer_params or {}).get("kvtier_session")
    if given is None:
        return NO_HINTS
    try:
        if not isinstance(given, Mapping):
            raise KvtierError(f"invalid session hints: an object is needed, got {given!r}")
        return parse_session_hints(given)
    except KvtierError as exc:
        log.warning(
            "kvtier: request %s: kv_transfer_params.kvtier_session: %s; ignored",
            request.request_id,
            exc,
        )
        return NO_HINTS


def load_limit(request: VllmRequest, tier_names: Sequence[str]) -> LoadLimit:
    """What the request allows a restore to load, with the semantics of vLLM's offloading
    connector (`parse_load_limit`): what is wrong is ignored with a warning each."""
    limit, problems = parse_load_limit(request.kv_transfer_params or {}, tier_names)
    for key, why in problems:
        log.warning(
            "kvtier: request %s: kv_transfer_params.%s: %s; ignored", request.request_id, key, why
        )
    return limit


def _text(params: dict[str, Any], key: str, request_id: str) -> str | None:
    value = params.get(key)
    if value is None or (isinstance(value, str) and value):
        return value
    log.warning(
        "kvtier: request %s: kv_transfer_params.%s must be a non-empty string, got %r; ignored",
        request_id,
        key,
        value,
    )
    return None


class SessionChains:
    """Sessions from prefix chains, for clients that send no session id.

    A turn of a conversation resends the earlier turns: its prompt's block keys pass through
    the key where the previous turn's prompt, or its prompt and answer, ended. Each finished
    request leaves those two keys pointing at its session; a new request whose prompt holds
    one of them (the latest one found) continues that session, otherwise it starts one. Keys
    carry the tenant's namespace, so a chain never crosses tenants. Bounded: the oldest
    ends are forgotten first."""

    def __init__(self, max_ends: int = 100_000) -> None:
        self.max_ends = max_ends
        self._ends: OrderedDict[bytes, str] = OrderedDict()

    def session_of(self, keys: Sequence[bytes], request_id: str) -> str:
        for key in reversed(keys):
            session = self._ends.get(key)
            if session is not None:
                self._ends.move_to_end(key)
                return session
        return f"chain-{request_id}"

    def remember(self, session_id: str, ends: Sequence[bytes]) -> None:
        for key in ends:
            self._ends[key] = session_id
            self._ends.move_to_end(key)
        while len(self._ends) > self.max_ends:
            self._ends.popitem(last=False)
