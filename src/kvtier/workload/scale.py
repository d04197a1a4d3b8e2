"""Shrink a workload's lengths so that it fits a small model's context.

Production traces hold prompts of 100K+ tokens; a benchmark on a model with an 8K context can
still replay their shape (who returns when, how history grows, what is shared) if every length
is multiplied by one factor. Hash ids are kept, so each now covers `block_size x factor`
tokens (`Workload.length_scale` records the factor). Text is cut to the same share of its
words, at least one word per message, so with tiny factors prompts may overshoot by a few
tokens.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvtier.errors import KvtierError
from kvtier.workload.model import Session, Workload, flatten


def scale_to_context(workload: Workload, context_tokens: int) -> Workload:
    """A copy in which the longest prompt plus its answer fits `context_tokens` (lengths are
    only ever shrunk); the factor is in `length_scale` and in a note."""
    if context_tokens < 2:
        raise KvtierError(f"context to scale to must be at least 2 tokens, not {context_tokens}")
    longest = max(r.prompt_tokens + r.output_tokens for r in flatten(workload))
    if longest <= context_tokens:
        note = f"longest prompt + answer ({longest:,} tokens) already fits {context_tokens:,}"
        return replace(workload, notes=[*workload.notes, note])
    factor = context_tokens / longest
    note = (
        f"lengths scaled by {factor:.4g} so the longest prompt + answer ({longest:,} tokens) "
        f"fits {context_tokens:,}"
    )
    return scale_lengths(workload, factor, note)


def scale_lengths(workload: Workload, factor: float, note: str) -> Workload:
    """A copy with every length multiplied by `factor` (< 1), as `scale_to_context` does; a
    replay of another run's scaled workload gives that run's factor."""
    sessions = [_scaled_session(session, factor) for session in workload.sessions]
    return replace(
        workload,
        sessions=sessions,
        length_scale=workload.length_scale * factor,
        max_history_tokens=_maybe_scaled(workload.max_history_tokens, factor, minimum=1),
        notes=[*workload.notes, note],
    )


def _scaled_session(session: Session, factor: float) -> Session:
    turns = [
        replace(
            turn,
            user_tokens=_scaled(turn.user_tokens, factor, minimum=1 if turn.user_text else 0),
            output_tokens=_scaled(turn.output_tokens, factor, minimum=1),
            user_text=_cut(turn.user_text, factor),
            answer_text=_cut(turn.answer_text, factor),
            prompt_tokens=_maybe_scaled(turn.prompt_tokens, factor, minimum=1),
        )
        for turn in session.turns
    ]
    return replace(
        session,
        turns=turns,
        system_prompt=_cut(session.system_prompt, factor),
        system_tokens=_scaled(session.system_tokens, factor),
    )


def _scaled(tokens: int, factor: float, minimum: int = 0) -> int:
    # floor keeps every scaled prompt + answer within the target
    return max(minimum, math.floor(tokens * factor))


def _maybe_scaled(tokens: int | None, factor: float, minimum: int) -> int | None:
    return None if tokens is None else _scaled(tokens, factor, minimum)


def _cut(text: str, factor: float) -> str:
    words = text.split()
    return " ".join(words[: max(1, math.floor(len(words) * factor))]) if words else text
