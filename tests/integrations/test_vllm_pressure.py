"""vLLM's queue in the retention policy: paused sessions' blocks in vLLM's prefix cache are
the policy's to order down when requests wait for room, as in kvtier's own engine.

vLLM runs one request at a time, so a batch of three leaves two waiting. Sessions A (pinned by
its hint) and B paused before it, A first: vLLM alone evicts cached blocks least recently used
first, so A's would go before B's. With the connector, the policy (`offload`, timer an hour
away) runs because the waiting head needs more blocks than vLLM has free without evicting a
paused session; it moves B's chunks down (host holds them, written through) and vLLM reuses
their blocks first, so A's history is still a device hit on its next turn and B's loads from
host, with the answer it has recomputed. vLLM alone, on the same turns, loses A's history."""

from __future__ import annotations

import pytest

from .conftest import BLOCK, run_driver

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pressure(tmp_path_factory) -> dict:
    return run_driver(tmp_path_factory.mktemp("vllm-pressure"), "pressure")


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict:
    """The same turns on vLLM without the connector."""
    return run_driver(tmp_path_factory.mktemp("vllm-pressure-alone"), "pressure-baseline")


def test_the_policy_sees_paused_sessions_on_vllms_device(pressure):
    # 600-token turns with 16-token answers: 4 full chunks each, still cached by vLLM
    before = pressure["device_chunks_before"]
    assert (before["A"], before["B"]) == (4, 4)


def test_queue_pressure_runs_the_policy_and_the_timer_does_not(pressure):
    queued = pressure["after_queue"]
    assert queued["policy_runs"]["timer"] == 0
    assert queued["policy_runs"]["pressure"] >= 1
    assert queued["decisions"]["move"] >= 1
    assert queued["counters"]["policy_released_vllm_blocks"] >= 4


def test_the_pinned_session_keeps_its_blocks_and_the_other_loads_from_host(pressure, alone):
    turns = {t["note"]: t for t in pressure["turns"]}
    a, b = turns["A: turn 2"], turns["B: turn 2"]
    history = 4 * BLOCK
    assert a["tokens"].get("device") == history and "host" not in a["tokens"]
    assert b["tokens"].get("host") == history and "device" not in b["tokens"]
    assert a["vllm_cached_tokens"] == b["vllm_cached_tokens"] == history
    # vLLM alone evicts least recently used first: A's history went, which the policy kept
    without = {t["note"]: t for t in alone["turns"]}
    assert without["A: turn 2"]["vllm_cached_tokens"] < history
    assert without["A: turn 2"]["output"] == a["output"]


def test_the_loaded_turn_answers_as_recomputed(pressure):
    turns = {t["note"]: t for t in pressure["turns"]}
    recomputed = turns["B: turn 2 recomputed"]
    assert recomputed["tokens"] == {"recomputed": recomputed["prompt_tokens"]}
    assert turns["B: turn 2"]["output"] == recomputed["output"]
