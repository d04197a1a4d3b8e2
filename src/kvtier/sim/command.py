"""`kvtier simulate`: the benchmark's workload and policy code on a hardware profile, at scale,
in simulated time. Writes the same result files as `kvtier bench`.

Examples:
  kvtier simulate --workload default --policies retain,recompute,offload,cost,oracle
  kvtier simulate --hardware h200 --gpus 8 --model llama-3.1-70b --device-kv-bytes 200GB \\
      --host-bytes 1TB --disk-bytes 4TB --out out/simulate
  kvtier simulate --workload trace.jsonl --trace-format mooncake --policies offload,cost
  kvtier simulate --workload default --workload-set sessions=10000 --workload-set mean_turns=10
  kvtier simulate sweep --resume-shares 0.2,0.8 --contexts 4000,32000 --hardware h100-sxm,l40s \\
      --device-kv-bytes 40GB --host-bytes 256GB
  kvtier simulate seeds --workload multiclass --seeds 0-9 --policies retain,offload,ttl,cost
  kvtier simulate --workload demo --hardware local-cpu --timer-after-steps --shared-prefixes \\
      --validate --against out/bench/results.json  # set up like that bench run, compare
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import KvtierError
from kvtier.settings.flags import add_config_argument, add_table_arguments
from kvtier.workload.flags import add_workload_arguments

if TYPE_CHECKING:
    from kvtier.policy.config import PolicyConfig
    from kvtier.sim.deployment import Deployment
    from kvtier.workload.model import Request, Workload

DEFAULT_OUT = "out/simulate"
# [tiers] keys a simulated replica has no use for: it models tiers by size and link alone
_NOT_SIMULATED = (
    "disk_dir",
    "remote_url",
    "remote_cluster",
    "encrypt",
    "encrypt_key_file",
    "create_key",
    "restore_pipeline",
)
# The flags that describe what is simulated, and their defaults. They parse to None when not
# given: a validation (--against) takes them from the bench run instead (validation.setup_from).
DEFAULTS: dict[str, Any] = {
    "workload": "default",
    "seed": 0,
    "workload_set": [],
    "policies": "retain,recompute,offload,cost",
    "policy_set": [],
    "hardware": "h100-sxm",
    "gpus": 8,
    "tp": 0,
    "model": "llama-3.1-70b",
    "device_kv_bytes": None,
    "host_bytes": "1TB",
    "disk_bytes": "0",
    "remote_bytes": "0",
    "chunk_tokens": 256,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "session_resume_after_s": 30.0,
    "timer_after_steps": False,
    "shared_prefixes": False,
    "write_through": False,
    "keep_moved": False,
    "lengths_from": None,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 3)[3]
    parser.add_argument(
        "action",
        nargs="?",
        default="run",
        choices=("run", "sweep", "seeds"),
        help="run (default), sweep, or seeds (the same run at several workload seeds)",
    )
    add_workload_arguments(parser, default=DEFAULTS["workload"])
    pol = parser.add_argument_group("policies")
    pol.add_argument(
        "--policies",
        help=f"comma-separated, one run each; oracle knows the future ({DEFAULTS['policies']})",
    )
    add_config_argument(pol)
    hw = parser.add_argument_group(
        "deployment (budgets are per replica; with --against, what is not given is the bench run's)"
    )
    hw.add_argument(
        "--hardware",
        metavar="NAME|PATH",
        help="hardware profile, bundled name or file; sweep: comma-separated "
        f"(default {DEFAULTS['hardware']}; with --against: local-cpu)",
    )
    hw.add_argument(
        "--link",
        metavar="TIER=LINK",
        action="append",
        default=[],
        help="put a tier on another link, e.g. disk=nvme4 (pcie4/5, nvme4/5, 100gbe, 400gbe)",
    )
    hw.add_argument("--gpus", type=int, help=f"GPUs in all (default {DEFAULTS['gpus']})")
    hw.add_argument("--tp", type=int, help="GPUs per replica (default: all)")
    hw.add_argument("--model", help=f"bundled model or config.json (default {DEFAULTS['model']})")
    hw.add_argument(
        "--device-kv-bytes",
        metavar="SIZE",
        help="device KV pool (default: 90%% of GPU memory minus the weights)",
    )
    hw.add_argument(
        "--timer-after-steps",
        action=argparse.BooleanOptionalAction,
        help="run the policy timer only after engine steps, as kvtier's engine does (validation)",
    )
    hw.add_argument(
        "--shared-prefixes",
        action=argparse.BooleanOptionalAction,
        help="let a new conversation reuse leading blocks other conversations computed, as the "
        "engine's prefix cache does (system prompts; validation)",
    )
    # The same [tiers] and [scheduling] flags as serve and bench, less what a simulated
    # replica has no use for; sizes default to the data-centre node being simulated.
    add_table_arguments(
        parser,
        "tiers",
        skip=_NOT_SIMULATED,
        defaults={
            "host_bytes": f"{DEFAULTS['host_bytes']}: the simulated node's, not this machine's",
            "disk_bytes": "0: none",
            "remote_bytes": "0: none",
        },
    )
    add_table_arguments(
        parser,
        "scheduling",
        # --device-kv-bytes; the model's context; rounding and kernels, which a simulator
        # does not model
        skip=("kv_cache_bytes", "max_model_len", "deterministic", "prefill_attention"),
        defaults={
            "max_num_seqs": str(DEFAULTS["max_num_seqs"]),
            "max_num_batched_tokens": str(DEFAULTS["max_num_batched_tokens"]),
        },
        aliases={
            "max_num_batched_tokens": "--max-batched-tokens",
            "session_resume_after_s": "--resume-after",
        },
    )
    add_table_arguments(parser, "policy", skip=("name",))  # --policies names the runs
    sw = parser.add_argument_group("sweep")
    sw.add_argument("--resume-shares", default="0.2,0.8", help="share of returns that pause")
    sw.add_argument("--contexts", default="4000,32000", help="document tokens per session")
    sw.add_argument("--sessions", type=int, default=60, help="sessions per sweep cell (60)")
    sd = parser.add_argument_group("seeds")
    sd.add_argument(
        "--seeds", default="0-4", help="workload seeds, e.g. 0-9 or 0,3,7 (default 0-4)"
    )
    out = parser.add_argument_group("output")
    out.add_argument("--out", default=DEFAULT_OUT, help=f"result folder ({DEFAULT_OUT})")
    out.add_argument("--no-plots", action="store_true", help="skip the HTML report and PNGs")
    out.add_argument(
        "--validate", action="store_true", help="compare with a real run (needs --against)"
    )
    out.add_argument(
        "--against",
        metavar="PATH",
        help="results.json of a `kvtier bench` run: compare with it, set up like it",
    )
    out.add_argument(
        "--beside",
        metavar="PATH",
        help="end with a verdict of this run beside a `kvtier bench` run's (its results.json)",
    )
    out.add_argument(
        "--lengths-from",
        metavar="PATH",
        help="replay the prompt/output lengths a bench run recorded (its results.json; "
        "default with --against: that run's)",
    )
    parser.set_defaults(**dict.fromkeys(DEFAULTS))  # None = not given (the group's too)


def run(args: argparse.Namespace) -> int:
    if args.validate and not args.against:
        raise KvtierError("--validate needs --against PATH (a kvtier bench results.json)")
    if args.action == "seeds" and (args.against or args.lengths_from):
        raise KvtierError("simulate seeds takes neither --against nor --lengths-from")
    measured = _settle(args)
    if args.action == "sweep":
        return _sweep(args)
    if args.action == "seeds":
        return _seeds(args)
    from kvtier.results.bill import money_notes
    from kvtier.results.report import (
        markdown,
        read_results,
        to_document,
        write_html,
        write_results,
    )
    from kvtier.sim.console import load_of, run_note, run_warnings, setup_lines
    from kvtier.sim.simulator import simulate
    from kvtier.sim.step_model import StepModel

    requests = _requests(args, measured.get("config") if measured else None)
    histories = None
    if args.lengths_from:
        from kvtier.sim.validation import measured_lengths

        histories = {rid: h for rid, (_, _, h) in measured_lengths(args.lengths_from).items()}
    deployment = _deployment(args, args.hardware)
    names = _names(args.policies)
    print("\n".join(setup_lines(deployment, requests, names)))
    if "cost" in names:
        budget = _policy_config(args, "cost").form_budget()
        note = f" ({budget.note})" if budget.note else ""
        print(f"cost: stored forms allowed on disk/remote: {', '.join(budget.allowed)}{note}")
    runs, notes, warnings = [], {}, []
    for name in names:
        result = simulate(requests, deployment, _policy_config(args, name), histories)
        runs.append(result.run)
        print(
            f"{name}: {len(requests):,} requests, {result.events:,} events and "
            f"{result.steps:,} steps in {result.wall_s:.1f} s ({result.events / result.wall_s:,.0f}"
            f" events/s; policy {result.policy_s:.1f} s, {result.policy_s / result.wall_s:.0%} of"
            f" it), {result.run.duration_s:,.0f} s "
            "simulated"
        )
        load = load_of(result.run, requests, deployment)
        notes[name] = run_note(result.run, load)
        for line in money_notes(
            notes[name],
            result.run,
            StepModel(deployment.profile, deployment.geometry, deployment.tp).cost_profile(),
            _policy_config(args, name),
            result.calibration,
            deployment.tp,
        ):
            print(line)
        if result.forms.get("codec_s"):
            print(f"{name}: stored forms: {_forms_line(result.forms)}")
            notes[name]["forms"] = result.forms
        warnings += run_warnings(result.run, load)
    config = {
        "workload": args.workload,
        "workload_set": args.workload_set,
        "lengths_from": args.lengths_from,
        "seed": args.seed,
        "requests": len(requests),
        "policy_set": args.policy_set,
        **deployment.describe(),
        "runs": notes,
    }
    document = to_document("simulate", config, runs)
    out = Path(args.out)
    written = write_results(out, document, runs)
    if not args.no_plots:
        written += write_html(out, document, runs)
    print(markdown(document))
    print("\n".join(warnings), end="\n" if warnings else "")
    if measured is not None:
        written.append(_validate(document, measured, args.against, out))
    print("wrote " + ", ".join(str(p) for p in written))
    if args.beside:
        from kvtier.results.verdict import closing, render, side_by_side

        labels = ("measured here", f"{args.model} on {args.hardware}, simulated")
        beside = read_results(args.beside)
        print("\n" + render(side_by_side(beside, document, labels)))
        print("\n" + closing(beside, "the run measured here"))
    return 0


def _settle(args: argparse.Namespace) -> dict[str, Any] | None:
    """Give every set-up flag left out its value: the bench run's with --against (said on one
    line), else the default. Returns the bench results validated against, if any; refuses
    them when they are of another workload (or seed of the preset) than the one simulated."""
    measured, taken = None, {}
    if args.against:
        from kvtier.results.report import read_results
        from kvtier.sim.validation import other_workload, setup_from

        measured = read_results(args.against)
        taken = {
            key: value
            for key, value in setup_from(measured.get("config"), args.against).items()
            if getattr(args, key) is None
        }
    configured = _configured(args)
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, taken.get(key, configured.get(key, default)))
    if measured is not None:
        problem = other_workload(args.workload, args.seed, measured.get("config"))
        if problem:
            raise KvtierError(
                f"cannot validate against {args.against}: {problem}; point --against at a run "
                "of this workload, or leave --workload and --seed out to take the run's"
            )
    if taken:
        flags = " ".join(filter(None, (_flag(key, value) for key, value in taken.items())))
        print(f"set up like {args.against}: {flags}")
    return measured


def _configured(args: argparse.Namespace) -> dict[str, Any]:
    """The set-up keys the config file, the environment or --tiers-set / --scheduling-set give
    (the flags themselves are on `args` already), as DEFAULTS' keys."""
    from kvtier.settings.flags import from_args
    from kvtier.settings.load import DEFAULT_ORIGIN

    settings = from_args(args, ("tiers", "scheduling", "policy"), engine_tiers=False)
    if args.write_through == "selective" or settings.given.get("tiers.write_through") == (
        "selective"
    ):
        raise KvtierError("simulate models write_through true or false, not 'selective'")
    configured = {}
    for key in DEFAULTS:
        for table in ("tiers", "scheduling"):
            if settings.origin(table, key) != DEFAULT_ORIGIN:
                configured[key] = settings.given[f"{table}.{key}"]
    return configured


