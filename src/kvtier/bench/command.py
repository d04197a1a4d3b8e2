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
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import KvtierError
from kvtier.workload.flags import add_hidden_alias, add_workload_arguments

if TYPE_CHECKING:
    from kvtier.results.records import RunRecords
    from kvtier.workload.model import Workload

DEFAULT_POLICIES = "retain,recompute,offload,cost,oracle"
# --quick leaves out `recompute`: like `retain` there, it recomputes every resumed history
# (seconds each on a CPU), which would add a minute to `make demo` and nothing to its verdict
QUICK_POLICIES = "retain,offload,cost,oracle"
DEFAULT_OUT = "out/bench"
DEFAULT_KV_BYTES = "64MiB"
# --quick: the demo's two ~4.3K-token histories do not both fit (5.1K tokens of SmolLM2)
QUICK_KV_BYTES = "112MiB"


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
    pol.add_argument(
        "--policy-set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="set a [policy] key for every run, e.g. interval_s=2 (repeatable)",
    )
    pol.add_argument(
        "--config", metavar="PATH", help="kvtier.toml ([policy] and [compression] tables)"
    )
    eng = parser.add_argument_group("engine (the same for every policy)")
    eng.add_argument("--model", metavar="DIR", help="model folder (default: embedded SmolLM2)")
    eng.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    eng.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    eng.add_argument(
        "--kv-cache-bytes",
        metavar="SIZE",
        help="device KV pool; small so idle sessions compete for it "
        f"({DEFAULT_KV_BYTES}; {QUICK_KV_BYTES} with --quick)",
    )
    eng.add_argument("--host-bytes", default="1GiB", metavar="SIZE", help="host tier (1GiB)")
    eng.add_argument("--disk-bytes", default="0", metavar="SIZE", help="disk tier (0: none)")
    eng.add_argument("--disk-path", metavar="DIR", help="disk tier folder")
    eng.add_argument(
        "--write-through",
        nargs="?",
        const=True,
        default=False,
        choices=("selective",),
        metavar="selective",
        help="copy each finished turn's full chunks to the top tier at once; `selective`: "
        "only the chunks its prompt reused (docs/tiers.md)",
    )
    eng.add_argument(
        "--keep-moved",
        action="store_true",
        help="a chunk a policy moves off the device keeps its blocks, hittable, until the "
        "pool needs them (tiers.keep_moved; docs/tiers.md)",
    )
    eng.add_argument(
        "--restore-pipeline",
        choices=("chunk", "layer"),
        default="chunk",
        help="restore disk chunks whole before the forward (chunk, default) or a layer at a "
        "time beside it (layer; docs/tiers.md)",
    )
    eng.add_argument("--max-num-seqs", type=int, default=8, help="running requests (8)")
    batched = eng.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="tokens per step (512)"
    )
    add_hidden_alias(eng, batched, "--max-batched-tokens")
    threads = eng.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: all cores; 1 with --quick, see docs/bench.md)",
    )
    add_hidden_alias(eng, threads, "--num-threads")
    eng.add_argument(
        "--resume-after", type=float, default=30.0, help="gap (s) that makes a turn resumed"
    )
    eng.add_argument(
        "--max-output-tokens", type=int, metavar="N", help="cap every answer at N tokens"
    )
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

    if args.server:
        from kvtier.bench.server_run import run_server

        return run_server(args)
    started = time.perf_counter()
    names = _names(args.policies or (QUICK_POLICIES if args.quick else DEFAULT_POLICIES))
    engines.validate_policies(names)
    policy_config = _policy_config(args) if (args.policy_set or args.config) else None
    kv_bytes = kv_cache_bytes(args)
    host_bytes = _size(args.host_bytes)
    disk_bytes = _size(args.disk_bytes)
    workload = load_workload(args)

    from kvtier.workload.model import flatten

    requests = flatten(workload)
    if not requests:
        raise KvtierError(f"workload {args.workload} holds no requests")
    base = {
        "model_dir": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "kv_cache_bytes": kv_bytes,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        # --quick runs on 1 thread: a 2-thread OpenMP pool stalls whenever anything else
        # needs a core (measured 10x slower prefills), one thread keeps the demo's time bounded.
        "num_threads": 1 if args.quick and args.threads is None else args.threads,
        "session_resume_after_s": args.resume_after,
    }
    tiers = engines.tiers_config(
        host_bytes,
        disk_bytes,
        args.disk_path,
        args.write_through,
        args.restore_pipeline,
        keep_moved=args.keep_moved,
    )
    compression, compression_note = _compression(args, workload, kv_bytes)
    base["compression"] = compression
    profile = engines.check_and_measure(base, requests, args.max_output_tokens)
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
        "host_bytes": host_bytes,
        "disk_bytes": disk_bytes,
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
    document["command"] = "kvtier bench " + " ".join(shlex.quote(a) for a in _argv())
    out = Path(args.out)
    written = write_results(out, document, runs)
    if not args.no_plots:
        written += write_html(out, document, runs)
    print(markdown(document))
    for r in results:
        print(
            f"{r.run.policy}: {r.wall_s:.1f} s wall for {r.trace_s:,.0f} s of trace "
            f"({r.skipped_s:,.0f} s idle skipped)"
        )
        forms = _forms_line(r.engine_stats.get("tiers") or {})
        if forms:
            print(f"{r.run.policy}: stored forms: {forms}")
    print("\n".join(lines))
    print(f"total {time.perf_counter() - started:.1f} s; wrote " + ", ".join(map(str, written)))
    _warn_without_resumed(runs, args.resume_after)
    print("\n" + render(verdict(document, "Verdict: this engine")))
    print("\n" + closing(document))
    return 0


