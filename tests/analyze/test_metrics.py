"""Analysis figures on a six-request trace, computed by hand.

tiny_bailian.jsonl (16-token blocks), decode at 10 tok/s so a turn ends output/10 s after it
arrives:

    chat  session  arrival  prompt  output  end    hash ids
    1     S1       0        40      20      2      1 2 3
    2     S2       5        20      100     15     1 4
    3     S1       10.4     70      20      12.4   1 2 5 6 7
    4     S2       65       140     10      66     1 9..16
    5     S1       200      100     20      202    1 2 5 6 17 18 19
    7     S3       300      30      5       300.5  1 20
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.analyze.metrics import analyze
from kvtier.plan.geometry import load_geometry
from kvtier.workload.traces import load_trace

TRACE = Path(__file__).parent / "data" / "tiny_bailian.jsonl"
BYTES_PER_TOKEN = 23_040  # smollm2-135m, bf16: 2 x 30 layers x 3 KV heads x 64 x 2 B


@pytest.fixture(scope="module")
def tiny():
    return analyze(
        load_trace(TRACE), load_geometry("smollm2-135m"), resume_after_s=30, decode_tok_s=10
    )


def test_turn_kinds_and_gaps(tiny):
    # gaps: 10.4 - 2 = 8.4 (continuing), 65 - 15 = 50 and 200 - 12.4 = 187.6 (resumed)
    assert (tiny.kinds.new, tiny.kinds.continuing, tiny.kinds.resumed) == (3, 1, 2)
    assert tiny.kinds.share(tiny.kinds.resumed) == pytest.approx(1 / 3)
    assert tiny.gaps_s.tolist() == pytest.approx([8.4, 50.0, 187.6])
    assert tiny.returned_within(30) == pytest.approx(1 / 3)
    assert tiny.returned_within(60) == pytest.approx(2 / 3)
    assert tiny.at_zero_gaps == 0
    assert tiny.turns_per_session.tolist() == [3, 2, 1]
    assert tiny.duration_s == pytest.approx(300.5)


def test_gaps_from_arrival_when_decoding_is_instant():
    a = analyze(load_trace(TRACE), load_geometry("smollm2-135m"), decode_tok_s=float("inf"))
    assert a.gaps_s.tolist() == pytest.approx([10.4, 60.0, 189.6])
    assert (a.kinds.continuing, a.kinds.resumed) == (1, 2)


def test_history_growth_by_turn(tiny):
    rows = [(r.turn, r.requests, r.mean_prompt_tokens, r.mean_added_tokens) for r in tiny.growth]
    assert rows == [(1, 3, 30.0, 0.0), (2, 2, 105.0, 75.0), (3, 1, 100.0, 30.0)]


def test_prefix_reuse_and_sharing(tiny):
    p = tiny.prefix
    assert p.prompt_tokens == 400
    # chat 2: block 1 (S1's) 16 cross; chat 3: blocks 1, 2 = 32 own; chat 4: block 1 cross;
    # chat 5: blocks 1 2 5 6 = 64 own; chat 7: block 1 cross
    assert (p.reused_tokens, p.reused_within_session_tokens) == (144, 96)
    assert p.reused_cross_session_tokens == 48
    # block 1 is the only one used by several sessions: 16 tokens at the head of all six
    assert p.shared_prefix_tokens == 96
    assert (p.distinct_shared_prefixes, p.top_shared_prefixes) == (1, [(16, 3)])
    assert (p.reused_block_tokens, p.shared_block_tokens) == (64, 16)


def test_kv_footprint(tiny):
    kv = tiny.kv
    assert kv.bytes_per_token == BYTES_PER_TOKEN
    # idle: S1 holds 60 tokens on [2, 10.4) and 90 on [12.4, 200); S2 120 on [15, 65)
    assert kv.idle_peak_bytes == (90 + 120) * BYTES_PER_TOKEN
    assert kv.idle_peak_sessions == 2
    token_seconds = 60 * 8.4 + 90 * (200 - 12.4) + 120 * 50
    assert kv.idle_mean_bytes == pytest.approx(token_seconds / 300.5 * BYTES_PER_TOKEN)
    # running: chats 2 (120 tokens, 5-15) and 3 (90 tokens, 10.4-12.4) overlap
    assert kv.active_peak_bytes == (120 + 90) * BYTES_PER_TOKEN
    assert kv.keep_all_bytes == (120 + 150 + 35) * BYTES_PER_TOKEN
    assert (kv.longest_context_tokens, kv.longest_context_bytes) == (150, 150 * BYTES_PER_TOKEN)
    assert kv.reused_prefix_bytes == 64 * BYTES_PER_TOKEN
    assert kv.shared_prefix_bytes == 16 * BYTES_PER_TOKEN


def test_idle_timeline_steps(tiny):
    levels = dict(zip(tiny.idle_times_s.tolist(), tiny.idle_bytes.tolist(), strict=True))
    assert levels[15.0] == 210 * BYTES_PER_TOKEN
    assert levels[200.0] == 0.0
