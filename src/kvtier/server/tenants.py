"""Per-tenant accounting of cached device KV blocks, and quota enforcement.

`TenantCache` is a `BlockEventListener` on the engine's block pool. When a block becomes full
and cached it records which tenant (and session) filled it, found through the request that
holds the block; when a cached block goes idle it joins that tenant's own LRU. A tenant whose
idle cached bytes exceed its `device_quota_bytes` has its *own* oldest idle blocks dropped at
once, so a tenant that floods the server recycles its own cache instead of evicting
everyone else's (the pool's global LRU only reaches other tenants' blocks when free blocks and
over-quota blocks are gone).

Only the engine's public API is used: `block_owner` names who filled a block,
`drop_cached` / `pin_blocks` / `unpin_blocks` change the pool, and `exclusive()` holds the
engine lock, under which the listener callbacks run too, so this class's own state needs no
lock of its own.
"""

from __future__ import annotations

import sys
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.engine import Engine

ANONYMOUS = "anonymous"


@dataclass
class TenantCacheStats:
    tenant: str
    cached_blocks: int  # cached (keyed) blocks filled by this tenant, in use or idle
    idle_blocks: int  # of which idle (refcount 0, evictable)
    cached_bytes: int
    idle_bytes: int
    quota_bytes: int | None
    quota_evictions: int
    pinned_blocks: int = 0