def _forms_line(tiers: dict[str, Any]) -> str | None:
    """Blocks restored per quantized form and the encodes behind them (None: none), from the
    connector's stats: what `[policy] max_accuracy_loss` let the policy choose."""
    # imported here: kvtier.tiers pulls in torch, and building the CLI parser must not
    from kvtier.tiers.vocab import FORMS, FULL

    counters = tiers.get("counters", {})
    # the connector counts all restored blocks, and those of each lossy form apart
    lossy = {form: counters.get(f"restored_blocks_{form}", 0) for form in FORMS if form != FULL}
    lossy = {form: n for form, n in lossy.items() if n}
    restored = {FULL: counters.get("restored_blocks", 0) - sum(lossy.values()), **lossy}
    recodes = tiers.get("recodes", {})
    if len(restored) == 1 and not recodes:
        return None
    blocks = " / ".join(f"{form} {n:,}" for form, n in restored.items())
    encoded = "; ".join(
        f"{name} {r['ops']:,} chunks, {r['seconds']:.2f} s on the mover's worker"
        for name, r in recodes.items()
    )
    return f"blocks restored from tiers: {blocks}; encoded: {encoded or 'none'}"


def _warn_without_resumed(runs: Sequence[RunRecords], resume_after_s: float) -> None:
    """Resumed turns are where policies differ; a replay without any compares nothing."""
    without = [run.policy for run in runs if all(r.turn_kind != "resumed" for r in run.requests)]
    if without:
        print(
            f"warning: no resumed turns in the replay of {', '.join(without)}: no session came "
            f"back after more than {resume_after_s:g} s, so no turn needed the paused KV the "
            "policies decide about (replay more sessions, or pick them with --sessions N)"
        )


def _run_policy(args, name, base, tiers, policy_config, requests):
    from kvtier.bench import engines
    from kvtier.bench.replay import BenchClock, next_arrivals, replay, warm_up
    from kvtier.policy.metrics import Calibration

    arrivals = next_arrivals(requests)
    clock = BenchClock()
    engine = engines.build(base, name, tiers, arrivals, policy_config, clock)
    calibration = Calibration()
    connector = getattr(engine, "connector", None)
    scored = connector is not None and calibration.score(connector.runner.policy)
    try:
        warm_up(engine)
        clock.restart()
        with _progress(name, len(requests), args.no_progress) as advance:
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


