"""Length-only trace records (Mooncake, Qwen-Bailian) and sessions built from parent links."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.workload.model import Session, Turn


@dataclass(frozen=True)
class TraceRecord:
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    app_class: str = "chat"


def sessions_from_parents(
    records: Sequence[TraceRecord], parent: Sequence[int | None], prefix: str
) -> list[Session]:
    """Group records (in arrival order) into sessions along parent links, which point to
    earlier records. A turn's `user_tokens` is how much its prompt grew past the parent's
    prompt and answer (0 when it shrank, e.g. history was truncated)."""
    session_of: list[Session] = []
    sessions: list[Session] = []
    for index, record in enumerate(records):
        up = parent[index]
        if up is None:
            session = Session(session_id=f"{prefix}-{index}", turns=[], app_class=record.app_class)
            sessions.append(session)
            grown = record.input_length
        else:
            session = session_of[up]
            before = records[up]
            grown = max(0, record.input_length - before.input_length - before.output_length)
        session.turns.append(
            Turn(
                arrival_s=record.timestamp_s,
                user_tokens=grown,
                output_tokens=record.output_length,
                prompt_tokens=record.input_length,
                hash_ids=record.hash_ids,
            )
        )
        session_of.append(session)
    return sessions
