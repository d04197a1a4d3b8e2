"""`kvtier analyze` end to end: report, JSON, plots, and one clear error for bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvtier import cli
from kvtier.analyze import command
from kvtier.errors import KvtierError
from kvtier.workload import flags
from kvtier.workload.presets import PRESETS
from kvtier.workload.traces import FORMATS

TRACE = Path(__file__).parent / "data" / "tiny_bailian.jsonl"
MOONCAKE = Path(__file__).parents[2].parent / "shared/traces/mooncake_conversation_trace.jsonl"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kvtier analyze")
    command.add_arguments(parser)
    return command.run(parser.parse_args(list(argv)))


def test_report_json_and_plots(tmp_path, capsys):
    out, report = tmp_path / "plots", tmp_path / "report.json"
    assert run(str(TRACE), "--decode-tok-s", "10", "--json", str(report), "--out", str(out)) == 0
    printed = capsys.readouterr().out
    assert "3 (50.0%)" in printed and "2 (33.3%)" in printed  # new, resumed
    data = json.loads(report.read_text())
    assert data["schema"] == "kvtier.analyze/1"
    assert data["turn_kinds"]["continuing"] == {"count": 1, "share": pytest.approx(1 / 6)}
    assert data["gaps_s"]["p50"] == pytest.approx(50.0)
    assert data["turns_per_session"]["histogram"] == {"1": 1, "2": 1, "3": 1}
    assert data["prefix_sharing"]["reused_share"] == pytest.approx(144 / 400)
    assert data["kv"]["model"] == "llama-3.1-70b"
    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == [
        "gaps_cdf.png",
        "history_growth.png",
        "idle_kv.png",
        "turns_per_session.png",
    ]
    for png in pngs:
        assert png.stat().st_size > 5_000
        assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_generated_workload_with_infinite_decode_rate(tmp_path):
    report = tmp_path / "quick.json"
    assert run("--generate", "quick", "--seed", "2", "--decode-tok-s", "inf", "--no-plots",
               "--json", str(report), "--model", "smollm2-135m") == 0  # fmt: skip
    data = json.loads(report.read_text())
    assert data["decode_tok_s"] is None
    assert data["source"] == "generator preset=quick seed=2"
    assert data["kv"]["bytes_per_token"] == 23_040
    assert not (tmp_path / "gaps_cdf.png").exists()


def test_scale_to_context_is_reported(tmp_path, capsys):
    assert run(str(TRACE), "--scale-to-context", "75", "--no-plots") == 0
    assert "lengths scaled by 0.5" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.jsonl"], "trace file not found: missing.jsonl"),
        ([str(TRACE), "--format", "csv"], "unknown trace format 'csv'"),
        ([], "give a trace file or --generate"),
        ([str(TRACE), "--generate", "quick"], "give a trace file or --generate"),
        (["--generate", "huge"], "unknown workload preset 'huge'"),
        ([str(TRACE), "--resume-after", "-1"], "--resume-after must be >= 0"),
        ([str(TRACE), "--decode-tok-s", "0"], "--decode-tok-s must be > 0"),
        ([str(TRACE), "--kv-dtype", "int3"], "unknown dtype 'int3'"),
    ],
)
def test_bad_input_is_one_clear_error(argv, message, tmp_path):
    with pytest.raises(KvtierError, match=message):
        run(*argv, "--out", str(tmp_path))


def test_flag_choices_match_the_workload_package():
    # written out so that building the CLI parser imports neither numpy nor pydantic
    assert ("auto", *FORMATS) == flags.TRACE_FORMATS
    assert tuple(PRESETS) == flags.PRESET_NAMES


def test_building_the_cli_parser_stays_light():
    """`kvtier --help` builds every sub-command's parser: none may import numpy or torch."""
    import subprocess
    import sys

    code = (
        "import sys; from kvtier import cli; cli.build_parser(); "
        "print(sorted(m for m in ('numpy', 'torch', 'pydantic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif("analyze" not in cli.COMMANDS, reason="analyze is not wired into cli yet")
def test_cli_prints_one_line_and_exits_2_on_bad_input(tmp_path, capsys):
    assert cli.main(["analyze", str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvtier: error: trace file not found: {tmp_path / 'missing.jsonl'}"
    )
    assert cli.main(["analyze", str(TRACE), "--no-plots"]) == 0


@pytest.mark.skipif(not MOONCAKE.is_file(), reason=f"real Mooncake trace not at {MOONCAKE}")
def test_real_mooncake_figures(tmp_path):
    report = tmp_path / "mooncake.json"
    assert run(str(MOONCAKE), "--json", str(report), "--no-plots") == 0
    data = json.loads(report.read_text())
    kinds = {kind: value["count"] for kind, value in data["turn_kinds"].items()}
    assert kinds == {"new": 8_056, "continuing": 302, "resumed": 3_673}
    assert data["prefix_sharing"]["reused_share"] == pytest.approx(0.374, abs=0.001)
