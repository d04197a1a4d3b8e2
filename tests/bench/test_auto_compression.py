"""The `auto` preset: hand-built observations whose right preset is known, and real workloads."""

from __future__ import annotations

import pytest

from kvtier.bench.auto_compression import (
    AutoChoice,
    WorkloadObservations,
    choose_for_workload,
    choose_preset,
)
from kvtier.compress import parse_method
from kvtier.compress.presets import PRESETS
from kvtier.errors import KvtierError

MIB = 1 << 20


def observed(**changes) -> WorkloadObservations:
    """A middling workload (single turns of 1K tokens, KV in flight at the device budget),
    with `changes` applied."""
    values = {
        "turns": 200,
        "context_tokens_p50": 1000.0,
        "context_tokens_max": 3000,
        "multi_turn_share": 0.1,
        "resume_share": 0.05,
        "memory_pressure": 1.0,
        "longest_turn_pressure": 0.05,
    }
    return WorkloadObservations(**{**values, **changes})


@pytest.mark.parametrize(
    ("changes", "preset", "says"),
    [
        # Everything in flight fits in a quarter of the device: no compression at all.
        ({"memory_pressure": 0.25}, "full", "25% of the device budget"),
        # Three times the device: halving is not enough, bound every cache.
        ({"memory_pressure": 3.0}, "edge_device", "3.0x the device budget"),
        # One session alone is bigger than the device, even with nothing else running.
        (
            {"memory_pressure": 0.3, "longest_turn_pressure": 1.5, "context_tokens_max": 90000},
            "edge_device",
            "90,000 tokens",
        ),
        # Most turns continue a session: protect the reused prefix, evict mildly.
        ({"multi_turn_share": 0.7, "resume_share": 0.1}, "multi_turn_chat", "70% of turns"),
        # Few later turns, but a third of all turns come back after a pause.
        ({"multi_turn_share": 0.4, "resume_share": 0.3}, "multi_turn_chat", "30% come back"),
        # Long single documents.
        ({"context_tokens_p50": 6000.0}, "long_single_request", "6,000 tokens"),
        # Short single turns under pressure: throughput.
        ({}, "datacenter_throughput", "more run at once"),
    ],
)
def test_rules_pick_the_known_preset_and_say_why(changes, preset, says):
    choice = choose_preset(observed(**changes))
    assert choice.preset == preset
    assert says in choice.reason
    assert choice.method == ("full" if preset == "full" else PRESETS[preset])
    parse_method(choice.method)  # what auto picks is always a runnable pipeline


def test_first_matching_rule_wins():
    # A long chat under overflow: the overflow rule comes before the chat rule.
    choice = choose_preset(observed(memory_pressure=2.5, multi_turn_share=0.9))
    assert choice.preset == "edge_device"
    # With room to spare, long single documents are left uncompressed.
    assert choose_preset(observed(memory_pressure=0.4, context_tokens_p50=8000.0)).preset == "full"


def test_unknown_memory_pressure_skips_the_memory_rules_and_says_so():
    choice = choose_preset(observed(memory_pressure=None, longest_turn_pressure=None))
    assert choice.preset == "datacenter_throughput"
    assert "memory pressure unknown" in choice.reason


def test_deterministic():
    first = choose_preset(observed(multi_turn_share=0.6))
    assert all(choose_preset(observed(multi_turn_share=0.6)) == first for _ in range(3))
    assert isinstance(first, AutoChoice) and str(first).startswith("multi_turn_chat (tova:0.25)")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"turns": 0}, "at least one observed turn"),
        ({"multi_turn_share": 1.5}, "multi_turn_share must be a share"),
        ({"multi_turn_share": 0.1, "resume_share": 0.2}, "cannot exceed multi_turn_share"),
        ({"memory_pressure": -1.0}, "memory_pressure must be >= 0"),
        ({"memory_pressure": float("nan")}, "memory_pressure must be >= 0"),
    ],
)
def test_impossible_observations_are_clear_errors(changes, message):
    with pytest.raises(KvtierError, match=message):
        observed(**changes)


def test_from_a_generated_workload_and_the_device_budget(model_dir):
    """The `demo` workload on SmolLM2 (the bench's --quick): a chat, so the pool size decides
    between no compression and the chat preset."""
    from kvtier.plan.geometry import load_geometry
    from kvtier.workload.generator import generate

    workload = generate("demo", seed=0)
    geometry = load_geometry(str(model_dir))
    roomy = choose_for_workload(workload, geometry, 1024 * MIB)
    assert roomy.preset == "full"
    # A pool a few sessions' worth: the KV in flight no longer fits with room.
    tight = choose_for_workload(workload, geometry, 24 * MIB)
    assert tight.preset in ("multi_turn_chat", "edge_device")
    assert "later turns" in tight.reason and "resumed" in tight.reason
    with pytest.raises(KvtierError, match="device KV budget must be positive"):
        choose_for_workload(workload, geometry, 0)


def test_auto_is_not_a_method_string_and_says_what_to_use():
    with pytest.raises(KvtierError, match="choose_for_workload"):
        parse_method("auto")
