"""Method x ratio planning: what runs, and clear errors before any model loads."""

from __future__ import annotations

import pytest

from kvtier.errors import KvtierError
from kvtier.eval.methods import plan_runs


def test_plain_presses_run_per_nonzero_ratio_after_one_full_baseline():
    runs = plan_runs(["snapkv", "tova"], [0, 0.5, 0.875])
    assert [r.spec for r in runs] == [
        "full",
        "snapkv:0.5",
        "snapkv:0.875",
        "tova:0.5",
        "tova:0.875",
    ]
    assert runs[1].method == "snapkv" and runs[1].ratio == 0.5


def test_written_out_methods_run_once_as_given():
    runs = plan_runs(["full", "kivi4", "snapkv:0.25", "streaming_llm@256"], [0.5])
    assert [r.spec for r in runs] == ["full", "kivi4", "snapkv:0.25", "streaming_llm@256"]
    assert runs[1].ratio is None and runs[2].ratio == 0.25


@pytest.mark.parametrize(
    ("methods", "ratios", "message"),
    [
        (["snapkv"], [1.0], r"ratio must be in \[0, 1\)"),
        (["snapkv"], [-0.1], r"ratio must be in \[0, 1\)"),
        (["snapkv:1.5"], [0.5], r"ratio must be in \[0, 1\)"),
        (["snapkvv"], [0.5], "unknown compression method 'snapkvv'"),
        (["kivi"], [0.5], "needs a bit width"),
        ([], [0.5], "at least one method"),
        (["snapkv"], [], "at least one compression ratio"),
    ],
)
def test_bad_methods_and_ratios_are_clear_errors(methods, ratios, message):
    with pytest.raises(KvtierError, match=message):
        plan_runs(methods, ratios)
