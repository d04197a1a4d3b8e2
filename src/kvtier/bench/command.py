"""`kvtier bench`: the same multi-turn workload through the real engine, once per policy.

Each policy gets a fresh engine (same model, KV pool, tiers, concurrency) and the same
requests, replayed in trace time with idle stretches skipped (see docs/bench.md). Writes
results.json (schema kvtier.results/1, the same files `kvtier simulate` writes),
requests-<policy>.jsonl, report.md and, unless --no-plots, report.html with PNG plots.

Examples:
  kvtier bench --quick                                  # a few minutes on 2 CPU cores
  kvtier bench --workload quick --policies retain,cost --kv-cache-bytes 64MiB
  kvtier bench --workload sample --scale-to-context 2048 --sessions 20
  kvtier bench --server http://127.0.0.1:8000 --workload quick   # a running kvtier serve
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.bench.console import Progress, command_line, forms_line, warn_without_resumed
from kvtier.bench.run_setup import BENCH_MAX_NUM_SEQS, DEFAULT_KV_BYTES, QUICK_KV_BYTES
from kvtier.engine.config import DTYPE_HELP, DTYPES
from kvtier.errors import KvtierError
from kvtier.host_cpu import host_cpu
from kvtier.settings.flags import add_config_argument, add_table_arguments
from kvtier.workload.flags import add_hidden_alias, add_workload_arguments

if TYPE_CHECKING:
    pass

DEFAULT_POLICIES = "retain,recompute,offload,cost,oracle"
# --quick leaves out `recompute`: like `retain` there, it recomputes every resumed history
# (seconds each on a CPU), which would add a minute to `make demo` and nothing to its verdict
QUICK_POLICIES = "retain,offload,cost,oracle"
DEFAULT_OUT = "out/bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 7)[7]
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the demo workload (preset `demo`: 2 sessions with ~4K-token histories), 1 thread, "
        f"{QUICK_POLICIES.count(',') + 1} policies ({QUICK_POLICIES.replace(',', ', ')})",
    )
    work = add_workload_arguments(parser, default="quick")
    scale = work.add_argument(
        "--scale-to-context",
        type=int,
        metavar="TOKENS",
        help="shrink every length so the longest prompt + answer fits TOKENS",
    )
    add_hidden_alias(work, scale, "--scale-to")
    work.add_argument(
        "--sessions",
        type=int,
        metavar="N",
        help="replay N sessions, those with resumed turns first (docs/bench.md)",
    )
    pol = parser.add_argument_group("policies")
    pol.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated ({DEFAULT_POLICIES}; with --quick {QUICK_POLICIES})",
    )
    add_config_argument(pol)
    eng = parser.add_argument_group("engine (the same for every policy)")
    eng.add_argument("--model", metavar="DIR", help="model folder (default: embedded SmolLM2)")
    eng.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help=DTYPE_HELP,
    )
    eng.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    threads = eng.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: all cores; 1 with --quick, see docs/bench.md)",
    )
    add_hidden_alias(eng, threads, "--num-threads")
    eng.add_argument(
        "--max-output-tokens", type=int, metavar="N", help="cap every answer at N tokens"
    )
    add_table_arguments(parser, "tiers", aliases={"disk_dir": "--disk-path"})  # older names
    add_table_arguments(
        parser,
        "scheduling",
        defaults={
            "kv_cache_bytes": f"{DEFAULT_KV_BYTES}, {QUICK_KV_BYTES} with --quick, twice that "
            "in float32: small, so idle sessions compete for it",
            "max_num_seqs": str(BENCH_MAX_NUM_SEQS),
        },
        aliases={
            "max_num_batched_tokens": "--max-batched-tokens",
            "session_resume_after_s": "--resume-after",
        },
    )
    add_table_arguments(parser, "policy", skip=("name",))  # --policies names the runs
    add_table_arguments(parser, "compression")
    srv = parser.add_argument_group(
        "a running server instead of the engine (its model, pool, tiers and policy are measured)"
    )
    srv.add_argument(
        "--server",
        metavar="URL",
        help="replay over HTTP against this OpenAI-compatible server, e.g. http://127.0.0.1:8000",
    )
    srv.add_argument(
        "--server-label", metavar="NAME", help="the run's name in the report (default: the URL)"
    )
    srv.add_argument(
        "--api-key", metavar="KEY", help="bearer key sent with every request (the tenant's)"
    )
    out = parser.add_argument_group("output")
    out.add_argument("--out", default=DEFAULT_OUT, help=f"result folder ({DEFAULT_OUT})")
    out.add_argument("--no-plots", action="store_true", help="skip the HTML report and PNGs")
    out.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from kvtier.bench import engines
    from kvtier.bench.run_setup import compression, describe_workload, load_workload, run_settings

    if args.server:
        from kvtier.bench.server_run import run_server

        return run_server(args)
    started = time.perf_counter()
    names = _names(args.policies or (QUICK_POLICIES if args.quick else DEFAULT_POLICIES))
    engines.validate_policies(names)
    setup = run_settings(args)
    settings = setup.settings
    for warning in settings.warnings():
        print(f"kvtier: warning: {warning}", file=sys.stderr, flush=True)
    # each policy's defaults unless a [policy] key was given somewhere
    policy_config = settings.policy if settings.policy_given else None
    workload = load_workload(args, setup.resume_after_s)

    from kvtier.workload.model import flatten

    requests = flatten(workload)
    if not requests:
        raise KvtierError(f"workload {args.workload} holds no requests")
    base = {
        "model_dir": args.model,
        "dtype": args.dtype,
        "device": args.device,
        **setup.scheduling,
        # --quick runs on 1 thread: a 2-thread OpenMP pool stalls whenever anything else
        # needs a core (measured 10x slower prefills), one thread keeps the demo's time bounded.
        "num_threads": 1 if args.quick and args.threads is None else args.threads,
    }
    tiers = settings.tiers
    pipeline, compression_note = compression(args, setup, workload)
    base["compression"] = pipeline
    measured = engines.check_and_measure(base, requests, args.max_output_tokens)
    profile = measured.profile
    if tiers is not None:  # the policies and the restore planner price this engine's prefills
        tiers = dataclasses.replace(tiers, cost_profile=profile)
    results = [_run_policy(args, name, base, tiers, policy_config, requests) for name in names]
    runs = [r.run for r in results]

    from kvtier.results.bill import money_notes
    from kvtier.results.report import markdown, to_document, write_html, write_results
    from kvtier.results.verdict import closing, render, verdict

    config = {
        "workload": describe_workload(workload, args),
        "requests": len(requests),
        "policies": names,
        "engine": {k: v for k, v in base.items() if v is not None and k != "compression"}
        | {"tiers": _tiers(tiers)},
        "compression": compression_note,
        "host_bytes": 0 if tiers is None else tiers.host_bytes,
        "disk_bytes": 0 if tiers is None else tiers.disk_bytes,
        "policy_set": args.policy_set,
        # the measured prefill coefficients (the tier links are the cost model's defaults)
        "cost_profile": {
            name: getattr(profile, name)
            for name in ("prefill_fixed_s", "prefill_token_s", "prefill_pair_s")
        },
        "runs": {
            r.run.policy: {
                "wall_s": round(r.wall_s, 3),
                "trace_s": round(r.trace_s, 3),
                "idle_skipped_s": round(r.skipped_s, 3),
                "engine_stats": r.engine_stats,
            }
            for r in results
        },
    }
    lines = []
    for r in results:
        # the bill and the reuse predictions' calibration, as `kvtier simulate` reports them
        lines += money_notes(
            config["runs"][r.run.policy],
            r.run,
            profile,
            _named_config(policy_config, r.run.policy),
            r.calibration,
        )
    document = to_document("bench", config, runs)
    document["command"] = command_line()
    cpu = host_cpu()  # the engine ran here: its timings are this CPU's
    engine = {"dtype": measured.dtype, "prefill_attention": measured.prefill_attention}
    document["host"] = {"cpu": cpu.as_dict(), "engine": engine}
    out = Path(args.out)
    written = write_results(out, document, runs)
    if not args.no_plots:
        written += write_html(out, document, runs)
    print(markdown(document))
    print(
        f"host: {cpu.describe()}; engine {measured.dtype}, "
        f"prefill attention by {measured.prefill_attention}"
    )
    for r in results:
        print(
            f"{r.run.policy}: {r.wall_s:.1f} s wall for {r.trace_s:,.0f} s of trace "
            f"({r.skipped_s:,.0f} s idle skipped)"
        )
        forms = forms_line(r.engine_stats.get("tiers") or {})
        if forms:
            print(f"{r.run.policy}: stored forms: {forms}")
    print("\n".join(lines))
    print(f"total {time.perf_counter() - started:.1f} s; wrote " + ", ".join(map(str, written)))
    warn_without_resumed(runs, setup.resume_after_s)
    print("\n" + render(verdict(document, "Verdict: this engine")))
    print("\n" + closing(document))
    return 0


def _run_policy(args, name, base, tiers, policy_config, requests):
    from kvtier.bench import engines
    from kvtier.bench.replay import BenchClock, replay, warm_up
    from kvtier.policy.metrics import Calibration
    from kvtier.workload.arrivals import next_arrivals

    arrivals = next_arrivals(requests)
    clock = BenchClock()
    engine = engines.build(base, name, tiers, arrivals, policy_config, clock)
    calibration = Calibration()
    connector = getattr(engine, "connector", None)
    scored = connector is not None and calibration.score(connector.runner.policy)
    try:
        warm_up(engine)
        clock.restart()
        with Progress(name, len(requests), args.no_progress) as advance:
            result = replay(
                engine,
                requests,
                clock,
                name,
                arrivals=arrivals,
                on_finish=lambda _record: advance(),
                max_output_tokens=args.max_output_tokens,
            )
    finally:
        engine.close()
    result.calibration = calibration if scored and calibration.resolved else None
    return result


def _named_config(policy_config: Any, name: str) -> Any:
    """The [policy] settings a run was priced with (its [policy.cost] prices)."""
    from kvtier.policy.config import PolicyConfig

    config = policy_config or PolicyConfig()
    return config.model_copy(update={"name": name})


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise KvtierError("give at least one policy, e.g. --policies retain,cost")
    if len(set(names)) != len(names):
        raise KvtierError(f"--policies names a policy twice: {text}")
    return names


def _tiers(tiers: Any) -> Any:
    if tiers is None:
        return None
    try:
        from dataclasses import asdict

        return asdict(tiers)
    except TypeError:
        dump = getattr(tiers, "model_dump", None)
        return dump() if dump else repr(tiers)
