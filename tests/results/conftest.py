"""A hand-made run whose figures test_summary.py works out by hand."""

from __future__ import annotations

import pytest

from kvtier.results.records import OccupancySample, RequestRecord, RunRecords, TierTraffic


def request(request_id: str, kind: str, arrival: float, prompt: int, output: int, **fields):
    session, turn = request_id.split("/")
    return RequestRecord(request_id, session, "t0", int(turn), kind, arrival, prompt, output,
                         **fields)  # fmt: skip


def hand_run(policy: str = "offload") -> RunRecords:
    """s0/0: new, TTFT 0.1 s, 5 tokens 0.1 s apart. s1/1: resumed from host (1,500 tokens
    loaded, 256 recomputed), TTFT 0.3 s, gaps 0.05 and 0.15 s. s0/1: continuing, 200 tokens on
    device, TTFT 0.2 s, one token. s2/0: failed."""
    requests = [
        request("s0/0", "new", 0.0, 100, 5, scheduled_s=0.0, first_token_s=0.1, finish_s=0.5,
                itl_s=[0.1, 0.1, 0.1, 0.1]),
        request("s1/1", "resumed", 1.0, 2000, 3, scheduled_s=1.0, first_token_s=1.3,
                finish_s=1.5, itl_s=[0.05, 0.15],
                restored_tokens={"host": 1500, "recomputed": 256}),
        request("s0/1", "continuing", 2.0, 300, 1, scheduled_s=2.0, first_token_s=2.2,
                finish_s=2.2, itl_s=[], restored_tokens={"device": 200}),
        request("s2/0", "new", 3.0, 50, 0, failed=True, error="context too long"),
    ]  # fmt: skip
    host = TierTraffic(10**9, bytes_written=600, bytes_read=400, bytes_dropped=100,
                       resident_bytes=100, writes=3, reads=2)  # fmt: skip
    return RunRecords(
        policy=policy,
        duration_s=4.0,
        requests=requests,
        tiers={"host": host},
        decisions={"demote": {"device": 3}, "drop": {"host": 1}},
        occupancy=[
            OccupancySample(0.0, {"device": 0, "host": 0}),
            OccupancySample(2.0, {"device": 500, "host": 100}),
        ],
    )


@pytest.fixture
def run() -> RunRecords:
    return hand_run()
