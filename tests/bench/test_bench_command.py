"""`kvtier bench` through the CLI: bad input is one line and exit 2; a tiny run writes the
results schema with vLLM's field names and renders the report."""

from __future__ import annotations

import json

import pytest

from kvtier import cli
from kvtier.host_cpu import host_cpu
from tests.host_dtype import AUTO_DTYPE


@pytest.fixture(autouse=True)
def bench_command(monkeypatch):
    # the CLI maps "bench" -> kvtier.bench.command (added in cli.py by its owner)
    commands = {**cli.COMMANDS, "bench": ("kvtier.bench.command", "benchmark policies")}
    monkeypatch.setattr(cli, "COMMANDS", commands)


def _one_line_error(capsys, argv: list[str]) -> str:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors exit from parse_args
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("kvtier: error:")
    return err


def test_unknown_policy(capsys):
    assert "unknown policy 'nope'" in _one_line_error(
        capsys, ["bench", "--policies", "retain,nope"]
    )


def test_missing_trace(capsys, tmp_path):
    err = _one_line_error(capsys, ["bench", "--workload", str(tmp_path / "missing.jsonl")])
    assert "neither a preset" in err


def test_bad_size_and_flags(capsys):
    _one_line_error(capsys, ["bench", "--kv-cache-bytes", "lots"])
    _one_line_error(capsys, ["bench", "--policies", ","])
    _one_line_error(capsys, ["bench", "--no-such-flag"])


def _tiny_trace(path):
    """Two sessions of two turns, lengths only (bailian format: 16-token hash ids)."""
    rows = [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 40,
         "output_length": 3, "hash_ids": [1, 2, 3]},
        {"chat_id": 2, "parent_chat_id": -1, "timestamp": 2.0, "input_length": 36,
         "output_length": 3, "hash_ids": [7, 8, 9]},
        {"chat_id": 3, "parent_chat_id": 1, "timestamp": 900.0, "input_length": 60,
         "output_length": 3, "hash_ids": [1, 2, 3, 4]},
        {"chat_id": 4, "parent_chat_id": 2, "timestamp": 1800.0, "input_length": 56,
         "output_length": 3, "hash_ids": [7, 8, 9, 10]},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.slow
