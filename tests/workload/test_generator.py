"""The generator draws what its parameters say, reproducibly, in real words."""

from __future__ import annotations

import re
from itertools import pairwise

import numpy as np
import pytest

from kvtier.errors import KvtierError
from kvtier.workload.config import GeneratorConfig
from kvtier.workload.generator import generate
from kvtier.workload.model import flatten
from kvtier.workload.presets import PRESETS, preset_config
from kvtier.workload.text import approx_tokens, load_corpus

# many short sessions: statistics settle, text stays cheap
STATS = {
    "sessions": 3000,
    "session_rate": 0.5,
    "mean_turns": 4.0,
    "max_turns": 500,
    "followup_share": 0.7,
    "followup_median_s": 8.0,
    "followup_sigma": 0.3,
    "pause_median_s": 300.0,
    "pause_sigma": 0.3,
    "system_prompt_tokens": 20,
    "user_tokens": {"mean": 30, "cv": 0.5, "min_tokens": 1, "max_tokens": 1000},
    "answer_tokens": {"mean": 40, "cv": 0.5, "min_tokens": 1, "max_tokens": 1000},
}


@pytest.fixture(scope="module")
def stats_workload():
    return generate(GeneratorConfig.from_dict(STATS), seed=7)


def _words(text: str) -> set[str]:
    return {word.lower() for word in re.findall(r"[A-Za-z']+", text)}


def test_session_arrivals_follow_the_rate(stats_workload):
    starts = np.array([s.turns[0].arrival_s for s in stats_workload.sessions])
    assert starts[0] == 0.0
    gaps = np.diff(starts)
    assert 1 / gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # cv 1: Poisson


def test_bursty_arrivals_have_the_asked_cv():
    config = GeneratorConfig.from_dict({**STATS, "arrival_cv": 2.5, "mean_turns": 1.0})
    starts = np.array([s.turns[0].arrival_s for s in generate(config, seed=3).sessions])
    gaps = np.diff(starts)
    assert gaps.std() / gaps.mean() == pytest.approx(2.5, rel=0.15)
    assert 1 / gaps.mean() == pytest.approx(0.5, rel=0.15)


def test_turns_per_session_have_the_asked_mean(stats_workload):
    turns = np.array([len(s.turns) for s in stats_workload.sessions])
    assert turns.min() >= 1
    assert turns.mean() == pytest.approx(4.0, rel=0.05)
    # geometric: a share 1/mean of sessions ends after its first turn
    assert np.mean(turns == 1) == pytest.approx(0.25, abs=0.02)


def test_max_turns_caps_sessions():
    config = GeneratorConfig.from_dict({**STATS, "sessions": 200, "max_turns": 5})
    assert max(len(s.turns) for s in generate(config).sessions) == 5


def test_think_times_mix_followups_and_pauses(stats_workload):
    think = np.array([t.think_s for s in stats_workload.sessions for t in s.turns[1:]])
    assert len(think) > 5000
    quick = think[think < 60]
    assert len(quick) / len(think) == pytest.approx(0.7, abs=0.02)
    assert np.median(quick) == pytest.approx(8.0, rel=0.05)
    assert np.median(think[think >= 60]) == pytest.approx(300.0, rel=0.05)


def test_next_turn_arrives_after_the_answer_and_the_pause(stats_workload):
    for session in stats_workload.sessions[:200]:
        assert session.turns[0].think_s is None
        for before, after in pairwise(session.turns):
            expected = before.arrival_s + before.output_tokens / 50.0 + after.think_s
            assert after.arrival_s == pytest.approx(expected)


def test_message_and_answer_lengths_have_the_asked_means(stats_workload):
    turns = [t for s in stats_workload.sessions for t in s.turns]
    assert np.mean([t.user_tokens for t in turns]) == pytest.approx(30, rel=0.05)
    assert np.mean([t.output_tokens for t in turns]) == pytest.approx(40, rel=0.05)
    # the recorded lengths are the length function's measure of the text
    assert all(t.user_tokens == approx_tokens(t.user_text) for t in turns[:500])


def test_same_seed_same_workload_other_seed_other_workload():
    def fingerprint(workload):
        return [
            (r.arrival_s, r.prompt_tokens, r.messages[-1]["content"]) for r in flatten(workload)
        ]

    assert fingerprint(generate("quick", seed=1)) == fingerprint(generate("quick", seed=1))
    assert fingerprint(generate("quick", seed=1)) != fingerprint(generate("quick", seed=2))


