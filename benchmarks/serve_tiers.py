"""Resumed-turn TTFT of `kvtier serve` with the cost policy and a host tier, against the same
server with `--policy retain` (no offload: what the server did before it had tiers), measured
by `kvtier bench --server` on one workload, side by side in one run.

Workload: the `demo` generator preset reshaped so every session opens with a document of
~1.9K tokens and then goes on for up to four more turns (16-token answers, histories of 2.0K to
2.4K tokens). Half the gaps are 2 s follow-ups (continuing turns), half are 45 s pauses
(resumed turns, the server's and the client's threshold being 30 s). Sessions start about
every 7 s. The device pool (`--kv-cache-bytes`, 96 MiB = 4.3K tokens of SmolLM2 in bf16) holds
about two histories, so during a pause the other sessions push an idle one off the device:
with `cost` its KV goes to the host tier and comes back from there; with `retain` it is
dropped and the resumed turn recomputes its history.

Each server runs alone (started, benchmarked, stopped, then the other), with the same flags but
`--policy`, from a cold cache. Both see the same turns at the same trace times (closed loop: a
turn is sent its gap after the previous answer really ended). `--repeats` runs both servers
that many times, alternating which goes first; the table gives the median over repeats of each
repeat's p50 and p99, with the range in brackets. Results: `<out>/repeat<i>/<label>/` holds
each run's results.json, requests-<label>.jsonl and report.md; `<out>/table.md` the table.

    .venv/bin/python benchmarks/serve_tiers.py --threads 1 --repeats 3 --out out/serve_tiers
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from serve_child import start_serve

BIN = Path(sys.executable).parent
WORKLOAD_SETTINGS = [
    "session_rate=0.15",
    "arrival_cv=0.5",
    "mean_turns=5",
    "max_turns=5",
    "followup_share=0.5",
    "followup_median_s=2",
    "followup_sigma=0",
    "pause_median_s=45",
    "pause_sigma=0",
    "apps=1",
    "document_share=1",
    "document_tokens.mean=1900",
    "document_tokens.cv=0.05",
    "document_tokens.min_tokens=1800",
    "document_tokens.max_tokens=2000",
    "answer_tokens.mean=16",
    "answer_tokens.min_tokens=16",
    "answer_tokens.max_tokens=16",
    "max_history_tokens=4096",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each server (medians)")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--kv-cache-bytes", type=int, default=96 << 20, help="device pool (bytes)")
    parser.add_argument("--host-bytes", default="1GiB")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--out", default="out/serve_tiers")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [
        "--threads",
        str(args.threads),
        "--kv-cache-bytes",
        str(args.kv_cache_bytes),
        "--host-bytes",
        args.host_bytes,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--log-level",
        "warning",
    ]
    servers = ["cost", "retain"]
    runs: dict[str, list[dict]] = {label: [] for label in servers}
    for repeat in range(args.repeats):
        # alternate which server goes first: the machine's load drifts over a run
        for label in servers if repeat % 2 == 0 else servers[::-1]:
            folder = out / f"repeat{repeat}" / label
            runs[label].append(bench_one(label, [*common, "--policy", label], args, folder))
    table = render(runs)
    (out / "table.md").write_text(table, encoding="utf-8")
    print(table)


def bench_one(label: str, serve_flags: list[str], args: argparse.Namespace, out: Path) -> dict:
    """Start `kvtier serve`, run `kvtier bench --server` against it, stop it."""
    out.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"serve-{label}.log"
    url, server = start_serve(serve_flags, log)
    try:
        command = [
            str(BIN / "kvtier"),
            "bench",
            "--server",
            url,
            "--server-label",
            label,
            "--workload",
            "demo",
            "--seed",
            str(args.seed),
            f"--workload-set=sessions={args.sessions}",
            *(f"--workload-set={setting}" for setting in WORKLOAD_SETTINGS),
            "--out",
            str(out),
            "--no-progress",
            "--no-plots",
        ]
        print(f"[{label}] kvtier serve {' '.join(serve_flags)}", flush=True)
        started = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        print(f"[{label}] {time.perf_counter() - started:.0f} s", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    document = json.loads((out / "results.json").read_text())
    document["config"]["out"] = str(out)  # where its requests file is
    return document


def render(runs: dict[str, list[dict]]) -> str:
    """Per server: medians over repeats [min-max] of each repeat's TTFT p50 and p99 by turn
    kind; request counts and history sources summed over repeats."""
    header = (
        "| server | done/failed | resumed turns | resumed TTFT p50 ms | resumed TTFT p99 ms "
        "| continuing turns | continuing TTFT p50 ms | continuing TTFT p99 ms "
        "| resumed history from (tokens) |"
    )
    lines = [header, "|" + "---|" * 9]
    for label, documents in runs.items():
        summaries = [d["runs"][0]["summary"] for d in documents]
        sources: dict[str, int] = {}
        for document in documents:
            for source, tokens in resumed_sources(document).items():
                sources[source] = sources.get(source, 0) + tokens
        cells = [
            label,
            f"{sum(s['completed'] for s in summaries)}/{sum(s['failed'] for s in summaries)}",
        ]
        for kind in ("resumed", "continuing"):
            groups = [s["ttft_by_turn_kind"][kind] for s in summaries]
            cells.append(str(sum(g["count"] for g in groups)))
            cells += [_spread([g.get(key) for g in groups]) for key in ("median_ms", "p99_ms")]
        cells.append(", ".join(f"{k} {v:,}" for k, v in sources.items()) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    ratios = []
    for kind in ("resumed", "continuing"):
        pairs = zip(runs["retain"], runs["cost"], strict=True)
        per_repeat = [
            _ttft(retain, kind, "median_ms") / _ttft(cost, kind, "median_ms")
            for retain, cost in pairs
        ]
        ratios.append(
            f"{kind} TTFT p50, retain / cost: {statistics.median(per_repeat):.2f}x "
            f"(per repeat: {', '.join(f'{r:.2f}' for r in per_repeat)})"
        )
    return "\n".join([*lines, "", *ratios]) + "\n"


def _ttft(document: dict, kind: str, key: str) -> float:
    return document["runs"][0]["summary"]["ttft_by_turn_kind"][kind][key]


def _spread(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    if len(known) == 1:
        return f"{known[0]:,.0f}"
    return f"{statistics.median(known):,.0f} [{min(known):,.0f}-{max(known):,.0f}]"


def resumed_sources(document: dict) -> dict[str, int]:
    """Tokens of the resumed turns' histories in one run, summed by source."""
    run = document["runs"][0]
    folder = Path(document["config"]["out"])
    totals: dict[str, int] = {}
    for line in (folder / run["requests_file"]).read_text().splitlines():
        record = json.loads(line)
        if record["turn_kind"] == "resumed" and not record["failed"]:
            for source, tokens in record["restored_tokens"].items():
                totals[source] = totals.get(source, 0) + tokens
    return totals


if __name__ == "__main__":
    main()
