"""`kvtier eval` end to end on the real engine (tiny), and its errors for bad input."""

from __future__ import annotations

import json

import pytest

from kvtier.cli import main
from kvtier.eval.sample import read_jsonl
from tests.host_dtype import AUTO_DTYPE, BLOCK_BYTES


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "niah_single,haystack"], "unknown task(s) 'haystack'"),
        (["--methods", "snapkv,magic"], "unknown compression method 'magic'"),
        (["--ratios", "0,1"], "ratio must be in [0, 1)"),
        (["--ratios", "0,-0.5"], "ratio must be in [0, 1)"),
        (["--ratios", "half"], "--ratios takes comma-separated numbers"),
        (["--lengths", "4x"], "--lengths takes token counts"),
        (["--lengths", "100"], "at least 256 tokens"),
        (["--samples", "0"], "--samples must be >= 1"),
        (["--kv-forms", "int9"], "--kv-forms takes a comma list of int8, int4"),
        (["--tasks", "perplexity", "--kv-forms", "int8"], "--kv-forms scores the RULER tasks"),
    ],
)
def test_bad_input_is_one_clear_error_line(argv, message, capsys, tmp_path):
    assert main(["eval", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: ") and message in err
    assert not any(tmp_path.iterdir())  # rejected before any work


@pytest.mark.slow
def test_tiny_run_with_full_cache_writes_scores_bytes_and_plot(tmp_path, capsys):
    argv = ["eval", "--methods", "full", "--tasks", "niah_single,passkey", "--lengths", "512"]
    argv += ["--samples", "2", "--threads", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    samples = read_jsonl(tmp_path / "samples.jsonl")
    assert len(samples) == 4 and len(doc["samples"]) == 4
    (row,) = doc["summary"]
    assert row["spec"] == "full" and row["num_samples"] == 4
    assert set(row["scores"]) == {"niah_single", "passkey"}
    assert doc["settings"]["dtype"] == AUTO_DTYPE  # what `--dtype auto` ran on this host
    # Full cache: every prompt token's KV is held, in whole 16-token blocks of
    # 2 (K,V) x 30 layers x 3 heads x 64 dims x 2 bytes (bf16), 4 in float32
    bytes_per_block = BLOCK_BYTES
    by_id = {s.sample_id: s for s in samples}
    for result in doc["samples"]:
        prompt = by_id[result["sample_id"]].num_prompt_tokens
        assert result["kv_tokens_held"] == prompt
        assert result["kv_bytes_held"] == -(-prompt // 16) * bytes_per_block
        assert 0.0 <= result["score"] <= 1.0
    # The answers of the full cache on these short prompts: SmolLM2 finds these needles.
    assert row["average"] > 0
    assert (tmp_path / "score_vs_bytes.png").stat().st_size > 0
    table = (tmp_path / "results.md").read_text()
    assert table.startswith("| method | niah_single | passkey | avg |")
    assert "kvtier eval" in capsys.readouterr().out


@pytest.mark.slow
def test_a_press_really_holds_fewer_bytes(tokenizer):
    from kvtier.eval.methods import plan_runs
    from kvtier.eval.runner import RunnerConfig, run_eval
    from kvtier.eval.tasks import generate_samples

    samples = generate_samples(tokenizer, ["niah_single"], [1024], 1, seed=0)
    runs = plan_runs(["streaming_llm"], [0, 0.5])
    result = run_eval(samples, runs, RunnerConfig(num_threads=1))
    full, half = result.samples
    assert (full.spec, half.spec) == ("full", "streaming_llm:0.5")
    assert half.kv_tokens_held <= full.kv_tokens_held // 2 + 16
    assert half.kv_bytes_held < 0.6 * full.kv_bytes_held
    assert [t.spec for t in result.timings] == ["full", "streaming_llm:0.5"]


def test_task_names_match_the_task_registry():
    from kvtier.eval import command
    from kvtier.eval.tasks import TASKS

    assert tuple(TASKS) == command.TASK_NAMES


@pytest.mark.slow
def test_kv_forms_write_figures_the_policy_reads(tmp_path):
    from kvtier.policy.accuracy import load_figures

    argv = ["eval", "--methods", "full", "--kv-forms", "int4", "--tasks", "passkey"]
    argv += ["--lengths", "512", "--samples", "1", "--threads", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "forms.json").read_text())
    by_spec = {
        row["spec"]: row for row in json.loads((tmp_path / "results.json").read_text())["summary"]
    }
    assert set(by_spec) == {"full", "kv:int4"}
    # the INT4 pool held its blocks packed: fewer bytes than the full cache
    assert by_spec["kv:int4"]["kv_bytes_held_mean"] < by_spec["full"]["kv_bytes_held_mean"]
    loss = by_spec["full"]["average"] - by_spec["kv:int4"]["average"]
    assert doc["forms"]["int4"]["loss"] == pytest.approx(loss, abs=1e-3)
    figures = load_figures(tmp_path / "forms.json")
    assert figures.applies_to("smollm2-135m") and set(figures.loss) == {"int4"}
