"""`kvtier bench --server URL`: the workload replayed over HTTP against a real `kvtier serve`,
written as an engine run is, with the restore sources the server reports."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from kvtier.workload.model import flatten
from kvtier.workload.source import load_workload
from tests.server.serve_process import BIN, SMALL_POOL, ServeProcess, metric

pytestmark = pytest.mark.slow

# Four short chat sessions of up to two turns, each turn 3 s after the previous answer:
# the other sessions' turns push an idle session out of the 16-block device pool meanwhile.
WORKLOAD = [
    "--workload",
    "demo",
    *(
        f"--workload-set={setting}"
        for setting in (
            "sessions=4",
            "session_rate=5",
            "mean_turns=2",
            "max_turns=2",
            "followup_share=0",
            "pause_median_s=3",
            "pause_sigma=0",
            "document_share=0",
            "system_prompt_tokens=32",
            "user_tokens.mean=70",
            "user_tokens.min_tokens=50",
            "user_tokens.max_tokens=90",
            "answer_tokens.mean=8",
            "answer_tokens.min_tokens=8",
            "answer_tokens.max_tokens=8",
        )
    ),
    # the client calls a turn resumed after 1 s (the server's own rule says 30 s)
    "--resume-after",
    "1",
]


def workload_requests() -> int:
    settings = [a.split("=", 1)[1] for a in WORKLOAD if a.startswith("--workload-set=")]
    workload = load_workload("demo", settings=settings, resume_after_s=1)
    return len(flatten(workload))


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [str(BIN / "kvtier"), "bench", "--no-progress", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=os.environ, timeout=600)


def run_against(server: ServeProcess, out: Path, label: str) -> tuple[dict, list[dict]]:
    done = bench("--server", server.base_url, "--server-label", label, "--out", str(out), *WORKLOAD)
    assert done.returncode == 0, done.stderr
    document = json.loads((out / "results.json").read_text())
    lines = (out / f"requests-{label}.jsonl").read_text().splitlines()
    return document, [json.loads(line) for line in lines]


def test_resumed_turns_show_the_host_tier_the_server_restored_from(tmp_path: Path):
    server = ServeProcess(tmp_path / "serve.log", *SMALL_POOL, "--host-bytes", "64MiB").start()
    try:
        document, records = run_against(server, tmp_path / "out", "cost-host")
        metrics = server.metrics()
    finally:
        server.stop()
    run = document["runs"][0]
    assert run["policy"] == "cost-host"
    assert document["config"]["server"]["url"] == server.base_url
    assert len(records) == workload_requests()
    assert run["summary"]["completed"] == len(records)
    assert all(r["output_tokens"] == 8 and r["first_token_s"] is not None for r in records)
    resumed = [r for r in records if r["turn_kind"] == "resumed"]
    assert resumed
    host = sum(r["restored_tokens"].get("host", 0) for r in resumed)
    assert host > 0, [r["restored_tokens"] for r in resumed]
    # the split is the server's own count: the same tokens its metrics say it restored
    restored = metric(metrics, "kvtier:prompt_tokens_by_source_total", source="host")
    assert restored == sum(r["restored_tokens"].get("host", 0) for r in records)
    assert (tmp_path / "out/report.html").is_file()


def test_without_tiers_the_resumed_history_is_recomputed(tmp_path: Path):
    flags = ["--host-bytes", "0", "--policy", "retain"]
    server = ServeProcess(tmp_path / "serve.log", *SMALL_POOL, *flags).start()
    try:
        document, records = run_against(server, tmp_path / "out", "retain")
    finally:
        server.stop()
    assert document["runs"][0]["summary"]["completed"] == workload_requests()
    resumed = [r for r in records if r["turn_kind"] == "resumed"]
    assert resumed
    assert all(set(r["restored_tokens"]) <= {"device", "recomputed"} for r in records)
    # the earlier prompt + answer that the device no longer held was computed again
    assert sum(r["restored_tokens"].get("recomputed", 0) for r in resumed) > 0


def test_a_server_that_is_not_there_is_one_error_line(tmp_path: Path):
    with socket.socket() as probe:  # a port nothing listens on once it is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = bench("--server", f"http://127.0.0.1:{port}", "--out", str(tmp_path), *WORKLOAD)
    assert done.returncode == 2
    assert done.stderr.startswith(
        f"kvtier: error: cannot reach the server at http://127.0.0.1:{port}"
    )
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "results.json").exists()


def test_policies_are_the_servers_own(tmp_path: Path):
    done = bench("--server", "http://127.0.0.1:8000", "--policies", "retain,cost")
    assert done.returncode == 2
    assert done.stderr.startswith("kvtier: error: --policies does not apply with --server")


def test_a_request_the_server_refuses_is_a_failed_record_and_the_rest_go_on(tmp_path: Path):
    # first turns have at most 120 prompt tokens, second turns (history resent) 170 or more
    flags = ["--host-bytes", "0", "--max-prompt-tokens", "150"]
    server = ServeProcess(tmp_path / "serve.log", *SMALL_POOL, *flags).start()
    try:
        document, records = run_against(server, tmp_path / "out", "limited")
    finally:
        server.stop()
    assert len(records) == workload_requests()
    failed = [r for r in records if r["failed"]]
    assert failed and all(r["turn_index"] == 1 for r in failed)
    assert all("HTTP 400: prompt has" in r["error"] for r in failed)
    assert all(r["output_tokens"] == 8 for r in records if r["turn_index"] == 0)
    summary = document["runs"][0]["summary"]
    assert (summary["completed"], summary["failed"]) == (len(records) - len(failed), len(failed))
    assert "Failed requests by reason" in (tmp_path / "out/report.md").read_text()
