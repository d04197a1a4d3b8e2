"""`kvtier simulate --validate`: relative errors, targets and set-up checks on hand-made
result documents."""

from __future__ import annotations

import json

import pytest

from kvtier.errors import KvtierError
from kvtier.policy.config import PolicyConfig
from kvtier.results.records import SCHEMA
from kvtier.sim.command import _validate
from kvtier.sim.simulator import simulate
from kvtier.sim.validation import measured_lengths, setup_mismatches, target_of, with_lengths
from tests.sim.conftest import deployment, request

BENCH_CONFIG = {
    "workload": {"name": "demo", "seed": 0, "workload_set": []},
    "engine": {
        "kv_cache_bytes": 67108864,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "session_resume_after_s": 30.0,
        "tiers": {"host_bytes": 1073741824, "chunk_tokens": 256},
    },
    "host_bytes": 1073741824,
    "disk_bytes": 0,
    "policy_set": [],
}
SIM_CONFIG = {
    "workload": "demo",
    "workload_set": [],
    "seed": 0,
    "policy_set": [],
    "model": "smollm2-135m",
    "replicas": 1,
    "device_kv_bytes": 67108864,
    "tier_bytes": {"host": 1073741824},
    "chunk_tokens": 256,
    "max_num_seqs": 8,
    "max_batched_tokens": 512,
    "resume_after_s": 30.0,
    "timer_after_steps": True,
}


def document(source: str, config: dict, runs: dict[str, dict]) -> dict:
    return {
        "schema": SCHEMA,
        "source": source,
        "config": config,
        "runs": [{"policy": policy, "summary": summary} for policy, summary in runs.items()],
    }


def summary(ttft: tuple[float, float, float], tpot: float, host: tuple[int, int], **extra):
    mean, median, p99 = ttft
    return {
        "mean_ttft_ms": mean,
        "median_ttft_ms": median,
        "p99_ttft_ms": p99,
        "mean_tpot_ms": tpot,
        "median_tpot_ms": tpot,
        "p99_tpot_ms": tpot,
        "request_throughput": 0.5,
        "output_throughput": 10.0,
        "tier_bytes": {"host": {"bytes_read": host[0], "bytes_written": host[1]}},
        **extra,
    }


def test_validate_prints_and_writes_relative_errors_against_targets(tmp_path, capsys):
    measured = document(
        "bench",
        BENCH_CONFIG,
        {
            "offload": summary((100.0, 200.0, 400.0), 50.0, (1000, 0)),
            "oracle": summary((1.0, 1.0, 1.0), 1.0, (1, 1)),
        },
    )
    simulated = document(
        "simulate",
        SIM_CONFIG,
        {"offload": summary((108.0, 190.0, 520.0), 40.0, (960, 0), request_throughput=0.4)},
    )
    path = _validate(simulated, measured, "bench.json", tmp_path)
    result = json.loads(path.read_text())
    rows = result["policies"]["offload"]
    assert rows["mean_ttft_ms"]["relative_error"] == pytest.approx(0.08)
    assert rows["mean_ttft_ms"]["within"] is True and rows["mean_ttft_ms"]["target"] == 0.10
    assert rows["median_ttft_ms"]["relative_error"] == pytest.approx(-0.05)
    assert rows["p99_ttft_ms"]["relative_error"] == pytest.approx(0.30)
    assert rows["p99_ttft_ms"]["within"] is False and rows["p99_ttft_ms"]["target"] == 0.25
    assert rows["mean_tpot_ms"]["relative_error"] == pytest.approx(-0.2)
    assert rows["p99_tpot_ms"]["within"] is True  # -20% is within p99's 25%
    assert rows["request_throughput"]["relative_error"] == pytest.approx(-0.2)
    assert rows["host_bytes_read"]["relative_error"] == pytest.approx(-0.04)
    assert rows["host_bytes_read"]["target"] == 0.05 and rows["host_bytes_read"]["within"]
    assert rows["host_bytes_written"]["relative_error"] == 0.0  # 0 against 0
    assert "mean_itl_ms" in rows and rows["mean_itl_ms"]["within"] is None  # not in either
    assert result["only_measured"] == ["oracle"] and result["only_simulated"] == []
    printed = capsys.readouterr().out
    assert "warning" not in printed  # set up like the bench run
    assert "offload: simulated vs measured (6 of 10 within target)" in printed
    assert "p99_ttft_ms" in printed and "+30.0%" in printed and "MISS" in printed


