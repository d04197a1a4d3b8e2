"""Small deployments and hand-made requests for the simulator tests."""

from __future__ import annotations

import pytest

from kvtier.plan.geometry import load_geometry
from kvtier.sim.deployment import Deployment
from kvtier.sim.profile import load_profile
from kvtier.workload.model import Request

GB = 10**9


def request(session: str, turn: int, arrival: float, prompt: int, output: int, **fields) -> Request:
    """A length-only request whose prompt extends the session's previous one (block ids 0..n)."""
    return Request(
        request_id=f"{session}/{turn}",
        session_id=session,
        turn_index=turn,
        arrival_s=arrival,
        tenant=fields.get("tenant", "t0"),
        app_class="chat",
        prompt_tokens=prompt,
        output_tokens=output,
        hash_ids=fields.get("hash_ids", tuple(range(prompt // 16))),
        block_tokens=16,
        messages=[],
        think_s=None,
    )


def deployment(**fields) -> Deployment:
    """Llama-3.1-8B on one H100 with a 40 GB device pool and a 200 GB host tier."""
    values = {
        "profile": load_profile("h100-sxm"),
        "geometry": load_geometry("llama-3.1-8b"),
        "gpus": 1,
        "device_kv_bytes": 40 * GB,
        "tier_bytes": {"host": 200 * GB},
    }
    return Deployment(**{**values, **fields})


@pytest.fixture
def small() -> Deployment:
    return deployment()
