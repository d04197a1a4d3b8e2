"""Session hints in a vLLM request's `kv_transfer_params["kvtier_session"]` reach the
connector's session tracker and so the retention policy's view; invalid ones are ignored
with one warning, and the request is served."""

from __future__ import annotations

import logging

import pytest
import torch

from kvtier.integrations.vllm.engine_tiers import EngineTiers
from kvtier.integrations.vllm.kv_port import PagedKVPort
from kvtier.integrations.vllm.messages import Lookup, StepMessages
from kvtier.integrations.vllm.requests import RequestRecord
from kvtier.integrations.vllm.settings import parse_settings
from kvtier.session_hints import SessionHints

from .conftest import run_driver

BLOCK = 16
NUM_BLOCKS = 10


@pytest.fixture
def tiers():
    settings = parse_settings(
        {"tiers": {"host_bytes": "16MiB", "chunk_tokens": 2 * BLOCK}, "policy": {"name": "retain"}}
    )
    layers = {f"layer.{i}": torch.zeros(NUM_BLOCKS, 2, 2, BLOCK, 8) for i in range(2)}
    tiers = EngineTiers(settings, PagedKVPort(layers, NUM_BLOCKS), NUM_BLOCKS, BLOCK, "smollm2")
    yield tiers
    tiers.close()


def looked_up(tiers: EngineTiers, request_id: str, params: dict) -> None:
    """The worker meets a new request as vLLM's scheduler side sends it."""
    record = RequestRecord(request_id, list(range(100, 140)), 40, kv_transfer_params=params)
    tiers.before_forward(StepMessages(lookups=[Lookup(record, 0, ask=False)]))


def test_hints_reach_the_policys_view_of_the_session(tiers):
    sent = {"priority": 2, "pin": True, "ttl_s": 600, "expect_return_s": 20}
    looked_up(tiers, "r1", {"session_id": "agent-1", "kvtier_session": sent})
    (session,) = tiers.connector.runner.view().sessions
    assert session.session_id == "agent-1"
    assert session.hints == SessionHints(expect_return_s=20.0, priority=2, pin=True, ttl_s=600.0)
    assert (session.pinned, session.priority, session.ttl_s) == (True, 2, 600.0)
    # hints belong to the turn that sent them: the next turn's are its own
    looked_up(tiers, "r2", {"session_id": "agent-1", "kvtier_session": {"close": True}})
    (session,) = tiers.connector.runner.view().sessions
    assert session.hints == SessionHints(close=True) and not session.pinned


@pytest.mark.parametrize(
    ("sent", "words"),
    [
        ({"priority": 99}, "request.priority"),
        ({"pinned": True}, "did you mean pin"),
        ("pin", "an object is needed"),
    ],
)
def test_invalid_hints_are_ignored_with_one_warning(tiers, caplog, sent, words):
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        looked_up(tiers, "r1", {"session_id": "agent-2", "kvtier_session": sent})
        tiers.before_forward(StepMessages(lookups=[]))  # the next step: nothing more said
    (warning,) = [r.getMessage() for r in caplog.records if "kvtier_session" in r.getMessage()]
    assert "request r1" in warning and words in warning
    (session,) = tiers.connector.runner.view().sessions
    assert session.session_id == "agent-2" and session.hints == SessionHints()


@pytest.mark.slow
def test_real_vllm_passes_the_hints_through_kv_transfer_params(tmp_path):
    result = run_driver(tmp_path, "hints")
    sessions = result["sessions"]
    first, second = sessions["agent-1"], sessions["agent-2"]
    assert first["turns"] == 2
    assert first["hints"] == {
        "close": True, "expect_return_s": None, "priority": 0, "pin": False, "ttl_s": None
    }  # fmt: skip
    assert second["hints"]["priority"] == 0 and second["turns"] == 1
    (warning,) = [w for w in result["warnings"] if "kvtier_session" in w]
    assert "priority" in warning
