"""Issue #18, `kvtier simulate`: the README's validation command works as written (the set-up
comes from the bench run), the screen says what is simulated, when the replicas cannot keep up
and why requests failed, and flags have one spelling in --help with the old ones still taken.

`data/bench-demo-2-sessions` is a real `kvtier bench --quick` run, as `make demo` makes one (its
`command` is in results.json): the README's validation command runs against it."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.units import format_bytes

BENCH_RUN = Path(__file__).parent / "data" / "bench-demo-2-sessions"
# the set-up the simulator must take from the run, as the run recorded it
RECORDED = json.loads((BENCH_RUN / "results.json").read_text())["config"]["engine"]
README_VALIDATE = (
    "--workload demo --hardware local-cpu --timer-after-steps --shared-prefixes "
    "--validate --against {against}"
)


def simulate(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def bench_results(tmp_path) -> Path:
    """The bench run copied where a test may write next to it."""
    folder = shutil.copytree(BENCH_RUN, tmp_path / "bench")
    return folder / "results.json"


def readme_validation(tmp_path, bench_results: Path, *extra: str) -> list[str]:
    argv = shlex.split(README_VALIDATE.format(against=bench_results))
    return [*argv, *extra, "--out", str(tmp_path / "sim"), "--no-plots"]


def test_the_readme_validation_takes_the_set_up_from_the_bench_run(tmp_path, capsys, bench_results):
    code, out, err = simulate(capsys, *readme_validation(tmp_path, bench_results))
    assert code == 0, err
    taken = next(line for line in out.splitlines() if line.startswith("set up like"))
    for flag in ("--model smollm2-135m", "--gpus 1",
                 f"--device-kv-bytes {RECORDED['kv_cache_bytes']}",
                 "--max-num-batched-tokens 512", "--max-num-seqs 8", "--policies offload",
                 f"--lengths-from {bench_results}"):  # fmt: skip
        assert flag in taken
    assert "--hardware" not in taken and "--workload " not in taken  # given: kept
    assert "warning: not set up like" not in out  # nothing differs from the bench run
    assert "offload: simulated vs measured" in out
    config = json.loads((tmp_path / "sim" / "results.json").read_text())["config"]
    assert (config["model"], config["hardware"], config["gpus"]) == ("smollm2-135m", "local-cpu", 1)
    assert config["device_kv_bytes"] == RECORDED["kv_cache_bytes"]
    assert config["tier_bytes"] == {"host": RECORDED["tiers"]["host_bytes"]}
    assert config["max_batched_tokens"] == 512 and config["workload_set"] == []
    assert (tmp_path / "sim" / "validation.json").is_file()


def test_the_demo_ends_with_the_verdict_and_the_sentence_on_the_measured_run(
    tmp_path, capsys, bench_results
):
    """`make demo`'s second command: the verdict beside the bench run, then one sentence."""
    code, out, _ = simulate(
        capsys, "--workload", "demo", "--lengths-from", str(bench_results), "--model",
        "llama-3.1-70b", "--hardware", "h100-sxm", "--device-kv-bytes", "1.67GB", "--policies",
        "retain,offload", "--no-plots", "--out", str(tmp_path / "sim"), "--beside",
        str(bench_results),
    )  # fmt: skip
    assert code == 0
    tail = out[out.index("### Verdict: measured here") :].splitlines()
    assert tail[4].startswith("| offload | measured here |")  # the only policy the run had
    assert tail[-1] == (  # one policy measured: no winner to name
        "On the run measured here, fewer than two policies (oracle aside) had resumed turns: "
        "nothing to compare (run two or more policies on a workload whose sessions come back)."
    )


def test_a_flag_given_beats_the_bench_run_and_is_named_as_a_difference(
    tmp_path, capsys, bench_results
):
    argv = readme_validation(tmp_path, bench_results, "--max-num-batched-tokens", "256")
    code, out, _ = simulate(capsys, *argv)
    assert code == 0
    assert "--max-num-batched-tokens" not in out.splitlines()[0]  # not taken from the run
    assert (
        "warning: not set up like" in out and "tokens per step: simulated 256, measured 512" in out
    )


def test_a_missing_bench_run_is_one_line_before_anything_is_simulated(tmp_path, capsys):
    argv = readme_validation(tmp_path, tmp_path / "nothing" / "results.json")
    code, out, err = simulate(capsys, *argv)
    assert code == 2 and out == ""
    assert err == f"kvtier: error: results file {tmp_path}/nothing/results.json does not exist\n"


def test_validating_against_a_run_of_another_workload_is_one_line_before_anything_is_simulated(
    tmp_path, capsys, bench_results
):
    """Running the README in order once validated the demo workload against the `sample`
    run that had last written out/bench: every request missed, and the command exited 0."""
    document = json.loads(bench_results.read_text())
    document["config"]["workload"]["name"] = "sample"  # as `kvtier bench --workload sample`
    bench_results.write_text(json.dumps(document))
    code, out, err = simulate(capsys, *readme_validation(tmp_path, bench_results))
    assert code == 2 and out == ""
    assert err == (
        f"kvtier: error: cannot validate against {bench_results}: it replayed workload "
        "'sample', not 'demo'; point --against at a run of this workload, or leave --workload "
        "and --seed out to take the run's\n"
    )
    assert not (tmp_path / "sim").exists()


