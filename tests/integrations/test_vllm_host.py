"""vLLM with the kvtier connector and a host tier: resumed turns whose history vLLM no longer
holds (its prefix cache emptied by reset_prefix_cache(), or evicted by a flood) get their
prompt tokens from the host tier, and every output equals vLLM's without the connector
(float32, greedy)."""

from __future__ import annotations

import itertools

import pytest

from .conftest import computed, loadable, run_driver

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> dict:
    return run_driver(tmp_path_factory.mktemp("vllm-host"), "host")


def test_every_output_equals_vllm_without_the_connector(host, baseline):
    assert [t["note"] for t in host["turns"]] == [t["note"] for t in baseline["turns"]]
    for ours, theirs in zip(host["turns"], baseline["turns"], strict=True):
        assert ours["output"] == theirs["output"], ours["note"]


def test_turns_after_reset_prefix_cache_load_their_history_from_host(host):
    turns = host["turns"]
    assert turns[0]["tokens"] == {"recomputed": turns[0]["prompt_tokens"]}
    for previous, turn in itertools.pairwise(turns[:3]):
        expected = loadable(computed(previous), turn["prompt_tokens"])
        assert expected > 0
        assert turn["tokens"]["host"] == expected, turn["note"]
        assert turn["tokens"]["recomputed"] == turn["prompt_tokens"] - expected
        assert turn["counters"]["restored_blocks_host"] == expected // 128


def test_turn_after_a_flood_evicted_it_loads_what_vllm_lost(host):
    third, flood, fourth = host["turns"][2], host["turns"][3], host["turns"][4]
    assert flood["tokens"] == {"recomputed": flood["prompt_tokens"]}
    tokens = fourth["tokens"]
    # vLLM kept some of the session's first blocks (its LRU evicts a sequence's tail first);
    # kvtier supplies the rest of the stored history
    assert tokens["host"] > 0
    assert tokens.get("device", 0) + tokens["host"] == loadable(
        computed(third), fourth["prompt_tokens"]
    )


def test_finished_turns_are_written_through_to_host(host):
    turns = host["turns"]
    written = sum(t["counters"].get("written_through_chunks", 0) for t in turns)
    report = host["report"]
    assert report["tiers"]["host"]["chunks"] == written > 0
    assert report["counters"].get("write_through_failures", 0) == 0
    assert report["tiers"]["host"]["errors"] == 0