class TenantCache:
    def __init__(self, engine: Engine, quotas: dict[str, int | None] | None = None) -> None:
        self.engine = engine
        self.pool = engine.block_pool
        self.bytes_per_block = engine.kv_pool.bytes_per_block
        self.quotas = dict(quotas or {})
        # block id -> (tenant, session id) for every cached block this listener saw filled
        self.owner: dict[int, tuple[str, str | None]] = {}
        # tenant -> idle cached block ids, least recently freed first. A prefix hit takes an
        # idle block back without an event, so entries are re-checked against refcounts.
        self.idle: dict[str, OrderedDict[int, None]] = defaultdict(OrderedDict)
        self.cached_blocks: dict[str, int] = defaultdict(int)
        self.quota_evictions: dict[str, int] = defaultdict(int)
        # (tenant, session) -> blocks this listener holds a reference on (pinned: never evicted)
        self.pinned: dict[tuple[str, str], list[int]] = {}

    def quota_blocks(self, tenant: str) -> int | None:
        quota = self.quotas.get(tenant)
        return None if quota is None else quota // self.bytes_per_block

    # ----- BlockEventListener -------------------------------------------------------------

    def on_block_filled(self, block_id: int, key: bytes) -> None:
        filler = self.engine.block_owner(block_id)
        if filler is None:  # e.g. restored from a tier: no request filled it here
            self.owner[block_id] = (ANONYMOUS, None)
        else:
            self.owner[block_id] = (filler.tenant or ANONYMOUS, plain_session(filler.session_id))
        self.cached_blocks[self.owner[block_id][0]] += 1

    def on_block_freed(self, block_id: int) -> None:
        owner = self.owner.get(block_id)
        if owner is None:
            return
        tenant = owner[0]
        idle = self.idle[tenant]
        idle.pop(block_id, None)
        idle[block_id] = None  # most recently freed last
        self._enforce(tenant)

    def on_block_evicted(self, block_id: int, key: bytes) -> None:
        owner = self.owner.pop(block_id, None)
        if owner is None:
            return
        self.cached_blocks[owner[0]] -= 1
        self.idle[owner[0]].pop(block_id, None)

    # ----- queries and admin operations ---------------------------------------------------

    def stats(self) -> list[TenantCacheStats]:
        with self.engine.exclusive():
            tenants = set(self.cached_blocks) | set(self.quotas)
            out = []
            for tenant in sorted(tenants):
                idle = len(self._prune(tenant))
                cached = self.cached_blocks.get(tenant, 0)
                out.append(
                    TenantCacheStats(
                        tenant,
                        cached,
                        idle,
                        cached * self.bytes_per_block,
                        idle * self.bytes_per_block,
                        self.quotas.get(tenant),
                        self.quota_evictions.get(tenant, 0),
                        self._num_pinned(tenant),
                    )
                )
            return out

    def clear_tenant(self, tenant: str) -> int:
        """Unpin and drop every idle cached block of `tenant`; returns how many were dropped."""
        with self.engine.exclusive():
            for owner in [o for o in self.pinned if o[0] == tenant]:
                self._unpin(owner)
            return self._drop(list(self._prune(tenant)))

    def evict_session(self, tenant: str, session_id: str) -> int:
        """Unpin and drop the idle cached blocks `session_id`'s turns filled; returns how many."""
        with self.engine.exclusive():
            self._unpin((tenant, session_id))
            idle = self._prune(tenant)
            return self._drop([b for b in idle if self.owner.get(b) == (tenant, session_id)])

    def pin_session(self, tenant: str, session_id: str) -> int | None:
        """Hold a reference on the session's cached blocks so nothing evicts them.

        Pinned bytes count against the tenant's quota: returns None (nothing pinned) when
        pinning would exceed it, else the number of blocks newly pinned.
        """
        with self.engine.exclusive():
            owner = (tenant, session_id)
            held = set(self.pinned.get(owner, []))
            blocks = [b for b, o in self.owner.items() if o == owner and b not in held]
            limit = self.quota_blocks(tenant)
            if limit is not None and self._num_pinned(tenant) + len(blocks) > limit:
                return None
            pinned = self.engine.pin_blocks(blocks)
            self.pinned.setdefault(owner, []).extend(pinned)
            return len(pinned)

    def pin_room(self, tenant: str, session_id: str) -> int | None:
        """Blocks `session_id` may hold pinned within its tenant's quota, beside what the
        tenant's other sessions hold pinned (its own pins count as room); None: no quota."""
        with self.engine.exclusive():
            limit = self.quota_blocks(tenant)
            if limit is None:
                return None
            return limit - self._num_pinned(tenant) + len(self.pinned.get((tenant, session_id), []))

    def unpin_session(self, tenant: str, session_id: str) -> int:
        with self.engine.exclusive():
            unpinned = self._unpin((tenant, session_id))
        self.withdraw_pin(tenant, session_id)
        return unpinned

    def withdraw_pin(self, tenant: str, session_id: str) -> None:
        """The session's `pin` hint is not in force: the retention policy stops seeing it
        pinned (until a later turn pins it again)."""
        self.engine.withdraw_pin(scoped_session(tenant, session_id))

    def unpin_all(self) -> int:
        with self.engine.exclusive():
            return sum(self._unpin(owner) for owner in list(self.pinned))

    def _unpin(self, owner: tuple[str, str]) -> int:
        blocks = self.pinned.pop(owner, [])
        self.engine.unpin_blocks(blocks)  # idle again: back under the quota's LRU
        return len(blocks)

    def _num_pinned(self, tenant: str) -> int:
        return sum(len(b) for o, b in self.pinned.items() if o[0] == tenant)

    # ----- internals ----------------------------------------------------------------------

    def _prune(self, tenant: str) -> OrderedDict[int, None]:
        """The tenant's idle list without blocks a prefix hit took back into use."""
        idle = self.idle[tenant]
        for block_id in [b for b in idle if not self.pool.is_idle_cached(b)]:
            del idle[block_id]
        return idle

    def _enforce(self, tenant: str) -> None:
        limit = self.quota_blocks(tenant)
        if limit is None:
            return
        idle = self._prune(tenant)
        excess = len(idle) - limit
        if excess > 0:
            self.quota_evictions[tenant] += self._drop(list(idle)[:excess])

    def _drop(self, block_ids: list[int]) -> int:
        """Evict idle cached blocks now; every listener (this one, a tiered store) hears it."""
        return self.engine.drop_cached(block_ids)


def scoped_session(tenant: str, session: str) -> str:
    """The engine's id of a tenant's session, `tenant/session` (interned as `plain_session`'s
    result is)."""
    return sys.intern(f"{tenant}/{session}")


def plain_session(session_id: str | None) -> str | None:
    """The server namespaces session ids per tenant as `tenant/session`; undo that.

    Interned: every block a session fills holds the same string, not a copy per block.
    """
    if session_id is None:
        return None
    return sys.intern(session_id.split("/", 1)[1]) if "/" in session_id else session_id
