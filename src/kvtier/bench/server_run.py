"""`kvtier bench --server URL`: one run of the workload against a running server, written as
an engine run is (results.json, requests-<label>.jsonl, report.md, report.html).

One run = one server: the policy, tiers and pool measured are the server's, so `--policies`
and `--policy-set` are refused; to compare policies, start one server per policy and run the
benchmark against each (benchmarks/serve_tiers.py does both, one after the other)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from kvtier.errors import KvtierError


def run_server(args: argparse.Namespace) -> int:
    from kvtier.bench.console import Progress, command_line, warn_without_resumed
    from kvtier.bench.http_replay import connect, replay_server
    from kvtier.bench.run_setup import describe_workload, load_workload, run_settings
    from kvtier.workload.model import flatten

    for flag, value in (("--policies", args.policies), ("--policy-set", args.policy_set)):
        if value:
            raise KvtierError(
                f"{flag} does not apply with --server: the server's own policy is measured "
                "(start one server per policy and bench each; see docs/bench.md)"
            )
    started = time.perf_counter()
    resume_after_s = run_settings(args, engine_tiers=False).resume_after_s
    workload = load_workload(args, resume_after_s)
    requests = flatten(workload)
    if not requests:
        raise KvtierError(f"workload {args.workload} holds no requests")
    server = connect(args.server, args.api_key)
    vocab_size = None if all(r.messages for r in requests) else _vocab_size(args.model)
    label = args.server_label or server.base_url
    with Progress(label, len(requests), args.no_progress) as advance:
        result = replay_server(
            server,
            requests,
            label,
            resume_after_s=resume_after_s,
            max_output_tokens=args.max_output_tokens,
            vocab_size=vocab_size,
            on_finish=lambda _record: advance(),
        )
    run = result.run

    from pathlib import Path

    from kvtier.results.report import markdown, to_document, write_html, write_results

    config: dict[str, Any] = {
        "workload": describe_workload(workload, args),
        "requests": len(requests),
        "policies": [label],
        "server": {"url": server.base_url, "model": server.model, "label": label},
        "runs": {
            label: {
                "wall_s": round(result.wall_s, 3),
                "trace_s": round(result.trace_s, 3),
                "idle_skipped_s": 0.0,
            }
        },
    }
    document = to_document("bench", config, [run])
    document["command"] = command_line()
    out = Path(args.out)
    written = write_results(out, document, [run])
    if not args.no_plots:
        written += write_html(out, document, [run])
    print(markdown(document))
    print(f"total {time.perf_counter() - started:.1f} s; wrote " + ", ".join(map(str, written)))
    warn_without_resumed([run], resume_after_s)
    return 0


def _vocab_size(model: str | None) -> int:
    """The vocabulary of the model the synthetic token ids are drawn for (the local copy of
    the server's model: --model, default the embedded SmolLM2)."""
    from kvtier.models import resolve_model_dir

    config = json.loads((resolve_model_dir(model) / "config.json").read_text(encoding="utf-8"))
    return int(config["vocab_size"])
