"""Qwen-Bailian traces (Alibaba Cloud Model Studio, the "KVCache in the wild" release): requests
with explicit conversation links.

One JSON object per line: `chat_id`, `parent_chat_id` (-1, null or missing on a first turn),
`timestamp` (seconds), `input_length`, `output_length`, optional `turn`, `type` (text, image,
...; kept as the session's app class) and `hash_ids` (prefix block ids, 16 tokens each in the
public release). Sessions follow the parent chain. A parent that is missing from the file (the
release is sampled) or arrives after its child starts a new session, and a note says how often.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.workload.jsonl import (
    BadRecord,
    id_list,
    number,
    parse_lines,
    read_text,
    warn_skipped,
    whole,
)
from kvtier.workload.model import Workload
from kvtier.workload.records import TraceRecord, sessions_from_parents

BLOCK_SIZE = 16
_ROOT = (-1, None, "", "-1")


def parse_record(obj: dict[str, Any]) -> tuple[str, str | None, TraceRecord]:
    """(chat id, parent chat id or None, record)."""
    chat_id = obj.get("chat_id")
    if chat_id is None or isinstance(chat_id, bool | list | dict):
        raise BadRecord(f"field 'chat_id' must be an id (number or string), not {chat_id!r}")
    up = obj.get("parent_chat_id")
    if isinstance(up, bool | list | dict):
        raise BadRecord(f"field 'parent_chat_id' must be an id, -1 or null, not {up!r}")
    kind = obj.get("type", "chat")
    record = TraceRecord(
        timestamp_s=number(obj, "timestamp"),
        input_length=whole(obj, "input_length", 1),
        output_length=whole(obj, "output_length", 0),
        hash_ids=id_list(obj, "hash_ids"),
        app_class=str(kind) if kind else "chat",
    )
    return str(chat_id), None if up in _ROOT else str(up), record


def load_bailian(path: str | Path, *, block_size: int = BLOCK_SIZE) -> Workload:
    parsed, errors = parse_lines(path, read_text(path), parse_record)
    parsed.sort(key=lambda item: (item[1][2].timestamp_s, item[0]))
    index_of: dict[str, int] = {}
    records: list[TraceRecord] = []
    parent: list[int | None] = []
    orphans = 0
    for number_, (chat_id, up, record) in parsed:
        if chat_id in index_of:
            errors.append(f"line {number_}: chat_id {chat_id!r} repeats an earlier line's")
            continue
        if up is not None and up not in index_of:
            orphans += 1
        parent.append(index_of.get(up) if up is not None else None)
        index_of[chat_id] = len(records)
        records.append(record)
    workload = Workload(
        sessions=sessions_from_parents(records, parent, Path(path).stem),
        source=f"bailian {path}",
        block_size=block_size,
        errors=errors,
    )
    warn_skipped(path, errors)
    if orphans:
        workload.notes.append(
            f"{orphans:,} request(s) name a parent that is not earlier in the file: "
            "each starts a new session"
        )
    return workload
