"""Agentic sessions in LLMServingSim's JSON-lines format (Cho et al., IISWC'24; the format of
casys-kaist/LLMServingSim `docs/workloads/jsonl-format.md`): chained LLM calls with the tool's
run time between them. Read by `load_agentic`, written by `write_agentic`.

One JSON object per line, a session: `session_id` (optional), `arrival_time_ns` (the first
call's arrival) and `sub_requests`, each `input_toks` (the whole prompt), `output_toks`,
`tool_duration_ns` (the wait after this call before the next is sent; default 0) and optional
`input_tok_ids` / `output_tok_ids`. A line without `sub_requests` is one request
(`input_toks`, `output_toks`, `arrival_time_ns`), read as a one-turn session: LLMServingSim
mixes both kinds in one file.

kvtier's extensions, which LLMServingSim's loader ignores: on a session `tenant`, `app_class`
and `system_toks` (the leading prompt tokens that are its app's system prompt, the same text
for every session of that app class); on a call `end` ("tool_call", "answer", "length", or
null: not known), `tool` (the tool it calls) and `kvtier_session` (session hints, the fields
`kvtier serve` reads from a request body).

The mapping. A call is a length-only `Turn`: its prompt as recorded, `user_tokens` how far it
grew past the previous prompt and answer, `think_s` the previous call's tool duration. Without
`end`, every call but the last ends in a call of `tool` (else of "tool": the format names no
tool) and the last in an answer. LLMServingSim sends a call its tool duration after the
previous one completes; on the trace clock that completion is placed as the generator places
it (the answer written at `decode_tok_s`), and the closed-loop replay sends it the tool
duration after the answer really ended.

Prefix block ids (`BLOCK_SIZE` tokens): from `input_tok_ids` where a call has them (equal
tokens, equal ids; `output_tok_ids` add nothing the next call's ids lack), else from the
loop's shape, as an agent resends it: each prompt is the previous prompt, its answer and the
new message, after the system prompt its app class shares. A prompt that grew less than the
answer keeps the previous prompt and what fits of the answer (it was not resent whole, e.g.
its reasoning dropped); one shorter than the previous prompt (its history compacted) keeps
the system prompt and starts the rest anew. LLMServingSim itself caches no prefix of a call
without ids.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError
from kvtier.session_hints import END_KINDS, NO_HINTS, EndKind, SessionHints
from kvtier.workload.blocks import BlockHasher, Segment, common_full_blocks, content_key
from kvtier.workload.config import GeneratorConfig
from kvtier.workload.generator import next_arrival
from kvtier.workload.jsonl import (
    BadRecord,
    id_list,
    number,
    parse_lines,
    read_text,
    warn_skipped,
    whole,
)
from kvtier.workload.model import Request, Session, Turn, Workload, flatten

BLOCK_SIZE = 16  # LLMServingSim's --block-size default, and the generator's
GENERIC_TOOL = "tool"
# when the previous call's answer ends, on the trace clock: the generator's answer speed
DECODE_TOK_S: float = GeneratorConfig.model_fields["decode_tok_s"].default
_NS = 1e9


@dataclass(frozen=True)
class Call:
    """One sub-request as the file has it."""

    input_toks: int
    output_toks: int
    tool_s: float  # tool_duration_ns, in seconds
    token_ids: tuple[int, ...] | None
    end_given: bool  # False: the format's meaning (a tool follows every call but the last)
    end: EndKind | None
    tool: str | None
    hints: SessionHints


@dataclass(frozen=True)
class SessionLine:
    session_id: str | None
    arrival_s: float
    calls: list[Call]
    tenant: str
    app_class: str
    system_toks: int


def parse_session(obj: dict[str, Any]) -> SessionLine:
    flat = "sub_requests" not in obj
    raw = [obj] if flat else obj["sub_requests"]
    if not isinstance(raw, list) or not raw:
        raise BadRecord("field 'sub_requests' must be a non-empty list")
    calls = []
    for k, item in enumerate(raw):
        try:
            calls.append(_call(item))
        except BadRecord as exc:
            raise BadRecord(str(exc) if flat else f"sub_requests[{k}]: {exc}") from None
    system_toks = whole(obj, "system_toks", 0) if "system_toks" in obj else 0
    if any(call.input_toks < system_toks for call in calls):
        raise BadRecord(f"system_toks {system_toks} exceeds a call's input_toks")
    session_id = obj.get("session_id")
    if session_id is not None and (isinstance(session_id, bool | list | dict) or session_id == ""):
        raise BadRecord(f"field 'session_id' must be an id (string or number), not {session_id!r}")
    return SessionLine(
        session_id=None if session_id is None else str(session_id),
        arrival_s=number(obj, "arrival_time_ns") / _NS,
        calls=calls,
        tenant=_name(obj, "tenant", "default"),
        app_class=_name(obj, "app_class", "chat" if flat else "agent"),
        system_toks=system_toks,
    )


def _call(item: Any) -> Call:
    if not isinstance(item, dict):
        raise BadRecord("expected an object")
    end = item.get("end")
    if end is not None and end not in END_KINDS:
        raise BadRecord(f"field 'end' must be one of {', '.join(END_KINDS)} or null, not {end!r}")
    tool = item.get("tool")
    if tool is not None and (not isinstance(tool, str) or not tool):
        raise BadRecord(f"field 'tool' must be a tool's name, not {tool!r}")
    tool_ns = number(item, "tool_duration_ns") if "tool_duration_ns" in item else 0.0
    return Call(
        input_toks=whole(item, "input_toks", 1),
        output_toks=whole(item, "output_toks", 0),
        tool_s=tool_ns / _NS,
        token_ids=id_list(item, "input_tok_ids") or None,
        end_given="end" in item,
        end=end,
        tool=tool,
        hints=_hints(item.get("kvtier_session")),
    )


def _name(obj: dict[str, Any], key: str, default: str) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str) or not value:
        raise BadRecord(f"field {key!r} must be a non-empty string, not {value!r}")
    return value


def _hints(given: Any) -> SessionHints:
    if given is None:
        return NO_HINTS
    if not isinstance(given, dict):
        raise BadRecord("field 'kvtier_session' must be an object of session hints")
    # every request path validates hints with the policy's rules (the range of each field)
    from kvtier.policy.config import parse_session_hints

    try:
        return parse_session_hints(given)
    except KvtierError as exc:
        raise BadRecord(f"field 'kvtier_session': {exc}") from None


def load_agentic(path: str | Path, *, block_size: int = BLOCK_SIZE) -> Workload:
    parsed, errors = parse_lines(path, read_text(path), parse_session)
    parsed.sort(key=lambda item: (item[1].arrival_s, item[0]))
    hasher = BlockHasher(block_size)
    stem = Path(path).stem
    seen: set[str] = set()
    sessions = []
    for number_, line in parsed:
        session_id = line.session_id or f"{stem}-{number_}"
        if session_id in seen:
            errors.append(f"line {number_}: session_id {session_id!r} repeats an earlier line's")
            continue
        seen.add(session_id)
        sessions.append(_session(session_id, line, hasher))
    workload = Workload(
        sessions=sessions, source=f"agentic {path}", block_size=block_size, errors=errors
    )
    warn_skipped(path, errors)
    workload.notes.append(
        f"each later call arrives after the previous answer (written at {DECODE_TOK_S:g} tok/s) "
        "and the tool's run time"
    )
    return workload


def _session(session_id: str, line: SessionLine, hasher: BlockHasher) -> Session:
    turns: list[Turn] = []
    last = len(line.calls) - 1
    for k, (call, hash_ids) in enumerate(
        zip(line.calls, _prompt_block_ids(session_id, line, hasher), strict=True)
    ):
        if k == 0:
            arrival, think, grown = line.arrival_s, None, call.input_toks - line.system_toks
        else:
            before = line.calls[k - 1]
            think = before.tool_s
            arrival = next_arrival(turns[-1], think, DECODE_TOK_S)
            grown = max(0, call.input_toks - before.input_toks - before.output_toks)
        end = call.end if call.end_given else ("answer" if k == last else "tool_call")
        turns.append(
            Turn(
                arrival_s=arrival,
                user_tokens=grown,
                output_tokens=call.output_toks,
                prompt_tokens=call.input_toks,
                hash_ids=hash_ids,
                think_s=think,
                end=end,
                tool=(call.tool or GENERIC_TOOL) if end == "tool_call" else None,
                hints=call.hints,
            )
        )
    return Session(
        session_id=session_id,
        turns=turns,
        tenant=line.tenant,
        app_class=line.app_class,
        system_tokens=line.system_toks,
    )


def _prompt_block_ids(
    session_id: str, line: SessionLine, hasher: BlockHasher
) -> Iterator[tuple[int, ...]]:
    """Each call's prompt block ids: from its token ids, else from the loop's shape."""
    system: list[Segment] = []
    if line.system_toks:
        key = content_key("system", line.app_class, str(line.system_toks))
        system = [(key, line.system_toks)]
    segments: list[Segment] | None = None  # the previous prompt's, when built from the shape
    previous: tuple[int, ...] = ()
    for k, call in enumerate(line.calls):
        if call.token_ids is not None:
            segments = None
            yield hasher.block_ids(_token_segments(call.token_ids, hasher.block_size))
            continue
        before = line.calls[k - 1] if k else None
        if segments is None or before is None or call.input_toks < before.input_toks:
            fresh = (content_key(session_id, str(k), "prompt"), call.input_toks - line.system_toks)
            now = [*system, fresh]
        else:
            # the answer resent whole; a prompt that grew less keeps what fits of it
            answer = min(before.output_toks, call.input_toks - before.input_toks)
            grown = call.input_toks - before.input_toks - answer
            now = [
                *segments,
                (content_key(session_id, str(k - 1), "answer"), answer),
                (content_key(session_id, str(k), "message"), grown),
            ]
        known = previous[: common_full_blocks(segments or [], now, hasher.block_size)]
        previous = hasher.block_ids(now, known)
        segments = now
        yield previous


def _token_segments(token_ids: Sequence[int], block_size: int) -> list[Segment]:
    """One segment per block of token ids, keyed by the block's tokens."""
    segments = []
    for start in range(0, len(token_ids), block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.blake2b(",".join(map(str, block)).encode(), digest_size=12)
        segments.append((digest.digest(), len(block)))
    return segments


def write_agentic(workload: Workload, path: str | Path) -> int:
    """Write `workload` in this format: lengths, no token ids (a generated workload has no
    tokenizer's ids), ends, tools and hints as kvtier's extensions. Returns sessions written."""
    by_session: dict[str, list[Request]] = {}
    for request in flatten(workload):
        by_session.setdefault(request.session_id, []).append(request)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for session in workload.sessions:
            requests = sorted(by_session[session.session_id], key=lambda r: r.turn_index)
            out.write(json.dumps(session_line(session, requests)) + "\n")
    return len(workload.sessions)


def session_line(session: Session, requests: Sequence[Request]) -> dict[str, Any]:
    """One session as a line (`requests`: its turns flattened, in order)."""
    line: dict[str, Any] = {
        "session_id": session.session_id,
        "arrival_time_ns": _ns(session.turns[0].arrival_s),
        "tenant": session.tenant,
        "app_class": session.app_class,
    }
    if session.system_tokens:
        line["system_toks"] = session.system_tokens
    calls = []
    for k, (turn, request) in enumerate(zip(session.turns, requests, strict=True)):
        follower = session.turns[k + 1] if k + 1 < len(session.turns) else None
        call: dict[str, Any] = {
            "input_toks": request.prompt_tokens,
            "output_toks": turn.output_tokens,
            "tool_duration_ns": _ns(_wait_after(turn, follower)),
            "end": turn.end,
        }
        if turn.tool is not None:
            call["tool"] = turn.tool
        if not turn.hints.empty:
            call["kvtier_session"] = turn.hints.given()
        calls.append(call)
    line["sub_requests"] = calls
    return line


def _wait_after(turn: Turn, follower: Turn | None) -> float:
    """The pause before the next turn: its think time, else its gap on the trace clock."""
    if follower is None:
        return 0.0
    if follower.think_s is not None:
        return follower.think_s
    return max(0.0, follower.arrival_s - next_arrival(turn, 0.0, DECODE_TOK_S))


def _ns(seconds: float) -> int:
    return round(seconds * _NS)
