"""vLLM with the kvtier connector and only a (persistent) disk tier: resumed turns load from
disk; a second vLLM process with the same directory finds the first one's KV; records
corrupted on disk are detected, counted and recomputed: the outputs never change."""

from __future__ import annotations

import itertools

import pytest

from .conftest import computed, loadable, run_driver

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("vllm-disk")
    disk_dir = str(tmp / "kv")
    first = run_driver(tmp, "disk", "--disk-dir", disk_dir)
    history = tmp / "disk.json"
    second = run_driver(tmp, "disk-resume", "--disk-dir", disk_dir, "--history", str(history))
    return first, second


def test_resumed_turns_load_from_disk_with_unchanged_outputs(runs, baseline):
    first, _ = runs
    for ours, theirs in zip(first["turns"], baseline["turns"], strict=True):
        assert ours["output"] == theirs["output"], ours["note"]
    turns = first["turns"]
    for previous, turn in itertools.pairwise(turns[:3]):
        expected = loadable(computed(previous), turn["prompt_tokens"])
        assert turn["tokens"]["disk"] == expected > 0, turn["note"]


def test_a_second_process_finds_the_first_ones_kv(runs, baseline):
    _, second = runs
    resumed = second["turns"][0]
    assert resumed["output"] == baseline["turns"][2]["output"]
    # turn 4 of the first process stored every full block of turn 3's prompt
    assert resumed["tokens"]["disk"] == loadable(resumed["prompt_tokens"], resumed["prompt_tokens"])
    assert resumed["tier_errors"] == 0


def test_corrupted_records_are_counted_and_recomputed(runs, baseline):
    _, second = runs
    assert second["flipped_bytes"] > 0
    corrupted = second["turns"][1]
    assert corrupted["output"] == baseline["turns"][2]["output"]
    assert corrupted["tier_errors"] > 0
    assert corrupted["counters"]["restore_failures"] >= 1
    assert corrupted["tokens"].get("disk", 0) == 0  # nothing loaded from a bad record
    assert corrupted["tokens"]["recomputed"] == corrupted["prompt_tokens"]