def _flag(key: str, value: Any) -> str:
    """The command-line words that give `key` this value."""
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else flag.replace("--", "--no-", 1)
    if isinstance(value, list):
        return " ".join(f"{flag} {shlex.quote(str(item))}" for item in value)
    return f"{flag} {shlex.quote(str(value))}"


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise KvtierError("give at least one policy, e.g. --policies offload,cost")
    return names


def _requests(args: argparse.Namespace, like: Any = None) -> list[Request]:
    """The workload's requests; `like` (a bench run's results `config`, with --against) makes
    them that run's: the sessions it kept (`--sessions`) and its lengths' scale."""
    from kvtier.sim.quiet_gc import without_cyclic_gc
    from kvtier.workload.model import flatten
    from kvtier.workload.source import load_workload

    with without_cyclic_gc():  # a large workload is millions of objects that all live on
        workload = load_workload(
            args.workload,
            settings=args.workload_set,
            trace_format=args.trace_format,
            seed=args.seed,
        )
        if like is not None:
            workload = _as_replayed(workload, like, args.session_resume_after_s)
        requests = flatten(workload)
    if not requests:
        raise KvtierError(f"workload {args.workload} holds no requests")
    if args.lengths_from:
        from kvtier.sim.validation import measured_lengths, with_lengths

        lengths = measured_lengths(args.lengths_from)
        requests = with_lengths(requests, lengths)
        found = sum(1 for r in requests if r.request_id in lengths)
        print(f"lengths of {found} of {len(requests)} requests from {args.lengths_from}")
    return requests


