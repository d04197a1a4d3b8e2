"""What a policy asks the store to do. `chunk_idx=None` means every stored chunk of the session.

The store executes actions in list order. Policies order them so that each action only uses
space that exists at its point in the list (drops first, then moves out of the slowest tiers
first), so a tier never goes over its budget mid-way; `ledger.Ledger` checks exactly that.
Chunks no action mentions stay where they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.vocab import FULL


@dataclass(frozen=True)
class Keep:
    """Looked at and left in place (counted by metrics; a no-op for the store)."""

    session_id: str
    chunk_idx: int | None = None


@dataclass(frozen=True)
class Move:
    """Copy to `tier` in `form` (e.g. "int8" to quantize on the way), then free the source."""

    session_id: str
    chunk_idx: int | None
    tier: str
    form: str = FULL


@dataclass(frozen=True)
class Drop:
    """Free the KV everywhere; a later turn recomputes it."""

    session_id: str
    chunk_idx: int | None = None


Action = Keep | Move | Drop
