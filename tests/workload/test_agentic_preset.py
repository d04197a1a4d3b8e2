"""The `agentic` presets: tool loops whose next turn waits for the tool, ends and tools on
every turn, hints only where asked, and presets without tools drawn as before."""

from __future__ import annotations

import math

import pytest

from kvtier.errors import KvtierError
from kvtier.workload.config import GeneratorConfig
from kvtier.workload.generator import generate
from kvtier.workload.presets import preset_config


def test_agent_turns_wait_for_their_tool_and_carry_its_result():
    config = preset_config("agentic", sessions=30)
    agent = config.of_class("agent")
    tools = agent.tools
    workload = generate(config, seed=3)
    calls = 0
    for session in workload.sessions:
        for turn, after in zip(session.turns, session.turns[1:], strict=False):
            assert turn.end in ("tool_call", "answer")
            if turn.end == "tool_call":
                calls += 1
                tool = tools[turn.tool]
                assert session.app_class == "agent"
                # the tool's result is the next message, within its length bounds
                assert tool.result_tokens.min_tokens <= after.user_tokens
                assert after.user_tokens <= tool.result_tokens.max_tokens * 1.1
                assert after.think_s is not None and after.think_s > 0
            else:
                assert turn.tool is None
        assert all(t.hints.empty for t in session.turns)  # no hints in `agentic`
        assert session.turns[-1].end in ("tool_call", "answer")
    assert calls > 100


def test_run_times_differ_by_tool_as_configured():
    workload = generate(preset_config("agentic", sessions=60), seed=1)
    runs: dict[str, list[float]] = {}
    for session in workload.sessions:
        for turn, after in zip(session.turns, session.turns[1:], strict=False):
            if turn.end == "tool_call":
                runs.setdefault(turn.tool, []).append(after.think_s)
    tools = preset_config("agentic").of_class("agent").tools
    for name, seconds in runs.items():
        if len(seconds) < 30:
            continue
        median = sorted(seconds)[len(seconds) // 2]
        assert abs(math.log(median / tools[name].duration_median_s)) < 0.5, name


def test_hints_are_the_expected_return_after_a_call_and_close_at_the_end():
    workload = generate(preset_config("agentic-hints", sessions=20), seed=0)
    tools = preset_config("agentic").of_class("agent").tools
    for session in workload.sessions:
        *earlier, last = session.turns
        assert last.hints.close
        for turn in earlier:
            assert not turn.hints.close
            if turn.end == "tool_call":
                assert turn.hints.expect_return_s == tools[turn.tool].duration_median_s
            else:
                assert turn.hints.empty


def test_an_agent_stops_when_its_context_is_full():
    config = preset_config("agentic", sessions=40)
    budget = config.max_history_tokens
    for session in generate(config, seed=2).sessions:
        context = session.system_tokens + sum(
            t.user_tokens + t.output_tokens for t in session.turns
        )
        assert context <= budget + 8000 + 1024  # the last result and reply may pass it


def test_presets_without_tools_carry_no_ends():
    for name in ("default", "multiclass"):
        workload = generate(preset_config(name, sessions=20), seed=0)
        assert all(t.end is None and t.tool is None for s in workload.sessions for t in s.turns)


def test_tool_call_share_needs_tools():
    values = dict(preset_config("quick").model_dump(exclude_none=True), tool_call_share=0.5)
    with pytest.raises(KvtierError, match="tool_call_share > 0 needs tools"):
        GeneratorConfig.from_dict(values)