def test_tiny_run_writes_results_and_report(capsys, tmp_path):
    out = tmp_path / "bench"
    trace = _tiny_trace(tmp_path / "trace.jsonl")
    argv = [
        "bench",
        "--workload", str(trace),
        "--policies", "retain,cost",
        "--kv-cache-bytes", "16MiB",
        "--no-progress",
        "--out", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| policy |" in printed and "| retain |" in printed
    document = json.loads((out / "results.json").read_text())
    assert document["schema"] == "kvtier.results/1"
    assert document["source"] == "bench"
    assert document["command"].startswith("kvtier bench")
    # the CPU the timings come from, as this host's /proc/cpuinfo names it
    assert document["host"]["cpu"] == host_cpu().as_dict()
    assert f"host: {host_cpu().describe()}" in printed
    # what its engines ran, "auto" decided here
    engine = document["host"]["engine"]
    assert engine["dtype"] == AUTO_DTYPE
    assert engine["prefill_attention"] in ("kernel", "torch")
    assert f"engine {AUTO_DTYPE}, prefill attention by {engine['prefill_attention']}" in printed
    workload = document["config"]["workload"]
    assert workload["sessions"] == 2 and workload["length_scale"] == 1.0
    assert document["config"]["runs"]["retain"]["idle_skipped_s"] > 1000
    summary = document["runs"][0]["summary"]
    for key in (
        "completed", "failed", "duration", "request_throughput", "output_throughput",
        "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "p99_itl_ms", "median_e2el_ms",
    ):  # fmt: skip
        assert key in summary, key
    assert summary["failed"] == 0 and summary["completed"] >= 2
    lines = (out / "requests-retain.jsonl").read_text().splitlines()
    assert len(lines) == summary["completed"]
    kinds = sorted(json.loads(line)["turn_kind"] for line in lines)
    assert kinds == ["new", "new", "resumed", "resumed"]
    html = (out / "report.html").read_text()
    assert "<table>" in html and ".png" in html
    assert list(out.glob("*.png"))
    assert (out / "report.md").read_text().startswith("### Policies")
    # the bill and the cost policy's calibration, as `kvtier simulate` reports them, and the
    # verdict that ends the run
    profile = document["config"]["cost_profile"]
    assert profile["prefill_token_s"] > 0
    for run in document["runs"]:
        notes = document["config"]["runs"][run["policy"]]
        assert notes["bill"]["prompt_tokens"] == run["summary"]["total_input_tokens"]
        assert set(notes["bill"]["gb_hours"]) >= {"device", "host"}
        assert f"{run['policy']}: bill: recompute" in printed
    prediction = document["config"]["runs"]["cost"]["prediction"]
    assert prediction["predictions"] > 0 and 0 <= prediction["brier"] <= 1
    assert "retain" not in {k for k, v in document["config"]["runs"].items() if "prediction" in v}
    verdict = printed[printed.index("### Verdict: this engine") :].splitlines()
    assert [row.split("|")[1].strip() for row in verdict[4:6]] == ["retain", "cost"]
    # and the sentence under it: two resumed turns per policy are too few to name a winner
    assert verdict[-1].startswith("On this run, ") and "resumed turns fastest" in verdict[-1]
    assert "Too small to call: 2 resumed turns for a policy" in verdict[-1]


@pytest.mark.slow
def test_oracle_needs_tiers(capsys, tmp_path):
    trace = _tiny_trace(tmp_path / "trace.jsonl")
    argv = ["bench", "--workload", str(trace), "--policies", "oracle", "--host-bytes", "0"]
    err = _one_line_error(capsys, argv)
    assert "oracle policy needs tiers" in err


@pytest.mark.slow
def test_oracle_runs_as_a_policy_object(capsys, tmp_path):
    """The oracle is handed to the engine as a built policy (it needs the future); its run is
    labelled oracle and its runner really made decisions."""
    out = tmp_path / "bench"
    trace = _tiny_trace(tmp_path / "trace.jsonl")
    argv = [
        "bench",
        "--workload", str(trace),
        "--policies", "oracle",
        "--kv-cache-bytes", "16MiB",
        "--host-bytes", "16MiB",
        "--no-progress", "--no-plots",
        "--out", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    document = json.loads((out / "results.json").read_text())
    assert [run["policy"] for run in document["runs"]] == ["oracle"]
    stats = document["config"]["runs"]["oracle"]["engine_stats"]
    assert stats["tiers"]["policy"] == "oracle"
    assert sum(stats["tiers"]["policy_runs"].values()) > 0
    assert document["runs"][0]["summary"]["failed"] == 0


def test_progress_off_a_terminal_is_a_line_at_each_tenth_of_the_requests(capsys):
    """A bench run into a log or a pipe (stderr not a terminal, as under pytest) says it
    started and shows it moving, where a rich bar would print nothing until the end."""
    from kvtier.bench.console import Progress as _progress

    with _progress("cost", 25, disabled=False) as advance:
        for _ in range(25):
            advance()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "cost: replaying 25 requests"
    finished = [line.split(" requests")[0] for line in lines[1:]]
    assert finished == [f"cost: {n}/25" for n in (3, 5, 8, 10, 13, 15, 18, 20, 23, 25)]
    assert lines[-1].startswith("cost: 25/25 requests finished, ") and lines[-1].endswith(" s")
    with _progress("cost", 25, disabled=True) as advance:  # --no-progress
        advance()
    assert capsys.readouterr().err == ""


def test_the_command_line_writes_line_by_line_into_a_pipe():
    """Python buffers a pipe's output in blocks; kvtier's commands of minutes must show each
    line as it comes (eval's per-run scores, bench's tables), so the CLI makes it line-buffered."""
    import subprocess
    import sys

    code = (
        "import sys; from kvtier.cli import main; "
        "main(['plan', '--model', 'seed-70b', '--context', '8000']); "
        "print(sys.stdout.line_buffering, file=sys.stderr)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stderr.strip() == "True" and "seed-70b" in result.stdout
