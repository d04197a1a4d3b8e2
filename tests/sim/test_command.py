"""`kvtier simulate` and `kvtier simulate sweep` end to end on tiny workloads, and their errors."""

from __future__ import annotations

import json
import math

import pytest

from kvtier.cli import _ArgumentParser
from kvtier.errors import KvtierError
from kvtier.sim import command
from kvtier.sim.sweep import versus, winners


def simulate(*argv: str) -> int:
    parser = _ArgumentParser(prog="kvtier simulate")
    command.add_arguments(parser)
    return command.run(parser.parse_args(list(argv)))


SMALL = ("--model", "llama-3.1-8b", "--gpus", "1", "--device-kv-bytes", "2GB", "--no-plots")


def test_run_writes_the_results_schema_and_validates_against_itself(tmp_path, capsys):
    out = tmp_path / "sim"
    args = ("--workload", "quick", "--policies", "retain,offload", "--out", str(out), *SMALL)
    assert simulate(*args, "--workload-set", "sessions=6") == 0
    document = json.loads((out / "results.json").read_text())
    assert document["schema"] == "kvtier.results/1" and document["source"] == "simulate"
    assert [run["policy"] for run in document["runs"]] == ["retain", "offload"]
    assert document["config"]["device_kv_bytes"] == 2 * 10**9
    assert "| offload |" in capsys.readouterr().out
    again = tmp_path / "again"
    args = ("--workload", "quick", "--policies", "offload", "--out", str(again), *SMALL)
    assert (
        simulate(*args, "--workload-set", "sessions=6", "--against", str(out / "results.json")) == 0
    )
    validation = json.loads((again / "validation.json").read_text())
    errors = [row["relative_error"] for row in validation["policies"]["offload"].values()]
    assert errors and all(e in (0.0, None) for e in errors)


def test_sweep_writes_its_table_and_heatmap(tmp_path):
    out = tmp_path / "sweep"
    args = ("sweep", "--resume-shares", "0.2,0.8", "--contexts", "2000", "--sessions", "4")
    args += ("--policies", "recompute,offload", "--out", str(out), *SMALL[:-1])
    assert simulate(*args) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert len(sweep["rows"]) == 4 and len(sweep["winners"]) == 2
    table = (out / "sweep.md").read_text()
    assert "| h100-sxm | 0.2 | 2,000 |" in table and "TTFT p99" in table
    # `recompute` drops an idle session's KV, so no resumed turn finds it on the device;
    # `offload` with room keeps it there
    on_device = {(r["policy"], r["resume_share"]): r["resumed_on_device"] for r in sweep["rows"]}
    assert on_device["recompute", 0.8] == 0.0 and on_device["offload", 0.8] == 1.0
    assert "| resumed on device |" in table and "| offload | " in table
    assert (out / "sweep_heatmap.png").stat().st_size > 1000


def test_winners_name_the_best_policy_and_its_margin():
    rows = [
        {"hardware": "h", "resume_share": 0.5, "context": 8, "policy": p, "resumed_share": 0.3,
         "median_ttft_ms": ttft, "p99_ttft_ms": ttft, "output_throughput": tput, "bytes_moved": b,
         "resumed_mean_ms": ttft, "resumed_p50_ms": ttft, "resumed_p99_ms": ttft,
         "failed": failed}
        for p, ttft, tput, b, failed in (
            ("cost", 80.0, 10.0, 5, 0), ("offload", 100.0, 12.0, 0, 0),
            ("retain", 100.2, 12.0, 0, 0), ("recompute", 10.0, 20.0, 0, 3),
        )
    ]  # fmt: skip
    [cell] = winners(rows)
    # recompute's latencies look best, but it failed requests
    assert cell["median_ttft_ms"] == {"policy": "cost", "value": 80.0, "margin": pytest.approx(0.2)}
    assert cell["output_throughput"] == {"policy": "offload=retain", "value": 12.0,
                                         "margin": pytest.approx(0.2)}  # fmt: skip
    assert cell["bytes_moved"]["policy"] == "offload=retain" and cell["bytes_moved"]["value"] == 0
    # cost against the best fixed policy (retain, offload, ttl; recompute is not one)
    [versus_cell] = versus(rows)
    assert versus_cell["resumed_mean_ms"] == pytest.approx(0.8)
    assert versus_cell["resumed_mean_ms_best"] == "offload"
    assert versus_cell["bytes_vs_offload"] == math.inf  # offload moved nothing, cost 5 bytes


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--workload", "nosuch.jsonl"), "neither a preset"),
        (("--validate",), "--validate needs --against"),
        (("--hardware", "h300"), "unknown hardware profile 'h300'"),
        (("--gpus", "8", "--tp", "3"), "--tp 3 must divide the GPU count 8"),
        (("--policies", "lru9"), "unknown policy 'lru9'"),
        (("--workload-set", "sessions"), "--workload-set takes KEY=VALUE"),
        (("--workload-set", "sesions=4"), "sesions"),
        (("--link", "disk=nvme9"), "unknown link 'nvme9'"),
        (("sweep", "--resume-shares", "2"), "--resume-shares takes numbers in [0, 1]"),
        (("--gpus", "1", "--tp", "1"), "do not fit in 90% of 1 x h100-sxm"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path, argv, message):
    with pytest.raises(KvtierError, match=message.replace("[", r"\[").replace("]", r"\]")):
        simulate("--workload", "quick", "--out", str(tmp_path), "--no-plots", *argv)


def test_cost_prices_in_units_when_the_command_line_asks(tmp_path):
    """`--policy-set cost.pricing_chunks=4`: the simulated cost policy prices runs of up to
    four adjacent chunks as one unit; every request is still served, with the KV it held."""
    summaries = {}
    for unit in (1, 4):
        out = tmp_path / f"unit{unit}"
        args = ("--workload", "quick", "--workload-set", "sessions=12", "--policies", "cost")
        args += ("--policy-set", f"cost.pricing_chunks={unit}", "--out", str(out), *SMALL)
        assert simulate(*args) == 0
        document = json.loads((out / "results.json").read_text())
        assert document["config"]["policy_set"] == [f"cost.pricing_chunks={unit}"]
        summaries[unit] = document["runs"][0]["summary"]
    for summary in summaries.values():
        assert summary["failed"] == 0 and summary["completed"] == summaries[1]["completed"]
        assert summary["policy_decisions"]
    with pytest.raises(KvtierError, match="pricing_chunks"):
        simulate("--workload", "quick", "--policies", "cost", "--policy-set",
                 "cost.pricing_chunks=0", "--out", str(tmp_path / "bad"), *SMALL)  # fmt: skip