class _progress:
    """Requests finished, on stderr: a rich progress bar on a terminal; elsewhere (a log file,
    a pipe, CI) a plain line when the run starts, at each tenth of its requests and at its
    end, so a run of minutes is seen to move. Nothing with --no-progress."""

    def __init__(self, name: str, total: int, disabled: bool) -> None:
        self.name, self.total, self.disabled = name, total, disabled
        self.bar: Any = None

    def __enter__(self):
        if self.disabled:
            return lambda: None
        from rich.console import Console

        if not Console(stderr=True).is_terminal:
            return self._lines()
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bar = Progress(
            TextColumn(f"{self.name:>10}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        )
        self.bar.start()
        task = self.bar.add_task(self.name, total=self.total)
        return lambda: self.bar.advance(task)

    def _lines(self):
        name, total, started = self.name, self.total, time.perf_counter()
        print(f"{name}: replaying {total:,} requests", file=sys.stderr, flush=True)
        done = 0

        def advance() -> None:
            nonlocal done
            done += 1
            if done * 10 // total > (done - 1) * 10 // total:  # a tenth crossed, or the end
                seconds = time.perf_counter() - started
                print(
                    f"{name}: {done:,}/{total:,} requests finished, {seconds:,.0f} s",
                    file=sys.stderr,
                    flush=True,
                )

        return advance

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def kv_cache_bytes(args: argparse.Namespace) -> int:
    """The device pool the flags ask for (`--kv-cache-bytes`, else --quick's or the default)."""
    from kvtier.plan.units import parse_size

    return parse_size(args.kv_cache_bytes or (QUICK_KV_BYTES if args.quick else DEFAULT_KV_BYTES))


def load_workload(args: argparse.Namespace) -> Workload:
    """The workload the flags describe: --quick (the `demo` preset), a generator preset, or a
    trace file."""
    from kvtier.workload.source import load_workload as load

    return load(
        "demo" if args.quick else args.workload,
        settings=args.workload_set,
        trace_format=args.trace_format,
        seed=args.seed,
        scale_to=args.scale_to_context,
        sessions=args.sessions,
        resume_after_s=args.resume_after,
    )


def describe_workload(workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "name": "demo" if args.quick else args.workload,
        "source": workload.source,
        "sessions": len(workload.sessions),
        "turns": workload.num_turns,
        "seed": args.seed,
        "workload_set": list(args.workload_set),
        "length_scale": workload.length_scale,
        "max_history_tokens": workload.max_history_tokens,
        "notes": list(workload.notes),
        "input_errors": len(workload.errors),
    }


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise KvtierError("give at least one policy, e.g. --policies retain,cost")
    if len(set(names)) != len(names):
        raise KvtierError(f"--policies names a policy twice: {text}")
    return names


def _size(text: str) -> int:
    from kvtier.plan.units import parse_size

    text = text.strip()
    return 0 if text == "0" else parse_size(text)


def _policy_config(args: argparse.Namespace) -> Any:
    from kvtier.policy.config import CONFIG_ENV, load_config

    path = args.config or os.environ.get(CONFIG_ENV)
    return load_config(path, env=os.environ, settings=args.policy_set)


def _compression(
    args: argparse.Namespace, workload: Workload, kv_bytes: int
) -> tuple[Any, dict[str, Any] | None]:
    """The [compression] table of the config file (same file as [policy]) as the engine's
    pipeline, with `preset = "auto"` resolved from this workload and the device KV budget;
    and what the results record about it (None: no compression configured)."""
    from kvtier.policy.config import CONFIG_ENV, load_compression

    section = load_compression(args.config or os.environ.get(CONFIG_ENV))
    choice = None
    if section.is_auto:
        from kvtier.bench.auto_compression import choose_for_workload
        from kvtier.models import resolve_model_dir
        from kvtier.plan.geometry import load_geometry

        geometry = load_geometry(str(resolve_model_dir(args.model)))
        kv_dtype = "fp32" if args.dtype == "float32" else "bf16"
        choice = choose_for_workload(
            workload, geometry, kv_bytes, kv_dtype=kv_dtype, resume_after_s=args.resume_after
        )
        print(f"compression auto -> {choice}")
    from kvtier.calibration.lowrank import with_fitted_bases

    compression = with_fitted_bases(section.build(choice))
    if compression is None and choice is None:
        return None, None
    note = section.model_dump(exclude_none=True)
    note["pipeline"] = None if compression is None else compression.model_dump()
    if choice is not None:
        note["auto"] = {"preset": choice.preset, "method": choice.method, "reason": choice.reason}
    return compression, note


def _tiers(tiers: Any) -> Any:
    if tiers is None:
        return None
    try:
        from dataclasses import asdict

        return asdict(tiers)
    except TypeError:
        dump = getattr(tiers, "model_dump", None)
        return dump() if dump else repr(tiers)


def _argv() -> list[str]:
    argv = sys.argv[1:]
    return argv[1:] if argv and argv[0] == "bench" else argv
