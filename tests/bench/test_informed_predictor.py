"""benchmarks/informed_predictor.py: the warm start is the preset's gaps at another seed (every
session's end once, as a gap past the cut-off), and the script runs `kvtier simulate` with the
informed policy beside the ones asked for."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tests.bench.test_gpu_check import BENCHMARKS, run_benchmark

sys.path.insert(0, str(BENCHMARKS))
from informed_predictor import preset_gaps


def test_the_warm_start_counts_every_sessions_end_once_unless_told_not_to():
    gaps = preset_gaps("multiclass", finished_only=False, sessions=60)
    ends = sum(g.count(math.inf) for g in gaps.values())
    assert ends == 60
    assert {app for _, app, _, _ in gaps} == {"agent", "chat", "docqa"}
    # the keys the policy learns by: how the turn before each gap ended, the tool it called
    agentic = preset_gaps("agentic", finished_only=False, sessions=40)
    assert ("agent", "tool_call", "run_tests") in {key[1:] for key in agentic}
    assert ("agent", "answer", None) in {key[1:] for key in agentic}
    finished = preset_gaps("multiclass", finished_only=True, sessions=60)
    assert not any(math.inf in g for g in finished.values())
    assert sum(map(len, finished.values())) == sum(map(len, gaps.values())) - ends


def _run_script(out: Path, *before: str, simulate: tuple[str, ...] = ()) -> None:
    """The script on 6 sessions of `quick` with `cost` asked for: `before` are its own flags,
    `simulate` the simulate flags added after the `--`."""
    done = run_benchmark(
        "informed_predictor.py",
        *("--workload", "quick", *before, "--", *simulate),
        *("--workload-set", "sessions=6", "--policies", "cost", "--no-plots", "--out", str(out)),
    )
    assert done.returncode == 0, done.stderr


def test_the_script_runs_the_informed_policy_beside_cost(tmp_path: Path):
    out = tmp_path / "informed"
    _run_script(out)
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [run["policy"] for run in runs] == ["cost", "informed_predictor:InformedCost"]


def test_with_seeds_the_script_runs_simulate_seeds_and_pools_the_informed_policy(tmp_path: Path):
    out = tmp_path / "informed-seeds"
    _run_script(out, "--sample-sessions", "40", simulate=("--seeds", "0-1"))
    document = json.loads((out / "seeds.json").read_text())
    assert document["seeds"] == [0, 1]
    assert document["policies"] == ["cost", "informed_predictor:InformedCost"]
    assert {row["policy"] for row in document["pooled"]["rows"]} == set(document["policies"])
