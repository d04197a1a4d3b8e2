"""Reuse keys (tenant, app class, end kind, tool) as small integers, so that a decision groups
thousands of candidate sessions by key with array passes instead of hashing a tuple each."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Key = tuple[str, str, str | None, str | None]  # `SessionView.reuse_key`


@dataclass(frozen=True)
class KeyGroups:
    """Sessions grouped by key: the distinct keys in order of first appearance, and each
    session's index into them (what `dict.fromkeys` over the sessions' keys would give)."""

    distinct: list[Key]
    at: np.ndarray


def group_keys(keys: list[Key]) -> KeyGroups:
    """The `KeyGroups` of sessions with these keys, for a caller that keeps no codes."""
    distinct = dict.fromkeys(keys)
    which = dict(zip(distinct, range(len(distinct)), strict=True))  # key -> its index
    return KeyGroups(list(distinct), np.fromiter(map(which.__getitem__, keys), np.int64, len(keys)))


class KeyCodes:
    """Key <-> code, codes from 0 up in order of first sight. Codes are never reused, so a
    caller that keeps them bounds the table with `compact` when keys come and go."""

    def __init__(self) -> None:
        self._code: dict[Key, int] = {}
        self._key: list[Key] = []

    def __len__(self) -> int:
        return len(self._key)

    def code(self, key: Key) -> int:
        found = self._code.get(key)
        if found is None:
            found = self._code[key] = len(self._key)
            self._key.append(key)
        return found

    def groups(self, codes: np.ndarray) -> KeyGroups:
        """The `KeyGroups` of sessions with these codes."""
        if not len(codes):
            return KeyGroups([], np.zeros(0, dtype=np.int64))
        distinct, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
        by_first = np.argsort(first, kind="stable")
        rank = np.empty(len(distinct), dtype=np.int64)
        rank[by_first] = np.arange(len(distinct))
        keys = self._key
        return KeyGroups([keys[c] for c in distinct[by_first].tolist()], rank[inverse.ravel()])

    def compact(self, live: np.ndarray) -> np.ndarray:
        """Keep only the codes in `live`, renumbered from 0; returns `live` renumbered."""
        distinct, inverse = np.unique(live, return_inverse=True)
        keys = [self._key[c] for c in distinct.tolist()]
        self._key = keys
        self._code = {key: i for i, key in enumerate(keys)}
        return inverse.ravel().astype(np.int64)
