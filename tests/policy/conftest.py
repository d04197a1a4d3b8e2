"""Builders for hand-made policy views, shared by the policy tests as the `kv` fixture."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from types import SimpleNamespace

import pytest

from kvtier.policy.actions import Action, Drop, Keep
from kvtier.policy.cost_model import CostModel, CostProfile
from kvtier.policy.ledger import Ledger
from kvtier.policy.view import (
    ChunkView,
    PolicyView,
    QueueView,
    SessionView,
    TierView,
    TurnView,
)

BYTES_PER_TOKEN = 131_072  # Llama-3.1-8B, bf16: 2 x 32 layers x 8 KV heads x 128 x 2 B
CHUNK_TOKENS = 256
GB = 10**9


def chunks(
    tokens: int,
    tier: str | None = "device",
    *,
    chunk_tokens: int = CHUNK_TOKENS,
    last_access: float = 0.0,
) -> tuple[ChunkView, ...]:
    out = []
    for index, start in enumerate(range(0, tokens, chunk_tokens)):
        end = min(start + chunk_tokens, tokens)
        size = (end - start) * BYTES_PER_TOKEN
        out.append(ChunkView(index, start, end, tier, size, last_access=last_access))
    return tuple(out)


def session(
    session_id: str,
    tokens: int,
    *,
    tier: str | None = "device",
    idle_since: float | None = 0.0,
    app_class: str = "chat",
    **fields: object,
) -> SessionView:
    """An idle session with one finished turn that holds `tokens` tokens in `tier`."""
    last = idle_since if idle_since is not None else 0.0
    turn = TurnView(arrival=last - 1.0, prompt_tokens=tokens, finished=idle_since)
    return SessionView(
        session_id,
        app_class=app_class,
        turns=(turn,),
        chunks=chunks(tokens, tier, last_access=last),
        active=idle_since is None,
        idle_since=idle_since,
        **fields,
    )


def view(
    sessions: Iterable[SessionView],
    capacity: Mapping[str, int],
    *,
    other_used: Mapping[str, int] | None = None,
    queue: QueueView | None = None,
    bytes_needed: int | None = None,
) -> PolicyView:
    """A view whose tier usage is the sessions' chunks plus `other_used` (KV of sessions the
    test does not spell out). `bytes_needed` makes it a pressure call."""
    sessions = tuple(sessions)
    used = dict.fromkeys(capacity, 0)
    for name, n in (other_used or {}).items():
        used[name] += n
    for s in sessions:
        for c in s.stored_chunks():
            used[c.tier] += c.size_bytes
    tiers = tuple(TierView(name, used[name], capacity[name]) for name in capacity)
    return PolicyView(
        sessions=sessions,
        tiers=tiers,
        queue=queue or QueueView(),
        bytes_per_token=BYTES_PER_TOKEN,
        reason="pressure" if bytes_needed is not None else "timer",
        bytes_needed=bytes_needed or 0,
    )


def apply(v: PolicyView, actions: Iterable[Action]) -> PolicyView:
    """The view after the store ran `actions` (budgets checked on the way)."""
    actions = list(actions)
    ledger = Ledger(v).apply_all(actions)
    sessions = tuple(
        dataclasses.replace(
            s,
            chunks=tuple(
                dataclasses.replace(c, tier=ledger.tier_of((s.session_id, c.index)))
                for c in s.chunks
            ),
        )
        for s in v.sessions
    )
    tiers = tuple(dataclasses.replace(t, used_bytes=ledger.used(t.name)) for t in v.tiers)
    return dataclasses.replace(v, sessions=sessions, tiers=tiers)


def placement(v: PolicyView, actions: Iterable[Action]) -> dict[tuple[str, int], str | None]:
    """Where every chunk of the view is after `actions`."""
    ledger = Ledger(v).apply_all(actions)
    return {
        (s.session_id, c.index): ledger.tier_of((s.session_id, c.index))
        for s in v.sessions
        for c in s.chunks
    }


def changes(actions: Iterable[Action]) -> list[Action]:
    return [a for a in actions if not isinstance(a, Keep)]


def dropped(actions: Iterable[Action]) -> list[Drop]:
    return [a for a in actions if isinstance(a, Drop)]


def slow_model() -> CostModel:
    """A machine where recompute is slow (about 2,000 tokens/s) and PCIe is not."""
    return CostModel(CostProfile(prefill_fixed_s=0.01, prefill_token_s=5e-4, prefill_pair_s=5e-8))


@pytest.fixture(scope="session")
def kv() -> SimpleNamespace:
    return SimpleNamespace(
        BYTES_PER_TOKEN=BYTES_PER_TOKEN,
        CHUNK_TOKENS=CHUNK_TOKENS,
        GB=GB,
        chunks=chunks,
        session=session,
        view=view,
        apply=apply,
        placement=placement,
        changes=changes,
        dropped=dropped,
        slow_model=slow_model,
    )
