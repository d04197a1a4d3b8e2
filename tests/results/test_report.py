"""The result files, the Markdown tables and the HTML report render from a hand-made run."""

from __future__ import annotations

import json

import pytest

from kvtier.errors import KvtierError
from kvtier.results.report import markdown, read_results, to_document, write_html, write_results
from tests.results.conftest import hand_run


@pytest.fixture
def runs():
    return [hand_run("offload"), hand_run("recompute")]


def test_results_files_round_trip(tmp_path, runs):
    document = to_document("simulate", {"workload": "hand"}, runs)
    paths = write_results(tmp_path, document, runs)
    assert {p.name for p in paths} == {
        "results.json", "report.md", "requests-offload.jsonl", "requests-recompute.jsonl"
    }  # fmt: skip
    loaded = read_results(tmp_path / "results.json")
    assert loaded == json.loads(json.dumps(document))
    assert [run["policy"] for run in loaded["runs"]] == ["offload", "recompute"]
    lines = (tmp_path / "requests-offload.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[1])["restored_tokens"]["host"] == 1500


def test_markdown_has_a_row_per_policy_and_a_breakdown_each(runs):
    text = markdown(to_document("simulate", {}, runs))
    policies = text.split("### ")[1]  # the first table; the failures table follows it
    assert policies.count("| offload |") == 1 and policies.count("| recompute |") == 1
    assert "### offload: TTFT by turn kind" in text and "### recompute: TTFT" in text
    assert "| resumed from host | 1 | 300.0 |" in text
    assert "200.0 / 200.0 / 298.0" in text  # TTFT mean / p50 / p99 of the hand-made run


def test_html_report_embeds_the_plots(tmp_path, runs):
    paths = write_html(tmp_path, to_document("bench", {}, runs), runs)
    names = {p.name for p in paths}
    assert {"ttft_cdf.png", "itl_p99.png", "tier_occupancy.png", "report.html"} <= names
    page = (tmp_path / "report.html").read_text()
    assert '<img src="ttft_cdf.png"' in page and "<td>offload</td>" in page
    assert all(p.stat().st_size > 1000 for p in paths if p.suffix == ".png")


def test_reading_something_else_is_a_clear_error(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"schema": "kvtier.analyze/1"}))
    with pytest.raises(KvtierError, match="not a kvtier results file"):
        read_results(path)
    with pytest.raises(KvtierError, match="does not exist"):
        read_results(tmp_path / "missing.json")
