"""`kvtier simulate seeds`: one preset at several workload seeds, end to end and its tables."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtier.errors import KvtierError
from kvtier.sim.seeds import best_counts, parse_seeds, pooled, rule, spread
from tests.sim.test_command import SMALL, simulate

QUICK = ("--workload", "quick", "--workload-set", "sessions=8")


def test_each_seed_is_the_run_that_seed_gives_alone(tmp_path, capsys):
    out = tmp_path / "seeds"
    policies = ("--policies", "retain,offload,cost")
    assert simulate("seeds", *QUICK, "--seeds", "0,3", *policies, "--out", str(out), *SMALL) == 0
    document = json.loads((out / "seeds.json").read_text())
    assert document["seeds"] == [0, 3]
    assert [(r["seed"], r["policy"]) for r in document["rows"]] == [
        (seed, name) for seed in (0, 3) for name in ("retain", "offload", "cost")
    ]
    for seed in (0, 3):
        alone = tmp_path / f"alone-{seed}"
        assert simulate(*QUICK, "--seed", str(seed), *policies, "--out", str(alone), *SMALL) == 0
        runs = json.loads((alone / "results.json").read_text())["runs"]
        kept = json.loads((out / f"seed-{seed}" / "results.json").read_text())
        assert kept["config"]["seed"] == seed
        for run in runs:
            resumed = run["summary"]["ttft_by_turn_kind"]["resumed"]
            [row] = [
                r for r in document["rows"] if r["seed"] == seed and r["policy"] == run["policy"]
            ]
            assert row["resumed_mean_ms"] == pytest.approx(resumed["mean_ms"])
            assert row["resumed_p99_ms"] == pytest.approx(resumed["p99_ms"])
            on_device = run["summary"]["ttft_resumed_by_source"]["device"]["count"]
            assert row["resumed_on_device"] == pytest.approx(on_device / resumed["count"])
    # the two seeds are different workloads, so the spread is a real one
    means = [r["resumed_mean_ms"] for r in document["rows"] if r["policy"] == "offload"]
    assert means[0] != means[1]
    assert document["spread"]["offload"]["resumed_mean_ms"]["min"] == min(means)
    assert [v["seed"] for v in document["versus"]] == [0, 3]
    table = (out / "seeds.md").read_text()
    assert "Over 2 seeds (0, 3)" in table and "| 3 |" in table
    # the share of resumed turns served from the device follows the three TTFT figures
    retain = document["spread"]["retain"]
    cells = [f"{retain[f]['median']:,.1f} [" for f in ("resumed_mean_ms", "resumed_p50_ms")]
    device = retain["resumed_on_device"]
    line = next(line for line in table.splitlines() if line.startswith("| retain |"))
    columns = line.split(" | ")
    assert columns[1].startswith(cells[0]) and columns[2].startswith(cells[1])
    assert columns[4] == f"{device['median']:.1%} [{device['min']:.1%} - {device['max']:.1%}]"
    # pooled: both seeds' resumed turns as one sample, as their request logs give them
    for row in document["pooled"]["rows"]:
        ttfts = [
            r["first_token_s"] - r["arrival_s"]
            for seed in (0, 3)
            for r in map(
                json.loads, (out / f"seed-{seed}" / f"requests-{row['policy']}.jsonl").open()
            )
            if r["turn_kind"] == "resumed" and not r["failed"]
        ]
        assert row["resumed_turns"] == len(ttfts) > 0
        assert row["resumed_mean_ms"] == pytest.approx(1000 * np.mean(ttfts))
        assert row["resumed_p99_ms"] == pytest.approx(1000 * np.percentile(ttfts, 99))
    assert document["pooled"]["versus"]["seed"] == "pooled"
    assert "### Pooled: the resumed turns of the 2 seeds as one sample" in table
    assert "cost over the best fixed policy, pooled: mean " in table
    assert table in capsys.readouterr().out


def row(seed: int, policy: str, mean: float, p99: float, failed: int = 0) -> dict:
    return {
        "seed": seed,
        "policy": policy,
        "failed": failed,
        "resumed_mean_ms": mean,
        "resumed_p50_ms": mean,
        "resumed_p99_ms": p99,
        "resumed_on_device": 1.0,
        "bytes_moved": 0,
    }


def test_best_counts_leave_the_oracle_out_and_count_ties_for_each():
    rows = [
        row(0, "offload", 100.0, 400.0),
        row(0, "cost", 100.4, 500.0),  # within half a percent on the mean: a tie
        row(0, "oracle", 10.0, 10.0),
        row(1, "offload", 100.0, 400.0),
        row(1, "cost", 50.0, 300.0, failed=1),  # faster, but it failed a request
        row(1, "oracle", 10.0, 10.0),
    ]
    counts = best_counts(rows, ["offload", "cost", "oracle"])
    assert counts["offload"] == {"resumed_mean_ms": 2, "resumed_p50_ms": 2, "resumed_p99_ms": 2}
    assert counts["cost"] == {"resumed_mean_ms": 1, "resumed_p50_ms": 1, "resumed_p99_ms": 0}
    assert counts["oracle"] == dict.fromkeys(counts["cost"], 0)
    assert spread(rows, ["cost"])["cost"]["resumed_p99_ms"] == {
        "median": 400.0,
        "min": 300.0,
        "max": 500.0,
    }


def test_the_pooled_verdict_is_the_rule_on_every_seeds_turns_at_once():
    # two seeds of 100 resumed turns each, pooled into one sample of 200
    fast = [0.01] * 99
    resumed = {"offload": [*fast, 1.0, *fast, 0.5], "cost": [*fast, 0.6, *fast, 1.0]}
    rows = [
        row(seed, name, 1.0, 1.0) | {"bytes_moved": 10 * (seed + 1)}
        for seed in (0, 1)
        for name in ("offload", "cost")
    ]
    verdict = pooled(rows, resumed)
    by_policy = {r["policy"]: r for r in verdict["rows"]}
    assert by_policy["cost"]["resumed_turns"] == 200 and by_policy["cost"]["bytes_moved"] == 30
    for name, ttfts in resumed.items():
        assert by_policy[name]["resumed_p99_ms"] == pytest.approx(1000 * np.percentile(ttfts, 99))
        assert by_policy[name]["resumed_mean_ms"] == pytest.approx(1000 * np.mean(ttfts))
    # the p99 of 200 turns lies between the 198th and the 199th: 0.6 against 0.5 decides it
    v = verdict["versus"]
    assert v["resumed_p99_ms_best"] == "offload"
    assert v["resumed_p99_ms"] == pytest.approx(0.0159 / 0.0149)
    assert v["resumed_mean_ms"] == pytest.approx(3.58 / 3.48)
    assert verdict["rule"]["seeds"] == 1
    assert verdict["rule"]["within"] == 0 and verdict["rule"]["ahead"] == 0
    # without cost's two slow turns it is within 5% on all three and 15% ahead on the p99
    better = pooled(rows, {**resumed, "cost": [0.01] * 200})
    assert better["rule"]["within"] == 1 and better["rule"]["ahead"] == 1
    # one seed alone: the pooled figures are that seed's own; no fixed policy, no verdict
    alone = pooled([r for r in rows if r["seed"] == 0], {"cost": resumed["cost"][:100]})
    assert alone["versus"] is None and alone["rule"] == {}
    assert alone["rows"][0]["resumed_p99_ms"] == pytest.approx(
        1000 * np.percentile(resumed["cost"][:100], 99)
    )


def test_the_rule_counts_seeds_within_five_percent_and_fifteen_ahead():
    def ratios(seed, mean, p50, p99):
        return {"seed": seed, "resumed_mean_ms": mean, "resumed_p50_ms": p50, "resumed_p99_ms": p99}

    verdict = rule(
        [ratios(0, 0.84, 1.0, 1.05), ratios(1, 0.9, 1.06, 0.8), ratios(2, 1.0, 1.0, 1.0)]
    )
    assert verdict["seeds"] == 3
    assert verdict["within"] == 2  # seed 1's p50 is 6% behind
    assert verdict["ahead"] == 2  # seed 0 on its mean, seed 1 on its p99
    assert verdict["worst"] == {
        "resumed_mean_ms": 1.0,
        "resumed_p50_ms": 1.06,
        "resumed_p99_ms": 1.05,
    }
    assert verdict["median"]["resumed_mean_ms"] == 0.9
    assert rule([]) == {}


def test_seed_lists():
    assert parse_seeds("0-2,9") == [0, 1, 2, 9]
    assert parse_seeds(" 4 ") == [4]
    for bad in ("a", "3-1", "-1", "1,1", "0-2,2", ""):
        with pytest.raises(KvtierError, match="--seeds takes seeds like 0-9"):
            parse_seeds(bad)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--seeds", "x"), "--seeds takes seeds like 0-9"),
        (("--workload", "nosuch.jsonl"), "simulate seeds needs a generator preset"),
        (("--against", "results.json"), "takes neither --against nor --lengths-from"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path, argv, message):
    with pytest.raises(KvtierError, match=message):
        simulate("seeds", "--workload", "quick", "--out", str(tmp_path), "--no-plots", *argv)