def _as_replayed(workload: Workload, like: Any, resume_after_s: float) -> Workload:
    """`workload` cut to the sessions a bench run kept and scaled as it was (the run's
    `config.workload` records both)."""
    from kvtier.workload.scale import scale_lengths
    from kvtier.workload.subset import keep_sessions

    recorded = like.get("workload") if isinstance(like, dict) else None
    if not isinstance(recorded, dict):
        return workload
    kept = recorded.get("sessions")
    if isinstance(kept, int) and 0 < kept < len(workload.sessions):
        workload = keep_sessions(workload, kept, resume_after_s)
    scale = recorded.get("length_scale")
    if isinstance(scale, float) and 0 < scale < workload.length_scale:
        factor = scale / workload.length_scale
        workload = scale_lengths(workload, factor, f"lengths scaled by {factor:.4g} as the run's")
    return workload


def _deployment(args: argparse.Namespace, hardware: str) -> Deployment:
    from kvtier.plan.geometry import load_geometry
    from kvtier.sim.deployment import Deployment
    from kvtier.sim.profile import load_profile, profile_origin
    from kvtier.units import parse_size

    profile = load_profile(hardware)
    origin = profile_origin(hardware)
    if origin != "bundled":
        print(f"hardware {hardware}: {origin}")
    links = {}
    for setting in args.link:
        tier, sep, key = setting.partition("=")
        if not sep:
            raise KvtierError(f"--link takes TIER=LINK (e.g. disk=nvme4), not {setting!r}")
        links[tier.strip()] = key.strip()
    if links:
        profile = profile.with_links(links)
    sizes = {}
    for tier in ("host", "disk", "remote"):
        value = getattr(args, f"{tier}_bytes")
        text = str(value).strip()
        sizes[tier] = value if isinstance(value, int) else 0 if text == "0" else parse_size(text)
    return Deployment(
        profile=profile,
        geometry=load_geometry(args.model),
        gpus=args.gpus,
        tp=args.tp,
        device_kv_bytes=parse_size(args.device_kv_bytes) if args.device_kv_bytes else 0,
        tier_bytes=sizes,
        chunk_tokens=args.chunk_tokens,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        session_resume_after_s=args.session_resume_after_s,
        timer_after_steps=args.timer_after_steps,
        write_through=args.write_through,
        keep_moved=args.keep_moved,
        shared_prefixes=args.shared_prefixes,
    )


