"""Conversations in vLLM's multi-turn benchmark format (ShareGPT-style JSON), with times
assigned by the generator's arrival and think-time model.

Accepted: a JSON array, or JSON lines, of conversations
`{"id" | "conversation_id": ..., "messages": [{"role", "content"}]}` (vLLM
`benchmarks/multi_turn`, OpenAI roles) or `{"id", "conversations": [{"from", "value"}]}`
(ShareGPT: human/gpt/...). Leading system messages become the session's system prompt; leading
assistant messages are dropped (ShareGPT splits long chats into parts that start with one);
consecutive messages of one role are joined; later system messages are ignored. A turn is a
user message and the answer after it; a final unanswered message gets the generator's mean
answer length.

The files have no times. Conversations start as the generator's sessions do (Gamma gaps at
`session_rate`, cv `arrival_cv`), and each next turn arrives after the previous answer
(`output_tokens / decode_tok_s`) plus a think time from the follow-up/pause mixture. Turn
counts come from the data, so abandonment is not drawn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import KvtierError
from kvtier.workload.config import GeneratorConfig
from kvtier.workload.generator import next_arrival, session_starts, think_time
from kvtier.workload.jsonl import BadRecord, check_some, parse_lines, read_text, warn_skipped
from kvtier.workload.model import Session, Turn, Workload
from kvtier.workload.presets import preset_config
from kvtier.workload.text import LengthFn, approx_tokens

_ROLES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}


def parse_conversation(obj: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    """(conversation id, [(role, text)]) with roles normalized and same-role runs joined."""
    conv_id = obj.get("id", obj.get("conversation_id"))
    if conv_id is None:
        raise BadRecord("missing field 'id' (or 'conversation_id')")
    raw = obj.get("messages", obj.get("conversations"))
    if not isinstance(raw, list):
        raise BadRecord(f"conversation {conv_id!r}: needs a 'messages' or 'conversations' list")
    messages: list[tuple[str, str]] = []
    for position, message in enumerate(raw):
        if not isinstance(message, dict):
            raise BadRecord(f"conversation {conv_id!r}: message {position} is not an object")
        who = message.get("role", message.get("from"))
        text = message.get("content", message.get("value"))
        role = _ROLES.get(str(who).lower())
        if role is None:
            raise BadRecord(f"conversation {conv_id!r}: message {position} has role {who!r}")
        if not isinstance(text, str):
            raise BadRecord(f"conversation {conv_id!r}: message {position} has no text")
        if role == "system" and any(kind != "system" for kind, _ in messages):
            continue  # a mid-chat instruction: apps fold it into history; too rare to model
        if messages and messages[-1][0] == role:
            messages[-1] = (role, f"{messages[-1][1]}\n{text}")
        else:
            messages.append((role, text))
    if not any(role == "user" for role, _ in messages):
        raise BadRecord(f"conversation {conv_id!r}: no user message")
    return str(conv_id), messages


def load_sharegpt(
    path: str | Path,
    *,
    config: GeneratorConfig | None = None,
    seed: int = 0,
    length: LengthFn = approx_tokens,
) -> Workload:
    """`config` supplies the timing model (default: the `default` preset)."""
    config = config or preset_config("default")
    text = read_text(path)
    if text.lstrip().startswith("["):
        conversations, errors = _parse_array(path, text)
    else:
        parsed, errors = parse_lines(path, text, parse_conversation)
        conversations = [conversation for _, conversation in parsed]
    warn_skipped(path, errors)
    rng = np.random.default_rng(seed)
    seen: dict[str, int] = {}
    for index, (conv_id, messages) in enumerate(conversations):
        seen[conv_id] = seen.get(conv_id, 0) + 1
        if seen[conv_id] > 1:  # session ids must be unique; ShareGPT dumps repeat some
            conversations[index] = (f"{conv_id}#{seen[conv_id]}", messages)
    starts = session_starts(rng, len(conversations), config.session_rate, config.arrival_cv)
    sessions = [
        _session(conv_id, messages, float(start), rng, config, length)
        for (conv_id, messages), start in zip(conversations, starts, strict=True)
    ]
    workload = Workload(
        sessions=sessions,
        source=f"sharegpt {path}",
        block_size=config.block_size,
        errors=errors,
    )
    workload.notes.append(
        f"arrival times drawn by the generator's model (seed {seed}): sessions at "
        f"{config.session_rate:g}/s, think times {config.followup_share:.0%} follow-ups of "
        f"median {config.followup_median_s:g} s, else pauses of median {config.pause_median_s:g} s"
    )
    return workload


def _parse_array(
    path: str | Path, text: str
) -> tuple[list[tuple[str, list[tuple[str, str]]]], list[str]]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KvtierError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    conversations, errors = [], []
    for number, item in enumerate(items, start=1):
        try:
            if not isinstance(item, dict):
                raise BadRecord(f"expected a JSON object, got {type(item).__name__}")
            conversations.append(parse_conversation(item))
        except BadRecord as exc:
            errors.append(f"item {number}: {exc}")
    check_some(path, len(conversations), errors)
    return conversations, errors


def _session(
    conv_id: str,
    messages: list[tuple[str, str]],
    start: float,
    rng: np.random.Generator,
    config: GeneratorConfig,
    length: LengthFn,
) -> Session:
    system = []
    while messages[0][0] != "user":
        role, text = messages.pop(0)
        if role == "system":
            system.append(text)
    system_prompt = "\n".join(system)
    turns: list[Turn] = []
    for position, (role, text) in enumerate(messages):
        if role != "user":
            continue
        following = messages[position + 1] if position + 1 < len(messages) else None
        answer = following[1] if following and following[0] == "assistant" else ""
        output_tokens = length(answer) if answer else round(config.answer_tokens.mean)
        think = think_time(rng, config) if turns else None
        arrival = next_arrival(turns[-1], think, config.decode_tok_s) if turns else start
        turns.append(
            Turn(
                arrival_s=arrival,
                user_tokens=length(text),
                output_tokens=output_tokens,
                user_text=text,
                answer_text=answer,
                think_s=think,
            )
        )
    return Session(
        session_id=conv_id,
        turns=turns,
        system_prompt=system_prompt,
        system_tokens=length(system_prompt) if system_prompt else 0,
    )
