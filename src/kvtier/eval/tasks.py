"""The task registry and the seeded generator that fits each sample to a token length.

Every sample is a pure function of (task, length, index, seed) and the tokenizer: the same
command line gives the same prompts anywhere, with no downloads.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import KvtierError
from kvtier.eval.niah import make_niah, make_passkey
from kvtier.eval.sample import Builder, Sample, fit_to_length, render_prompt, split_prompt
from kvtier.eval.variable_tracking import make_variable_tracking
from kvtier.eval.word_extraction import make_common_words, make_frequent_words


@dataclass(frozen=True)
class TaskSpec:
    name: str
    description: str
    # rng -> builder (and the filler cap where the filler is finite)
    make: Callable[[np.random.Generator], Builder | tuple[Builder, int]]
    max_tokens: int  # answer budget, also reserved out of the target length
    tokens_per_unit: float  # rough tokens per filler unit: first bound of the length search
    metric: str = "all"


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec(
            "niah_single",
            "one needle in real prose",
            lambda rng: make_niah(rng, "prose"),
            16,
            25,
        ),
        TaskSpec(
            "niah_single_noise",
            "one needle in repeated noise sentences",
            lambda rng: make_niah(rng, "noise"),
            16,
            5,
        ),
        TaskSpec(
            "niah_multikey",
            "four needles with different keys in prose; one is asked",
            lambda rng: make_niah(rng, "prose", num_keys=4),
            16,
            25,
        ),
        TaskSpec(
            "niah_multivalue",
            "four values for the same key in prose; all are asked",
            lambda rng: make_niah(rng, "prose", num_values=4),
            48,
            25,
        ),
        TaskSpec(
            "niah_multiquery",
            "four keys in prose, all asked at once",
            lambda rng: make_niah(rng, "prose", num_keys=4, num_queries=4),
            48,
            25,
        ),
        TaskSpec(
            "passkey",
            "a 5-digit pass key in repeated noise sentences",
            make_passkey,
            12,
            5,
        ),
        TaskSpec(
            "vt",
            "variable tracking: a chain of 4 assignments in noise; name all 5 variables",
            make_variable_tracking,
            32,
            5,
        ),
        TaskSpec(
            "cwe",
            "common-word extraction: the 10 most common words of a numbered list",
            make_common_words,
            48,
            15,
        ),
        TaskSpec(
            "fwe",
            "frequent-word extraction: the 3 most frequent words of a Zipf-distributed text",
            make_frequent_words,
            24,
            3,
        ),
    )
}


def check_tasks(names: Sequence[str]) -> list[str]:
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise KvtierError(
            f"unknown task(s) {', '.join(map(repr, unknown))}; known: {', '.join(TASKS)}"
        )
    if not names:
        raise KvtierError("give at least one task")
    return list(names)


def generate_sample(tokenizer: Any, task: str, length: int, index: int, seed: int) -> Sample:
    """One sample whose prompt plus answer budget fits `length` tokens (as tight as a filler
    unit allows: within a sentence or a list item of it)."""
    spec = TASKS[check_tasks([task])[0]]
    # crc32, not hash(): stable across processes, so seeds mean the same everywhere.
    rng = np.random.default_rng([seed, zlib.crc32(task.encode()), length, index])
    made = spec.make(rng)
    build, max_units = made if isinstance(made, tuple) else (made, None)
    budget = length - spec.max_tokens
    parts, token_ids = fit_to_length(tokenizer, build, budget, spec.tokens_per_unit, max_units)
    context, question, answer_prefix, answers, details = parts
    head, _ = split_prompt(tokenizer, context, question, answer_prefix)
    details = {**details, "num_context_tokens": len(head)}
    return Sample(
        task=task,
        length=length,
        index=index,
        seed=seed,
        context=context,
        question=question,
        answer_prefix=answer_prefix,
        answers=list(answers),
        metric=spec.metric,
        max_tokens=spec.max_tokens,
        prompt_token_ids=token_ids,
        details=details,
    )


def generate_samples(
    tokenizer: Any, tasks: Sequence[str], lengths: Sequence[int], num_samples: int, seed: int
) -> list[Sample]:
    check_tasks(tasks)
    if num_samples < 1:
        raise KvtierError(f"--samples must be >= 1, got {num_samples}")
    return [
        generate_sample(tokenizer, task, length, i, seed)
        for length in lengths
        for task in tasks
        for i in range(num_samples)
    ]


__all__ = ["TASKS", "Sample", "TaskSpec", "generate_sample", "generate_samples", "render_prompt"]