def _forms_line(forms: dict[str, dict[str, float]]) -> str:
    tokens = forms["restored_tokens"]
    codec = forms["codec_s"]
    restored = " / ".join(f"{form} {tokens[form]:,.0f}" for form in sorted(tokens))
    return (
        f"tokens restored from lower tiers: {restored or 'none'}; encode "
        f"{codec.get('encode', 0):.2f} s (mover's worker), decode {codec.get('decode', 0):.2f} s "
        "(on restores)"
    )


def _policy_config(args: argparse.Namespace, name: str) -> PolicyConfig:
    from kvtier.settings.flags import from_args

    settings = from_args(args, ("policy",), policy_name=name, engine_tiers=False)
    return settings.policy.for_model(args.model)


def _sweep(args: argparse.Namespace) -> int:
    from kvtier.sim.sweep import SweepGrid, markdown, run_sweep, write_sweep
    from kvtier.units import parse_token_counts

    problem = f"--resume-shares takes numbers in [0, 1], not {args.resume_shares!r}"
    try:
        shares = [float(x) for x in args.resume_shares.split(",")]
    except ValueError:
        raise KvtierError(problem) from None
    if not shares or any(not 0 <= s <= 1 for s in shares):
        raise KvtierError(problem)
    grid = SweepGrid(
        resume_shares=shares,
        contexts=parse_token_counts(args.contexts),
        hardware=[h.strip() for h in args.hardware.split(",") if h.strip()],
        policies=_names(args.policies),
        sessions=args.sessions,
        seed=args.seed,
    )
    deployments = {h: _deployment(args, h) for h in grid.hardware}  # bad flags fail up front
    sweep = run_sweep(grid, deployments.__getitem__, lambda n: _policy_config(args, n), print)
    paths = write_sweep(sweep, args.out, plots=not args.no_plots)
    print(markdown(sweep))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _seeds(args: argparse.Namespace) -> int:
    from kvtier.results.report import to_document, write_results
    from kvtier.sim.console import setup_lines
    from kvtier.sim.seeds import markdown, parse_seeds, run_seeds, write_seeds
    from kvtier.workload.flags import PRESET_NAMES

    seeds = parse_seeds(args.seeds)
    if args.workload not in PRESET_NAMES:
        raise KvtierError(
            f"simulate seeds needs a generator preset ({', '.join(PRESET_NAMES)}): a trace "
            "replays the same requests whatever the seed"
        )
    deployment = _deployment(args, args.hardware)
    names = _names(args.policies)
    out = Path(args.out)

    @functools.lru_cache(maxsize=1)  # the first seed's: the set-up lines read it too
    def requests(seed: int) -> list[Request]:
        args.seed = seed
        return _requests(args)

    def keep(seed: int, runs: list[Any]) -> None:
        config = {
            "workload": args.workload,
            "workload_set": args.workload_set,
            "seed": seed,
            "policy_set": args.policy_set,
            **deployment.describe(),
        }
        write_results(out / f"seed-{seed}", to_document("simulate", config, runs), runs)

    print("\n".join(setup_lines(deployment, requests(seeds[0]), names)))
    document = run_seeds(
        seeds, requests, deployment, names, lambda n: _policy_config(args, n), print, keep
    )
    paths = write_seeds(document, out)
    print(markdown(document))
    print(f"wrote {', '.join(str(p) for p in paths)} and each seed's results in {out}/seed-N/")
    return 0


def _validate(document: dict[str, Any], measured: dict[str, Any], against: str, out: Path) -> Path:
    from kvtier.results.compare import compare
    from kvtier.sim.validation import judge, report_lines, setup_mismatches

    for problem in setup_mismatches(document["config"], measured.get("config") or {}):
        print(f"warning: not set up like {against}: {problem}")
    result = judge(compare(document, measured))
    for line in report_lines(result):
        print(line)
    path = out / "validation.json"
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return path
