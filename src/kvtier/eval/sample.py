"""One evaluation sample, how its prompt is rendered, and how it is fitted to a token length.

The prompt is the model's chat template around `context + question`, followed by the start
of the assistant's answer (`answer_prefix`, as RULER does), so even a small model answers in
a checkable form. The same three strings are exported for kvpress, whose pipeline renders
context, question and answer prefix the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError


@dataclass
class Sample:
    task: str
    length: int  # the target length in tokens (prompt + answer budget), e.g. 4096
    index: int  # sample number within (task, length)
    seed: int
    context: str  # the long document: haystack with needles, variable chain, word list
    question: str  # appended to the context in the same user message
    answer_prefix: str  # the assistant's answer starts with this
    answers: list[str]  # every string a correct answer contains
    metric: str  # "all" or "part" (scoring.METRICS)
    max_tokens: int  # generation budget
    prompt_token_ids: list[int] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)  # depths, haystack kind ...

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def sample_id(self) -> str:
        return f"{self.task}/{self.length}/{self.index}"


def render_prompt(tokenizer: Any, context: str, question: str, answer_prefix: str) -> list[int]:
    """Token ids of the chat prompt: user message `context + question`, then the answer start."""
    head, tail = split_prompt(tokenizer, context, question, answer_prefix)
    return head + tail


def split_prompt(
    tokenizer: Any, context: str, question: str, answer_prefix: str
) -> tuple[list[int], list[int]]:
    """The prompt's ids in two parts: template head + document, then question + answer start.

    The parts are encoded apart (no token straddles the boundary), as kvpress's pipeline
    does, so its run of the same strings sees the same ids, and the first part is exactly
    what a query-agnostic pipeline compresses before it sees the question.
    """
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": context + question}],
        tokenize=False,
        add_generation_prompt=True,
    )
    cut = text.index(context + question) + len(context)
    head = tokenizer.encode(text[:cut], add_special_tokens=False)
    return head, tokenizer.encode(text[cut:] + answer_prefix, add_special_tokens=False)


# A task builder: number of filler units -> (context, question, answer_prefix, answers, details)
Builder = Callable[[int], tuple[str, str, str, list[str], dict[str, Any]]]


def fit_to_length(
    tokenizer: Any, build: Builder, budget: int, unit_hint: float, max_units: int | None = None
) -> tuple:
    """The build with the most filler whose prompt stays within `budget` tokens.

    Binary search on the filler count: token counts grow with it (more sentences, more
    tokens). `unit_hint` (tokens per filler unit) only sets the first upper bound;
    `max_units` caps the count where the filler is finite (distinct words).
    Returns (built parts, prompt token ids).
    """

    def measure(n: int) -> tuple[tuple, list[int]]:
        parts = build(n)
        return parts, render_prompt(tokenizer, parts[0], parts[1], parts[2])

    shortest = len(measure(0)[1])
    if shortest > budget:
        raise KvtierError(
            f"a target of {budget} prompt tokens is too short: the task needs {shortest} "
            "tokens without any filler; use a longer --lengths value"
        )
    low, high = 0, max(2, int(budget / max(unit_hint, 0.1)) * 2)
    if max_units is not None:
        high = min(high, max_units)
        if len(measure(high)[1]) <= budget:
            return measure(high)  # all the filler there is fits
    while len(measure(high)[1]) <= budget:  # the hint was too small: widen
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        if len(measure(mid)[1]) <= budget:
            low = mid
        else:
            high = mid
    return measure(low)


def write_jsonl(samples: Iterable[Sample], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps(asdict(sample)) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[Sample]:
    path = Path(path)
    if not path.is_file():
        raise KvtierError(f"samples file {path} does not exist")
    try:
        return [Sample(**json.loads(line)) for line in path.read_text().splitlines() if line]
    except (ValueError, TypeError) as exc:
        raise KvtierError(f"{path} is not a samples file written by kvtier eval: {exc}") from exc