def test_a_simulation_not_set_up_like_the_bench_run_is_named(tmp_path, capsys):
    assert setup_mismatches(SIM_CONFIG, BENCH_CONFIG) == []
    other = {**SIM_CONFIG, "device_kv_bytes": 10**9, "max_batched_tokens": 8192}
    other |= {"model": "llama-3.1-8b", "tier_bytes": {"host": 1073741824, "disk": 10**9}}
    other |= {"write_through": True, "keep_moved": True, "shared_prefixes": False}
    problems = setup_mismatches(other, BENCH_CONFIG)
    assert problems == [
        "device KV pool: simulated 1000000000, measured 67108864",
        "disk tier bytes: simulated 1000000000, measured 0",
        "tokens per step: simulated 8192, measured 512",
        "write-through: simulated True, measured False",
        "kept pages: simulated True, measured False",
        "model: simulated 'llama-3.1-8b', measured the embedded smollm2-135m",
        "shared prefixes: simulated per conversation, the engine's prefix cache shares blocks "
        "across conversations (give --shared-prefixes)",
    ]
    assert setup_mismatches(SIM_CONFIG, {}) == [
        "the measured results were not written by `kvtier bench` (no engine config)"
    ]


@pytest.mark.parametrize(
    ("field", "target"),
    [
        ("mean_ttft_ms", 0.10),
        ("median_itl_ms", 0.10),
        ("p99_tpot_ms", 0.25),
        ("output_throughput", 0.10),
        ("disk_bytes_written", 0.05),
        ("host_bytes_read", 0.05),
    ],
)
def test_targets_are_the_issues(field, target):
    assert target_of(field) == target


def test_lengths_from_a_bench_run_replace_the_generators_and_share_the_recorded_history(
    tmp_path,
):
    records = [
        {"request_id": "s/0", "prompt_tokens": 90, "output_tokens": 7,
         "restored_tokens": {"device": 32}},
        {"request_id": "s/1", "prompt_tokens": 150, "output_tokens": 5,
         "restored_tokens": {"device": 48, "recomputed": 16}},
        {"request_id": "t/0", "prompt_tokens": 0, "output_tokens": 0, "failed": True},
    ]  # fmt: skip
    (tmp_path / "requests-offload.jsonl").write_text("\n".join(map(json.dumps, records)))
    lengths = measured_lengths(tmp_path / "results.json")
    assert lengths == {"s/0": (90, 7, 32), "s/1": (150, 5, 64)}  # failed ones are not taken
    turns = [
        request("s", 0, 0.0, 100, 10),
        request("s", 1, 5.0, 200, 10),
        request("t", 0, 1, 64, 3),
    ]
    first, second, other = with_lengths(turns, lengths)
    assert (first.prompt_tokens, first.output_tokens, len(first.hash_ids)) == (90, 7, 6)
    assert (second.prompt_tokens, second.output_tokens, len(second.hash_ids)) == (150, 5, 10)
    assert second.hash_ids[:4] == first.hash_ids[:4]  # 64 tokens of history: 4 blocks
    assert second.hash_ids[4] not in first.hash_ids
    # a first turn's history came from other sessions (a shared system prompt): it keeps the
    # generator's ids for those 2 blocks, which the other sessions of its app share
    assert first.hash_ids[:2] == turns[0].hash_ids[:2]
    assert first.hash_ids[2] not in turns[0].hash_ids
    assert other == turns[2]  # no record: as generated
    with pytest.raises(KvtierError, match=r"no requests-<policy>\.jsonl next to"):
        measured_lengths(tmp_path / "elsewhere" / "results.json")


def test_timer_after_steps_runs_no_policy_while_the_replica_is_idle():
    """As in the engine: the timer ticks during the 600 s pause find the replica idle, so the
    policy that would move the idle KV to host runs only after the next step."""
    first = request("s", 0, 0.0, 4000, 96)
    second = request("s", 1, 600.0, 4200, 10, hash_ids=tuple(range(4200 // 16)))
    config = PolicyConfig(name="tests.sim.test_simulator:ToHost", interval_s=5.0)
    on_clock = simulate([first, second], deployment(), config).run.requests[1]
    assert "host" in on_clock.restored_tokens
    after_steps = simulate([first, second], deployment(timer_after_steps=True), config)
    assert after_steps.run.requests[1].restored_tokens == {"device": 4096}


def test_a_measured_history_caps_what_the_session_kv_covers():
    first = request("s", 0, 0.0, 4000, 96)
    second = request("s", 1, 10.0, 4200, 10, hash_ids=tuple(range(4200 // 16)))
    retain = PolicyConfig(name="retain")
    whole = simulate([first, second], deployment(), retain).run.requests[1]
    assert whole.restored_tokens == {"device": 4096}  # the prompt extends the previous turn
    capped = simulate([first, second], deployment(), retain, {"s/1": 2008}).run.requests[1]
    assert capped.restored_tokens == {"device": 2000}  # cut at a whole block
