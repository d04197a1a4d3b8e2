"""Issue #18 for `kvtier bench` and its reports: a workload that cannot fit is refused up front
with one line; failures are shown by reason; `--sessions` keeps sessions that resume; the
README's examples run as written; plots read well; flag spellings follow vLLM."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest

from kvtier import cli
from kvtier.bench.fit import check_fits
from kvtier.results.report import markdown, to_document
from kvtier.results.summary import failed_by_reason
from kvtier.workload.model import Session, Turn, Workload, flatten
from kvtier.workload.source import load_workload
from kvtier.workload.subset import keep_sessions
from tests.host_dtype import BLOCK_BYTES
from tests.results.conftest import hand_run, request

README = Path(__file__).parents[2] / "README.md"


def _bailian(path: Path, rows: list[tuple[int, int, float, int, int]]) -> Path:
    """A length-only trace: (chat id, parent id or -1, time s, prompt tokens, answer tokens)."""
    lines = [
        {"chat_id": chat, "parent_chat_id": parent, "timestamp": t, "input_length": prompt,
         "output_length": answer, "hash_ids": [chat * 100 + i for i in range(prompt // 16)]}
        for chat, parent, t, prompt, answer in rows
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _bench(tmp_path: Path, *flags: str) -> int:
    argv = ["bench", "--policies", "retain", "--no-progress", "--no-plots"]
    return cli.main([*argv, "--out", str(tmp_path / "bench"), *flags])


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("kvtier: error:"), err
    return err


# --- a workload that cannot fit is refused before anything runs


@pytest.mark.slow
def test_a_request_too_big_for_the_pool_is_refused_with_the_size_that_fits(tmp_path, capsys):
    # 600 + 40 tokens = 40 blocks of 16; 8 MiB holds 22 blocks of SmolLM2 in bf16 (360 KiB
    # each), 11 in float32
    trace = _bailian(tmp_path / "t.jsonl", [(1, -1, 0.0, 100, 4), (2, -1, 1.0, 600, 40)])
    assert _bench(tmp_path, "--workload", str(trace), "--kv-cache-bytes", "8MiB") == 2
    err = _one_line_error(capsys)
    assert "the longest request, t-1/0," in err  # the second record's session, turn 0
    held = (8 << 20) // BLOCK_BYTES
    assert "640 tokens" in err and "40 blocks" in err and f"holds {held} blocks" in err
    smallest = re.search(r"--kv-cache-bytes (\d+MiB)", err).group(1)
    assert smallest == f"{math.ceil(40 * BLOCK_BYTES / (1 << 20))}MiB"  # bf16: 15MiB
    assert not (tmp_path / "bench").exists()  # refused before any replay
    # the size it names is enough: every request completes
    assert _bench(tmp_path, "--workload", str(trace), "--kv-cache-bytes", smallest) == 0
    summary = json.loads((tmp_path / "bench" / "results.json").read_text())["runs"][0]["summary"]
    assert (summary["completed"], summary["failed"]) == (2, 0)


def test_a_prompt_beyond_the_model_context_is_refused(tmp_path, capsys):
    trace = _bailian(tmp_path / "t.jsonl", [(1, -1, 0.0, 9000, 4)])
    assert _bench(tmp_path, "--workload", str(trace), "--kv-cache-bytes", "1GiB") == 2
    err = _one_line_error(capsys)
    assert "9,000 tokens, beyond the model's 8,192-token context" in err
    assert "--scale-to-context" in err


def test_failures_are_counted_by_reason_and_shown():
    run = hand_run("offload")
    run.requests += [
        request("s3/0", "new", 4.0, 3012, 0, failed=True, error="prompt has 3012 tokens, "
                "needing 189 KV blocks, but the pool holds 182"),
        request("s4/0", "new", 5.0, 3100, 0, failed=True, error="prompt has 3100 tokens, "
                "needing 195 KV blocks, but the pool holds 182"),
    ]  # fmt: skip
    reasons = failed_by_reason(run.requests)
    pool = "prompt has # tokens, needing # KV blocks, but the pool holds #"
    assert reasons == {
        pool: {"count": 2, "example": run.requests[-2].error},
        "context too long": {"count": 1, "example": "context too long"},
    }
    text = markdown(to_document("bench", {}, [run]))
    assert "### Failed requests by reason" in text
    assert "| offload | 2 | prompt has 3012 tokens, needing 189 KV blocks" in text
    assert "| offload | 1 | context too long |" in text


def test_no_failure_table_when_nothing_failed():
    run = hand_run("offload")
    run.requests = [r for r in run.requests if not r.failed]
    assert "Failed requests" not in markdown(to_document("bench", {}, [run]))


# --- --sessions keeps sessions that come back after a pause; lengths scale after the choice


def _sessions(*specs: tuple[str, list[tuple[float, int, int]]]) -> Workload:
    sessions = [
        Session(name, [Turn(t, prompt, answer) for t, prompt, answer in turns])
        for name, turns in specs
    ]
    return Workload(sessions, source="test")


def test_sessions_with_resumed_turns_are_kept_first_in_trace_order():
    workload = _sessions(
        ("single-a", [(0.0, 50, 8)]),
        ("quick-follow-up", [(1.0, 50, 8), (5.0, 20, 8)]),
        ("single-b", [(2.0, 50, 8)]),
        ("resumed-late", [(3.0, 50, 8), (900.0, 20, 8)]),
        ("resumed-early", [(0.5, 50, 8), (600.0, 20, 8)]),
    )
    kept = keep_sessions(workload, 3, resume_after_s=30.0)
    names = [s.session_id for s in kept.sessions]
    assert names == ["quick-follow-up", "resumed-late", "resumed-early"]  # trace order
    assert "2 have one" in kept.notes[-1]
    assert keep_sessions(workload, 3, 30.0).sessions == kept.sessions  # deterministic
    assert [s.session_id for s in keep_sessions(workload, 1, 30.0).sessions] == ["resumed-late"]


def test_scaling_fits_the_kept_sessions_not_the_whole_trace(tmp_path):
    trace = _bailian(
        tmp_path / "t.jsonl",
        [(1, -1, 0.0, 4000, 10), (2, -1, 1.0, 160, 10), (3, 2, 900.0, 390, 10)],
    )
    workload = load_workload(str(trace), sessions=1, scale_to=200)
    assert [len(s.turns) for s in workload.sessions] == [2]
    assert workload.length_scale == pytest.approx(200 / 400)  # its own longest: 390 + 10
    assert max(r.prompt_tokens + r.output_tokens for r in flatten(workload)) <= 200


@pytest.mark.slow
def test_bench_replays_the_resuming_session_and_warns_when_none_resumes(tmp_path, capsys):
    trace = _bailian(
        tmp_path / "t.jsonl",
        [(1, -1, 0.0, 64, 4), (2, -1, 1.0, 64, 4), (3, 2, 900.0, 96, 4)],
    )
    assert _bench(tmp_path, "--workload", str(trace), "--sessions", "1") == 0
    assert "warning" not in capsys.readouterr().out
    records = (tmp_path / "bench" / "requests-retain.jsonl").read_text().splitlines()
    kinds = [json.loads(line)["turn_kind"] for line in records]
    assert kinds == ["new", "resumed"]

    singles = _bailian(tmp_path / "s.jsonl", [(1, -1, 0.0, 64, 4), (2, -1, 1.0, 64, 4)])
    assert _bench(tmp_path, "--workload", str(singles)) == 0
    assert "warning: no resumed turns in the replay of retain" in capsys.readouterr().out


# --- the bundled sample trace


def test_the_sample_trace_is_bundled_and_found_by_name(tmp_path, monkeypatch, capsys):
    from kvtier.workload.traces import trace_path

    monkeypatch.chdir(tmp_path)  # not the repository: the package's own copy is read
    path = trace_path("sample")
    assert path.is_file() and path.stat().st_size < 200_000
    assert "Apache-2.0" in (path.parent / "README.md").read_text()
    workload = load_workload("sample")
    assert len(workload.sessions) > 500 and workload.source.startswith("mooncake")
    assert cli.main(["analyze", "sample", "--no-plots"]) == 0
    assert "700 / 598" in capsys.readouterr().out  # requests / sessions
    (tmp_path / "sample").write_text("")  # a file of that name wins over the bundled trace
    assert trace_path("sample") == Path("sample")


# --- README examples, as written


def _readme_commands(command: str) -> list[list[str]]:
    """The arguments of every `kvtier COMMAND ...` line of the README (continuations joined,
    comments dropped)."""
    text = README.read_text().replace("\\\n", " ")
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    return [shlex.split(line)[2:] for line in lines if line.startswith(f"kvtier {command} ")]


def test_readme_bench_examples_fit_the_pool_they_name():
    """Each README `kvtier bench` line names a workload that passes the up-front check on the
    engine it configures (running them all is minutes: `kvtier bench` does that)."""
    from kvtier.bench.run_setup import load_workload as bench_workload
    from kvtier.bench.run_setup import run_settings
    from kvtier.engine import Engine, EngineConfig

    examples = _readme_commands("bench")
    assert len(examples) >= 3
    parser = cli.build_parser()
    for argv in examples:
        args = parser.parse_args(["bench", *argv])
        run = run_settings(args)
        engine = Engine(EngineConfig(kv_cache_bytes=run.kv_cache_bytes))
        try:
            workload = bench_workload(args, run.resume_after_s)
            check_fits(engine, flatten(workload), args.max_output_tokens)
        finally:
            engine.close()


def test_readme_analyze_examples_name_files_that_exist(tmp_path, monkeypatch):
    from kvtier.workload.traces import trace_path

    parser = cli.build_parser()
    monkeypatch.chdir(tmp_path)
    traces = [parser.parse_args(["analyze", *argv]).trace for argv in _readme_commands("analyze")]
    assert "sample" in traces
    assert trace_path("sample").is_file()


# --- plots


def test_plots_drop_tiers_that_moved_nothing_and_label_time_in_ms(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvtier.results.plots import log_time_axis, moved_tiers, write_plots

    runs = [hand_run("offload"), hand_run("recompute")]
    document = to_document("bench", {}, runs)
    summaries = {run["policy"]: run["summary"] for run in document["runs"]}
    assert moved_tiers(summaries) == ["host"]  # no disk or remote columns
    paths = write_plots(runs, document, tmp_path)
    assert {p.name for p in paths} >= {"ttft_cdf.png", "bytes_moved.png", "tier_occupancy.png"}
    assert all(p.stat().st_size > 1000 for p in paths)

    # a run with no resumed turn and no tier traffic still gets every figure
    quiet = hand_run("retain")
    quiet.tiers = {}
    quiet.requests = [r for r in quiet.requests if r.turn_kind != "resumed"]
    document = to_document("bench", {}, [quiet])
    summaries = {run["policy"]: run["summary"] for run in document["runs"]}
    assert moved_tiers(summaries) == []
    assert len(write_plots([quiet], document, tmp_path / "quiet")) == len(paths)

    fig, ax = plt.subplots()
    ax.plot([0.004, 0.03, 0.4, 2.5], [0.1, 0.4, 0.8, 1.0])
    log_time_axis(ax)
    fig.canvas.draw()
    low, high = ax.get_xlim()
    labels = [t.get_text() for t in ax.get_xticklabels() if low <= t.get_position()[0] <= high]
    plt.close(fig)
    assert {"10 ms", "100 ms", "1 s"} <= set(labels)
    assert all(re.fullmatch(r"[\d,.]+ (ms|s)", label) for label in labels), labels


# --- flag spellings


def test_vllm_spellings_with_the_old_ones_as_hidden_aliases():
    parser = cli.build_parser()
    old = parser.parse_args(
        ["bench", "--max-batched-tokens", "256", "--num-threads", "1", "--scale-to", "2048"]
    )
    new = parser.parse_args(
        ["bench", "--max-num-batched-tokens", "256", "--threads", "1", "--scale-to-context", "2048"]
    )
    for args in (old, new):
        assert (args.max_num_batched_tokens, args.threads, args.scale_to_context) == (256, 1, 2048)
    assert parser.parse_args(["eval", "--num-threads", "2"]).threads == 2

    bench = next(
        action.choices["bench"]
        for action in parser._actions
        if getattr(action, "choices", None) and "bench" in action.choices
    )
    text = bench.format_help()
    assert "--max-num-batched-tokens" in text and "--scale-to-context" in text
    assert "--max-batched-tokens" not in text and "--num-threads" not in text
    assert not re.search(r"--scale-to\b(?!-)", text)
    assert "3.5 min" not in text
