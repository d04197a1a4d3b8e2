"""The sessions a short replay keeps (`kvtier bench --sessions N`).

A benchmark compares what policies do with a paused session's KV, so the sessions worth
replaying are those that come back after a pause. Taking the first N of a trace often keeps
only single-turn sessions (most of Mooncake's first minutes): nothing is resumed, and every
policy looks the same. So sessions are ranked, trace order breaking ties, and the N best kept:
sessions with a resumed turn first, then other multi-turn sessions, then single turns.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

from kvtier.errors import KvtierError
from kvtier.workload.model import Session, Workload

# answer speed that places a turn's end where the workload has no think times: the one
# `kvtier analyze` assumes by default (docs/workloads.md, "gap")
DECODE_TOK_S = 50.0


def resumed_turns(session: Session, resume_after_s: float) -> int:
    """Turns that come back after an idle gap longer than `resume_after_s`: the user's think
    time when the workload knows it, else arrival minus the previous turn's estimated end."""
    count = 0
    for before, turn in pairwise(session.turns):
        if turn.think_s is not None:
            gap = turn.think_s
        else:
            gap = turn.arrival_s - before.arrival_s - before.output_tokens / DECODE_TOK_S
        count += gap > resume_after_s
    return count


def keep_sessions(workload: Workload, count: int, resume_after_s: float) -> Workload:
    """`count` sessions, ranked as the module says, in their trace order; a note says what was
    kept."""
    if count < 1:
        raise KvtierError(f"--sessions must be at least 1, not {count}")
    sessions = workload.sessions
    if count >= len(sessions):
        return workload
    resumed = [resumed_turns(s, resume_after_s) for s in sessions]

    def rank(index: int) -> tuple[int, int]:
        if resumed[index]:
            return 0, index
        return (1 if len(sessions[index].turns) > 1 else 2), index

    kept = sorted(sorted(range(len(sessions)), key=rank)[:count])
    with_resumed = sum(1 for i in kept if resumed[i])
    note = (
        f"kept {count:,} of {len(sessions):,} sessions, those with resumed turns first "
        f"({with_resumed:,} have one; resumed = gap > {resume_after_s:g} s)"
    )
    return replace(workload, sessions=[sessions[i] for i in kept], notes=[*workload.notes, note])
