"""Mooncake traces (Qin et al., FAST'25, arXiv:2407.00079): prefix block hashes, no sessions.

One JSON object per line: `timestamp` (ms from the start), `input_length`, `output_length`
(tokens) and `hash_ids`, one id per 512-token block of the prompt, chained so that equal ids
mean an equal prefix. There are no session ids; `reconstruct_sessions` recovers conversations.

The heuristic. A chat app resends the whole conversation each turn, so turn k+1's prompt starts
with all of turn k's prompt. Only turn k's *whole* blocks keep their ids: its last, partial
block is rehashed once more tokens fill it. So:

  request B continues request A when B's hash ids start with all of A's whole-block ids
  (`input_length // 512` of them); among such A, the one with the longest such prefix wins,
  then the most recent (a user who regenerates an answer leaves several candidates).

Prefixes that many unrelated requests share are system prompts, not conversations: a prefix
from which at least `shared_fanout` distinct whole blocks branch off (over the whole trace) is
treated as shared, and a match must reach past it. In the conversation trace, block 0 starts
every request and has 6,047 distinct successors; the most branched other prefix has 7.

Limits: a first turn shorter than the shared prefix plus one whole block (under 1,024 tokens
here) leaves no block of its own, so its continuation starts a new session; an app that
truncates or summarizes history breaks the prefix, and so does any edit of an earlier message;
two users sending the same opening text would be merged (equal ids are equal content).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.workload.jsonl import id_list, number, parse_lines, read_text, warn_skipped, whole
from kvtier.workload.model import Workload
from kvtier.workload.records import TraceRecord, sessions_from_parents

BLOCK_SIZE = 512
DEFAULT_SHARED_FANOUT = 16


@dataclass(frozen=True)
class Reconstruction:
    parent: list[int | None]  # per request: the earlier request it continues
    shared_prefixes: list[tuple[int, int]]  # (blocks, distinct successors) per shared prefix


def parse_record(obj: dict[str, Any]) -> TraceRecord:
    return TraceRecord(
        timestamp_s=number(obj, "timestamp") / 1000.0,
        input_length=whole(obj, "input_length", 1),
        output_length=whole(obj, "output_length", 0),
        hash_ids=id_list(obj, "hash_ids"),
    )


def load_mooncake(
    path: str | Path,
    *,
    block_size: int = BLOCK_SIZE,
    shared_fanout: int = DEFAULT_SHARED_FANOUT,
) -> Workload:
    parsed, errors = parse_lines(path, read_text(path), parse_record)
    parsed.sort(key=lambda item: (item[1].timestamp_s, item[0]))
    records = [record for _, record in parsed]
    found = reconstruct_sessions(records, block_size, shared_fanout)
    workload = Workload(
        sessions=sessions_from_parents(records, found.parent, Path(path).stem),
        source=f"mooncake {path}",
        block_size=block_size,
        errors=errors,
    )
    warn_skipped(path, errors)
    continuing = sum(parent is not None for parent in found.parent)
    shared = ", ".join(
        f"{blocks * block_size:,} tokens before {fanout:,} successors"
        for blocks, fanout in found.shared_prefixes
    )
    workload.notes.append(
        f"sessions reconstructed from hash-id prefixes: {continuing:,} of {len(records):,} "
        f"requests continue an earlier one; shared prefixes (system prompts): {shared or 'none'}"
    )
    return workload


def reconstruct_sessions(
    records: Sequence[TraceRecord], block_size: int, shared_fanout: int
) -> Reconstruction:
    """Which earlier request each request continues (records in arrival order).

    A prefix trie over hash ids: each node is a prefix, named by an int. A first pass counts
    each node's distinct whole-block successors (its fan-out); the second pass, in time order,
    walks each request's prefixes from the longest down, stopping at a shared one, and takes
    the latest earlier request whose whole blocks end exactly at that node."""
    nodes: dict[tuple[int, int], int] = {}
    paths: list[list[int]] = []
    whole_nodes: set[int] = set()
    fanout: defaultdict[int, int] = defaultdict(int)
    depth: dict[int, int] = {}
    for record in records:
        path, node = [], -1
        for position, block in enumerate(record.hash_ids):
            node = nodes.setdefault((node, block), len(nodes))
            depth[node] = position + 1
            path.append(node)
        paths.append(path)
        for position in range(_whole_blocks(record, block_size)):
            if path[position] not in whole_nodes:
                whole_nodes.add(path[position])
                fanout[path[position - 1] if position else -1] += 1

    parent: list[int | None] = []
    last_ending: dict[int, int] = {}  # node -> latest request whose whole blocks end there
    for index, (record, path) in enumerate(zip(records, paths, strict=True)):
        found = None
        for node in reversed(path):
            if fanout.get(node, 0) >= shared_fanout:
                break
            if node in last_ending:
                found = last_ending[node]
                break
        parent.append(found)
        if blocks := _whole_blocks(record, block_size):
            last_ending[path[blocks - 1]] = index
    shared = sorted(
        (depth[node], count)
        for node, count in fanout.items()
        if node >= 0 and count >= shared_fanout
    )
    return Reconstruction(parent, shared)


def _whole_blocks(record: TraceRecord, block_size: int) -> int:
    return min(len(record.hash_ids), record.input_length // block_size)
