"""vLLM with the kvtier connector: what a restore loads follows the request and the engine.

- `kv_load_tiers: []` in a request's `kv_transfer_params` loads nothing: its history is
  recomputed, with vLLM's answer.
- With `restore = "plan"`, a plan that would recompute a front while the back loads is one
  vLLM cannot take (it takes loaded tokens only right after its own hits). The connector plans
  for what vLLM can take instead, a loaded prefix then the prefill, so the history loads
  rather than being recomputed whole.
- `reset_prefix_cache(reset_connector=True)` (after a weight update) empties kvtier's tiers
  too: nothing stored before it is loaded after it."""

from __future__ import annotations

import pytest

from .conftest import computed, loadable, run_driver

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def control(tmp_path_factory) -> dict:
    return run_driver(tmp_path_factory.mktemp("vllm-load-control"), "load-control")


def test_outputs_equal_vllm_without_the_connector(control, baseline):
    for ours, theirs in zip(control["turns"][:3], baseline["turns"][:3], strict=True):
        assert ours["output"] == theirs["output"], ours["note"]


def test_a_request_that_loads_from_no_tier_is_recomputed(control):
    second = control["turns"][1]
    assert second["tokens"] == {"recomputed": second["prompt_tokens"]}
    assert second["counters"]["restore_chunks_refused_by_request"] > 0


def test_a_plan_vllm_cannot_take_becomes_a_loaded_prefix(control):
    second, third = control["turns"][1], control["turns"][2]
    expected = loadable(computed(second), third["prompt_tokens"])
    assert expected > 0
    assert third["tokens"]["host"] == expected
    # every stored chunk loaded ("load"), or those up to the first not stored ("prefix")
    planned = third["counters"]
    assert planned.get("restore_plan_load", 0) + planned.get("restore_plan_prefix", 0) == 1
    assert "restore_plan_bidirectional" not in third["counters"]


def test_a_reset_of_the_connector_drops_every_stored_chunk(control):
    third, again = control["turns"][2], control["turns"][3]
    assert control["reset_ok"] is True
    assert again["counters"]["cleared_chunks"] > 0
    assert again["tokens"] == {"recomputed": again["prompt_tokens"]}
    assert again["output"] == third["output"]