def test_text_is_real_words_from_the_corpus():
    vocabulary = _words(" ".join(load_corpus().words))
    assert len(load_corpus().words) > 3000
    workload = generate("quick", seed=5)
    texts = [s.system_prompt for s in workload.sessions]
    texts += [t.user_text for s in workload.sessions for t in s.turns]
    texts += [t.answer_text for s in workload.sessions for t in s.turns]
    used = set().union(*(_words(text) for text in texts))
    assert len(used) > 300
    assert used <= vocabulary
    assert "netherfield" in vocabulary and "timetable" in vocabulary


def test_a_tokenizer_length_function_is_used_for_lengths():
    # characters as "tokens": the generator must correct its words-based first guess
    workload = generate(preset_config("quick", sessions=5), seed=0, length=len)
    turns = [t for s in workload.sessions for t in s.turns]
    assert all(t.user_tokens == len(t.user_text) for t in turns)
    # the targets are in the length function's units: 48 characters, not 48 x 1.3 words
    assert np.mean([t.output_tokens for t in turns]) == pytest.approx(48, rel=0.15)


def test_quick_preset_fits_a_small_model():
    requests = flatten(generate("quick", seed=0))
    assert 20 <= len({r.session_id for r in requests}) <= 50
    assert max(r.prompt_tokens + r.output_tokens for r in requests) <= 3072
    assert all(31 <= r.output_tokens <= 65 for r in requests)


def test_default_preset_mixes_short_and_long_and_resumes():
    workload = generate("default", seed=0)
    firsts = np.array([s.turns[0].user_tokens for s in workload.sessions])
    assert 0.2 < np.mean(firsts > 1000) < 0.4  # sessions opening with a document
    think = np.array([t.think_s for s in workload.sessions for t in s.turns[1:]])
    assert 0.3 < np.mean(think > 60) < 0.5  # pauses of minutes
    assert len({s.app_class for s in workload.sessions}) == 4
    assert len({s.tenant for s in workload.sessions}) == 3


def test_sessions_of_one_app_share_its_system_prompt():
    workload = generate("default", seed=0)
    prompts = {}
    for session in workload.sessions:
        prompts.setdefault(session.app_class, set()).add(session.system_prompt)
    assert all(len(texts) == 1 for texts in prompts.values())
    assert len({text for texts in prompts.values() for text in texts}) == 4


def test_bad_config_gives_one_clear_error():
    with pytest.raises(KvtierError, match="mean_turns"):
        GeneratorConfig.from_dict({**STATS, "mean_turns": 0.5})
    with pytest.raises(KvtierError, match=r"user_tokens.*min_tokens <= mean"):
        GeneratorConfig.from_dict({**STATS, "user_tokens": {"mean": 5, "cv": 1, "max_tokens": 4}})
    with pytest.raises(KvtierError, match="document_tokens"):
        GeneratorConfig.from_dict({**STATS, "document_share": 0.5})
    with pytest.raises(KvtierError, match="sessoins"):
        GeneratorConfig.from_dict({**STATS, "sessoins": 3})
    with pytest.raises(KvtierError, match="unknown workload preset 'huge'"):
        preset_config("huge")


def test_presets_are_valid_and_overridable():
    for name in PRESETS:
        assert preset_config(name).sessions == PRESETS[name]["sessions"]
    assert preset_config("quick", sessions=3).sessions == 3


def test_app_classes_return_as_their_class_does():
    workload = generate("multiclass", seed=3)
    gaps: dict[str, list[float]] = {}
    turns: dict[str, list[int]] = {}
    prompts: dict[str, set[str]] = {}
    for session in workload.sessions:
        turns.setdefault(session.app_class, []).append(len(session.turns))
        prompts.setdefault(session.app_class, set()).add(session.system_prompt)
        for turn in session.turns[1:]:
            gaps.setdefault(session.app_class, []).append(turn.think_s)
    assert set(turns) == {"agent", "chat", "docqa"}
    median = {name: float(np.median(values)) for name, values in gaps.items()}
    assert median["agent"] < 10 < median["docqa"] and median["chat"] > 60
    assert np.mean(turns["agent"]) > 2 * np.mean(turns["chat"])
    # every class shares one system prompt; document Q&A's is the long shared document
    assert all(len(texts) == 1 for texts in prompts.values())
    tokens = {s.app_class: s.system_tokens for s in workload.sessions}
    assert tokens["docqa"] > 3 * tokens["chat"]


def test_a_class_cannot_change_the_population():
    with pytest.raises(KvtierError, match="population fields"):
        preset_config("multiclass", classes={"a": {"share": 1.0, "set": {"sessions": 5}}})
    with pytest.raises(KvtierError, match="mean_turns"):
        preset_config("multiclass", classes={"a": {"share": 1.0, "set": {"mean_turns": 0}}})
