"""Task generators: seeded, fitted to the target length, answers really in the text."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest

from kvtier.errors import KvtierError
from kvtier.eval.sample import read_jsonl, render_prompt, write_jsonl
from kvtier.eval.tasks import TASKS, generate_sample, generate_samples
from kvtier.eval.word_extraction import CWE_FREQ_COMMON, CWE_FREQ_UNCOMMON

NEEDLE_TASKS = [
    "niah_single",
    "niah_single_noise",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "passkey",
    "vt",
]


@pytest.mark.parametrize("length", [1024, 4096, 8192])
@pytest.mark.parametrize("task", list(TASKS))
def test_prompt_fits_the_target_length(tokenizer, task, length):
    sample = generate_sample(tokenizer, task, length, index=0, seed=0)
    total = sample.num_prompt_tokens + sample.max_tokens
    assert total <= length  # the answer budget is reserved out of the target
    assert total >= 0.95 * length, f"{task} at {length}: only {total} tokens"
    # The stored ids are exactly the rendered prompt.
    assert sample.prompt_token_ids == render_prompt(
        tokenizer, sample.context, sample.question, sample.answer_prefix
    )


@pytest.mark.parametrize("task", NEEDLE_TASKS)
def test_needle_answers_are_in_the_context(tokenizer, task):
    for index in range(3):
        sample = generate_sample(tokenizer, task, 1024, index, seed=5)
        for answer in sample.answers:
            assert answer in sample.context, f"{sample.sample_id}: {answer!r} not in the text"
        for needle in sample.details["needles"]:
            assert needle in sample.context


def test_question_comes_last_in_the_chat_prompt(tokenizer):
    sample = generate_sample(tokenizer, "niah_multikey", 2048, 0, seed=1)
    text = tokenizer.decode(sample.prompt_token_ids)
    assert text.endswith("<|im_start|>assistant\n" + sample.answer_prefix)
    question_at = text.rindex(sample.question.strip())
    assert question_at > text.rindex(sample.details["needles"][-1])
    # Multi-key: one key is asked, the other needles are distractors with other values.
    assert len(sample.details["needles"]) == 4
    assert len(sample.answers) == 1


def test_needles_sit_at_their_depths(tokenizer):
    sample = generate_sample(tokenizer, "niah_single", 4096, 0, seed=3)
    (depth,) = sample.details["depths"]
    where = sample.context.index(sample.details["needles"][0]) / len(sample.context)
    assert abs(where - depth) < 0.05


def test_variable_chain_is_in_reading_order(tokenizer):
    sample = generate_sample(tokenizer, "vt", 2048, 0, seed=2)
    names = sample.answers
    value = re.search(r"VAR \w+ = (\d+)\.", sample.context).group(1)
    assert f"VAR {names[0]} = {value}." in sample.context
    positions = [sample.context.index(f"VAR {b} = VAR {a}.") for a, b in itertools.pairwise(names)]
    assert positions == sorted(positions)
    assert value in sample.question


def test_common_words_are_the_most_common(tokenizer):
    sample = generate_sample(tokenizer, "cwe", 2048, 0, seed=4)
    listing = re.findall(r"\d+\. ([a-z]+)", sample.context)
    counts = Counter(listing)
    assert all(counts[w] == CWE_FREQ_COMMON for w in sample.answers)
    others = [c for w, c in counts.items() if w not in sample.answers]
    assert others and max(others) == CWE_FREQ_UNCOMMON


def test_frequent_words_are_the_most_frequent(tokenizer):
    sample = generate_sample(tokenizer, "fwe", 2048, 0, seed=4)
    body = sample.context.split("\n", 1)[1]
    ranked = Counter(body.split()).most_common(4)
    assert [w for w, _ in ranked[:3]] == sample.answers
    assert ranked[2][1] > ranked[3][1]  # no tie at the cut


def test_samples_are_seeded(tokenizer):
    a = generate_samples(tokenizer, ["niah_single", "cwe"], [1024], 2, seed=9)
    b = generate_samples(tokenizer, ["niah_single", "cwe"], [1024], 2, seed=9)
    c = generate_samples(tokenizer, ["niah_single", "cwe"], [1024], 2, seed=10)
    assert [s.prompt_token_ids for s in a] == [s.prompt_token_ids for s in b]
    assert [s.answers for s in a] != [s.answers for s in c]
    assert a[0].answers != a[1].answers  # samples of one task differ


def test_samples_round_trip_through_jsonl(tokenizer, tmp_path):
    samples = generate_samples(tokenizer, ["passkey", "fwe"], [1024], 1, seed=0)
    path = write_jsonl(samples, tmp_path / "samples.jsonl")
    assert read_jsonl(path) == samples


def test_bad_requests_are_clear_errors(tokenizer):
    with pytest.raises(KvtierError, match="unknown task"):
        generate_samples(tokenizer, ["niah_sngle"], [1024], 1, seed=0)
    with pytest.raises(KvtierError, match="too short"):
        generate_sample(tokenizer, "niah_multiquery", 100, 0, seed=0)