def test_validating_against_another_seed_of_the_preset_is_refused_and_the_runs_own_is_taken(
    tmp_path, capsys, bench_results
):
    code, _, err = simulate(capsys, *readme_validation(tmp_path, bench_results, "--seed", "1"))
    assert code == 2 and "it replayed workload 'demo' with --seed 0, not 1" in err
    argv = ["--against", str(bench_results), "--out", str(tmp_path / "sim"), "--no-plots"]
    code, out, _ = simulate(capsys, *argv)  # the run's workload and seed, taken
    assert code == 0 and "--workload demo --seed 0" in out.splitlines()[0]


def test_the_screen_says_what_is_simulated(tmp_path, capsys, bench_results):
    _, out, _ = simulate(capsys, *readme_validation(tmp_path, bench_results))
    setup = out[out.index("simulating") :]
    assert setup.startswith("simulating smollm2-135m (23.0 KB of bf16 KV per token) on 1 x ")
    assert "local-cpu, 1 replica of tensor parallel 1" in setup
    assert f"device KV pool {format_bytes(RECORDED['kv_cache_bytes'])} " in setup
    assert "host 1.07 GB, disk none, remote none" in setup
    assert "8 running requests, 512 tokens per step, chunks of 256 tokens" in setup
    assert "policy timer: after steps; shared prefixes: on" in setup
    # the demo preset's 6 requests, as the stored bench run replayed them
    assert "6 requests in 2 conversations" in setup and "policies: offload" in setup
    assert "overloaded" not in out and "failed" not in out.split("### Policies")[0]


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--device-kv-bytes", "1e400GB", "size '1e400GB' is too large"),
        ("--host-bytes", "1e400TB", "size '1e400TB' is too large"),
        ("--model", "smollm3", "unknown model 'smollm3'"),
    ],
)
def test_bad_sizes_and_models_are_one_line(tmp_path, capsys, flag, value, message):
    code, _, err = simulate(capsys, flag, value, "--out", str(tmp_path), "--no-plots")
    assert code == 2 and err.startswith(f"kvtier: error: {message}") and err.count("\n") == 1


def burst_trace(path: Path) -> Path:
    """Twelve 4,096-token prompts one second apart, and one longer than SmolLM2's 8,192-token
    context: far more prefill than one CPU replica does in 11 s."""
    lines, block = [], 0
    for k, tokens in [(k, 4096) for k in range(12)] + [(5.5, 9000)]:
        ids = list(range(block, block + -(-tokens // 512)))
        block += len(ids)
        lines.append({"timestamp": k * 1000, "input_length": tokens, "output_length": 16,
                      "hash_ids": ids})  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_an_overloaded_replica_and_failed_requests_are_said_on_screen_and_kept(tmp_path, capsys):
    trace = burst_trace(tmp_path / "burst.jsonl")
    out_dir = tmp_path / "sim"
    code, out, _ = simulate(
        capsys, "--workload", str(trace), "--hardware", "local-cpu", "--model", "smollm2",
        "--gpus", "1", "--policies", "recompute", "--out", str(out_dir), "--no-plots",
    )  # fmt: skip
    assert code == 0
    warnings = [line for line in out.splitlines() if line.startswith("warning: recompute:")]
    overload, failure = warnings
    assert "overloaded: requests arrived over 11 s and took" in overload
    assert "prompt tokens/s per replica; a replica prefills about" in overload
    assert failure.startswith("warning: recompute: 1 of 13 requests failed, too long for the model")
    assert "9,016 tokens exceeds the model's context of 8,192" in failure
    note = json.loads((out_dir / "results.json").read_text())["config"]["runs"]["recompute"]
    assert note["overloaded"] and note["overload_ratio"] > 3 and note["trace_span_s"] == 11.0
    assert note["offered_prompt_tokens_s"] > note["prefill_capacity_tokens_s"]
    assert note["failed_by_reason"] == {"too long for the model": 1}


def test_help_shows_one_spelling_and_the_old_ones_still_work(tmp_path, capsys, bench_results):
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    assert "--max-num-batched-tokens" in (shown := capsys.readouterr().out)
    assert "--max-batched-tokens" not in shown and "--format" not in shown
    argv = readme_validation(tmp_path, bench_results, "--max-batched-tokens", "256")
    code, _, _ = simulate(capsys, *argv, "--format", "auto")
    config = json.loads((tmp_path / "sim" / "results.json").read_text())["config"]
    assert code == 0 and config["max_batched_tokens"] == 256


@pytest.mark.parametrize("flag", ["--trace-format", "--format"])
def test_analyze_takes_trace_format_and_its_old_spelling(tmp_path, capsys, flag):
    trace = burst_trace(tmp_path / "burst.jsonl")
    assert main(["analyze", str(trace), flag, "mooncake", "--no-plots"]) == 0
    assert "13 / 13" in capsys.readouterr().out  # requests / sessions
    assert main(["analyze", str(trace), flag, "sharegpt", "--no-plots"]) == 2  # the format named
    assert "missing field 'id'" in capsys.readouterr().err


def test_analyze_help_shows_trace_format_only(capsys):
    with pytest.raises(SystemExit):
        main(["analyze", "--help"])
    shown = capsys.readouterr().out
    assert "--trace-format" in shown and "--format" not in shown


def test_calibrate_takes_the_servers_spelling_of_threads(capsys):
    assert main(["calibrate", "--num-threads", "0"]) == 2  # read as --threads, checked first
    assert capsys.readouterr().err == "kvtier: error: --threads must be at least 1, not 0\n"
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    assert "--num-threads" not in capsys.readouterr().out
