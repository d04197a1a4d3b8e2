"""The in-memory workload: sessions of turns, and the time-ordered requests they flatten to.

A `Turn` holds only what is new in it: the user's message and the expected answer length. The
prompt a server sees is rebuilt by `flatten()`: system prompt + every earlier user message and
answer + the new message, as chat apps resend it each turn, optionally with the oldest turns
dropped to fit a history budget. Traces that record lengths but no text carry the whole prompt
length (`prompt_tokens`) and its prefix block ids (`hash_ids`) instead.

Times are trace seconds from the workload's start; lengths are tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.session_hints import NO_HINTS, EndKind, SessionHints
from kvtier.workload.blocks import BlockHasher, Segment, common_full_blocks, content_key


@dataclass
class Turn:
    arrival_s: float
    user_tokens: int  # the new message (for length-only traces: prompt growth since last turn)
    output_tokens: int  # expected answer length
    user_text: str = ""  # empty for length-only traces
    answer_text: str = ""  # the expected answer, resent as history in later turns
    prompt_tokens: int | None = None  # whole prompt as a trace recorded it; None: rebuilt
    hash_ids: tuple[int, ...] = ()  # the trace's prefix block ids (Workload.block_size tokens)
    think_s: float | None = None  # user's pause after the previous answer, when known
    end: EndKind | None = None  # how the reply ends: "tool_call" (its tool runs, then the
    tool: str | None = None  # agent returns with the result), "answer", "length"; None: unknown
    hints: SessionHints = NO_HINTS  # what the client sends about the session with this turn


@dataclass
class Session:
    session_id: str
    turns: list[Turn]
    tenant: str = "default"
    app_class: str = "chat"
    system_prompt: str = ""
    system_tokens: int = 0


@dataclass
class Workload:
    sessions: list[Session]
    source: str  # e.g. "generator preset=quick seed=0", "mooncake trace.jsonl"
    block_size: int = 16  # tokens per hash id: the trace's own, or used to derive ids from text
    length_scale: float = 1.0  # factor every length was multiplied by (scale_to_context)
    max_history_tokens: int | None = None  # history budget flatten() applies by default
    notes: list[str] = field(default_factory=list)  # how it was built or reconstructed
    errors: list[str] = field(default_factory=list)  # input lines skipped, with line numbers

    @property
    def num_turns(self) -> int:
        return sum(len(session.turns) for session in self.sessions)


@dataclass
class Request:
    """One turn as a server receives it."""

    request_id: str  # "<session_id>/<turn_index>"
    session_id: str
    turn_index: int  # 0 = the session's first turn
    arrival_s: float
    tenant: str
    app_class: str
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]  # prefix block ids of the prompt
    block_tokens: float  # tokens each hash id covers (the last block may be partial)
    messages: list[dict[str, str]]  # OpenAI chat messages; empty for length-only traces
    think_s: float | None
    end: EndKind | None = None  # how its reply ends (Turn.end), and the tool it calls
    tool: str | None = None
    hints: SessionHints = NO_HINTS


def flatten(workload: Workload, max_history_tokens: int | None = None) -> list[Request]:
    """Every turn as a request, ordered by arrival (ties keep session, then turn order).

    `max_history_tokens` (default: the workload's) drops the oldest earlier turns, whole
    user/answer pairs, until the resent history fits; the system prompt and the new message are
    always kept. Turns with a recorded prompt length are taken as recorded."""
    limit = workload.max_history_tokens if max_history_tokens is None else max_history_tokens
    hasher = BlockHasher(workload.block_size)
    recorded_block_tokens = workload.block_size * workload.length_scale
    requests = []
    for session in workload.sessions:
        requests.extend(_session_requests(session, limit, hasher, recorded_block_tokens))
    requests.sort(key=lambda request: request.arrival_s)
    return requests


def _session_requests(
    session: Session, limit: int | None, hasher: BlockHasher, recorded_block_tokens: float
) -> list[Request]:
    turns = session.turns
    system: list[Segment] = []
    if session.system_tokens:
        system = [(content_key("system", session.system_prompt), session.system_tokens)]
    # text messages are keyed by content, so equal texts behind equal prefixes share blocks
    user_keys = [_key(session, k, "user", turn.user_text) for k, turn in enumerate(turns)]
    answer_keys = [_key(session, k, "assistant", turn.answer_text) for k, turn in enumerate(turns)]
    previous: tuple[list[Segment], tuple[int, ...]] = ([], ())
    requests = []
    for k, turn in enumerate(turns):
        messages: list[dict[str, str]] = []
        if turn.prompt_tokens is not None:
            prompt_tokens, hash_ids = turn.prompt_tokens, turn.hash_ids
            block_tokens = recorded_block_tokens
        else:
            first = _history_start(turns, k, limit)
            segments = list(system)
            for j in range(first, k):
                segments.append((user_keys[j], turns[j].user_tokens))
                segments.append((answer_keys[j], turns[j].output_tokens))
            segments.append((user_keys[k], turn.user_tokens))
            known = previous[1][: common_full_blocks(previous[0], segments, hasher.block_size)]
            hash_ids = hasher.block_ids(segments, known)
            previous = (segments, hash_ids)
            prompt_tokens = sum(tokens for _, tokens in segments)
            block_tokens = hasher.block_size
            if turn.user_text:
                messages = _messages(session, first, k)
        requests.append(
            Request(
                request_id=f"{session.session_id}/{k}",
                session_id=session.session_id,
                turn_index=k,
                arrival_s=turn.arrival_s,
                tenant=session.tenant,
                app_class=session.app_class,
                prompt_tokens=prompt_tokens,
                output_tokens=turn.output_tokens,
                hash_ids=hash_ids,
                block_tokens=block_tokens,
                messages=messages,
                think_s=turn.think_s,
                end=turn.end,
                tool=turn.tool,
                hints=turn.hints,
            )
        )
    return requests


def _key(session: Session, index: int, role: str, text: str) -> bytes:
    if text:
        return content_key(role, text)
    return content_key(session.session_id, str(index), role)


def _history_start(turns: list[Turn], k: int, limit: int | None) -> int:
    """Index of the oldest earlier turn resent with turn `k` under a history budget."""
    if limit is None:
        return 0
    first, used = k, 0
    while first > 0:
        cost = turns[first - 1].user_tokens + turns[first - 1].output_tokens
        if used + cost > limit:
            break
        used += cost
        first -= 1
    return first


def _messages(session: Session, first: int, k: int) -> list[dict[str, str]]:
    messages = []
    if session.system_prompt:
        messages.append({"role": "system", "content": session.system_prompt})
    for turn in session.turns[first:k]:
        messages.append({"role": "user", "content": turn.user_text})
        messages.append({"role": "assistant", "content": turn.answer_text})
    messages.append({"role": "user", "content": session.turns[k].user_text})
    return messages
