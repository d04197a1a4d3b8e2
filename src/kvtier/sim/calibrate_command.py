"""`kvtier calibrate`: time the real engine on this machine, fit the simulator's step model to
it, and write the profile `kvtier simulate --hardware local-cpu` then uses.

Times prefill and decode steps of the embedded model (or --model) and the host and disk tiers'
copies (`kvtier.sim.calibrate`), fits per-step and per-sequence overheads and the compute and
memory rates (`kvtier.sim.fit`), prints each point's fit error and writes a profile TOML to
$KVTIER_CACHE/profiles/<name>.toml, which `load_profile(<name>)` prefers over the bundled
file. Run it alone: other work on the cores slows every step it times. It reads the two
[scheduling] keys that change a step's time, `prefill_attention` and `deterministic`, from the
same kvtier.toml and environment as `kvtier serve` (or --prefill-attention, --deterministic),
so the profile prices the engine the server runs.

Examples:
  kvtier calibrate --quick                      # ~1 min: the shapes the demo workload runs
  kvtier calibrate --threads 2 --out mine.toml  # the full grid (batch 1-32, 128-2,048 tokens)
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from kvtier.engine.config import DTYPE_HELP
from kvtier.errors import KvtierError
from kvtier.settings.flags import add_config_argument, add_key_flags, from_args
from kvtier.workload.flags import add_hidden_alias

DEFAULT_NAME = "local-cpu"
# the [scheduling] keys that change what a step costs; the plan sizes the rest itself
ENGINE_TIMING_KEYS = ("prefill_attention", "deterministic")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 12)[12]
    parser.add_argument("--quick", action="store_true", help="fewer points and repeats (~1 min)")
    parser.add_argument("--model", metavar="DIR", help="model folder (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    threads = parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1)"
    )
    add_hidden_alias(parser, threads, "--num-threads")  # `kvtier serve`'s spelling
    parser.add_argument("--repeats", type=int, help="timed repeats per point (3 quick, 5 full)")
    parser.add_argument(
        "--prefill",
        metavar="T@P,...",
        help="prefill points instead of the plan's: T new tokens after P cached, e.g. 64@0,64@512",
    )
    parser.add_argument(
        "--decode",
        metavar="BxL,...",
        help="decode points instead of the plan's: batch B at L tokens each, e.g. 1x128,8x512",
    )
    parser.add_argument(
        "--name", default=DEFAULT_NAME, help=f"profile name (default {DEFAULT_NAME})"
    )
    parser.add_argument(
        "--base",
        default=DEFAULT_NAME,
        metavar="NAME|PATH",
        help="profile whose memory size and remote link are kept (default: bundled local-cpu)",
    )
    parser.add_argument(
        "--out", metavar="PATH", help="profile file (default $KVTIER_CACHE/profiles/NAME.toml)"
    )
    parser.add_argument("--no-links", action="store_true", help="keep the base profile's links")
    add_config_argument(parser)
    add_key_flags(parser, "scheduling", ENGINE_TIMING_KEYS)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kvtier.engine.config import DTYPES, EngineConfig
    from kvtier.engine.engine import Engine
    from kvtier.models import resolve_model_dir
    from kvtier.plan.geometry import load_geometry
    from kvtier.sim.calibrate import FULL, QUICK, engine_settings, measure_engine, measure_links
    from kvtier.sim.fit import fit_profile
    from kvtier.sim.profile import calibrated_path, load_profile
    from kvtier.sim.profile_file import write_profile

    if args.threads < 1:
        raise KvtierError(f"--threads must be at least 1, not {args.threads}")
    plan = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            raise KvtierError(f"--repeats must be at least 1, not {args.repeats}")
        plan = replace(plan, repeats=args.repeats)
    if args.prefill:
        plan = replace(plan, prefill=_points(args.prefill, "@", "--prefill", "64@0,64@512"))
    if args.decode:
        plan = replace(plan, decode=_points(args.decode, "x", "--decode", "1x128,8x512"))
    base = load_profile(args.base, calibrated=False)
    out = Path(args.out) if args.out else calibrated_path(args.name)
    started = time.perf_counter()

    if args.dtype not in DTYPES:
        raise KvtierError(f"--dtype must be auto, bfloat16 or float32, not {args.dtype!r}")
    dtype = EngineConfig(dtype=args.dtype).resolved_dtype()
    scheduling = from_args(args, ["scheduling"], engine_tiers=False).scheduling
    timing = {key: scheduling[key] for key in ENGINE_TIMING_KEYS if key in scheduling}
    model_dir = resolve_model_dir(args.model)
    geometry = load_geometry(str(model_dir))
    token_bytes = int(geometry.bytes_per_token("bf16")) * (2 if dtype == "float32" else 1)
    engine = Engine(
        EngineConfig(
            model_dir=args.model,
            dtype=dtype,
            num_threads=args.threads,
            **timing,
            **engine_settings(plan, token_bytes),
        )
    )
    # what was timed, in the words of `kvtier serve`'s startup line
    engine_words = (
        f"{dtype}{' (deterministic)' if engine.config.deterministic else ''}, "
        f"{args.threads} thread(s), prefill attention by {engine.config.prefill_attention}"
    )
    print(f"calibrating {model_dir.name} ({engine_words}) on this machine")
    block_bytes = engine.kv_pool.bytes_per_block
    _warm_up(engine)
    measurements = measure_engine(engine, plan, progress=lambda line: print("  " + line))
    engine.close()
    del engine
    fitted = fit_profile(measurements, geometry, base, name=args.name)
    links = dict(fitted.links)
    link_lines = []
    if not args.no_links:
        from kvtier.sim.calibrate import fit_link
        from kvtier.sim.profile import LinkSpec

        chunk_bytes = 256 * token_bytes  # the tiers' default chunk (cache.config.TiersConfig)
        timings = measure_links([block_bytes, chunk_bytes], plan.link_repeats, block_bytes)
        for tier, measured in timings.items():
            read_bw, read_lat = fit_link(measured, write=False)
            write_bw, write_lat = fit_link(measured, write=True)
            links[tier] = LinkSpec(
                bandwidth=read_bw,
                write_bandwidth=write_bw,
                latency_s=(read_lat + write_lat) / 2,  # one latency per link in the profile
                duplex=tier != "disk",
            )
            for t in measured:
                link_lines.append(
                    f"  {tier:5s} {t.nbytes / 1e6:6.2f} MB: put {t.write_s * 1e3:7.3f} ms, "
                    f"get {t.read_s * 1e3:7.3f} ms"
                )
            link_lines.append(
                f"  {tier:5s} fitted: read {read_bw / 1e9:.2f} GB/s + {read_lat * 1e6:.0f} us, "
                f"write {write_bw / 1e9:.2f} GB/s + {write_lat * 1e6:.0f} us"
            )
    command = "kvtier calibrate " + " ".join(shlex.quote(a) for a in _argv())
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    fitted = fitted.model_copy(
        update={
            "description": (
                f"{platform.node() or 'this machine'} ({_cpu_count()} cores), "
                f"{geometry.name} ({engine_words}), fitted by "
                f"`{command}` on {when}"
            ),
            "sources": [
                f"`{command}`: {len(measurements.prefill)} prefill and "
                f"{len(measurements.decode)} decode steps of the real engine (medians of "
                f"{plan.repeats}), host and disk tier copies"
                + (" (not measured: --no-links)" if args.no_links else ""),
                # the base's own sources hold for what it still supplies: links not measured
                *[s for s in base.sources if args.no_links or s.startswith("remote")],
            ],
            "links": links,
        }
    )
    _print_fit(fitted, geometry, measurements)
    for line in link_lines:
        print(line)
    write_profile(fitted, out, [f"written by `{command}` on {when}"])
    print(f"wrote {out} in {time.perf_counter() - started:.0f} s")
    if out == calibrated_path(args.name):
        print(
            f"`--hardware {args.name}` now loads this calibrated profile (profiles in "
            f"{out.parent} are preferred over the bundled ones)"
        )
    return 0


def _points(text: str, sep: str, flag: str, example: str) -> tuple[tuple[int, int], ...]:
    points = []
    for item in text.split(","):
        left, found, right = item.strip().partition(sep)
        try:
            points.append((int(left), int(right)))
        except ValueError:
            raise KvtierError(f"{flag} takes points like {example}, not {item.strip()!r}") from None
        if not found:
            raise KvtierError(f"{flag} takes points like {example}, not {item.strip()!r}")
    return tuple(points)


def _warm_up(engine) -> None:
    """First calls pay one-off costs (thread pool, allocator); none of them is timed."""
    from kvtier.engine.sampling import SamplingParams

    prompt = [256 + i for i in range(64)]
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.reset_prefix_cache()


def _print_fit(profile, geometry, measurements) -> None:
    from kvtier.sim.step_model import StepModel

    device = profile.device()
    print(
        f"fitted: compute {device.peak_flops / 1e12:.3f} TFLOP/s, memory "
        f"{device.memory_bandwidth / 1e9:.2f} GB/s, step overhead "
        f"{profile.step_overhead_s * 1e3:.2f} ms, per sequence "
        f"{profile.sequence_overhead_s * 1e3:.3f} ms, per key "
        f"{profile.key_overhead_s * 1e6:.2f} us"
    )
    model = StepModel(profile, geometry)
    print("  step                              measured    fitted   error")
    errors = []
    for tokens, position, seconds in measurements.prefill:
        predicted = model.prefill_s(tokens, position)
        errors.append(predicted / seconds - 1)
        label = f"prefill {tokens} after {position}"
        print(f"  {label:32s} {seconds * 1e3:8.1f} ms {predicted * 1e3:8.1f} ms {errors[-1]:+7.1%}")
    for batch, context, seconds in measurements.decode:
        predicted = model.step_s(batch, batch * (context + 1))
        errors.append(predicted / seconds - 1)
        label = f"decode batch {batch} at {context}"
        print(f"  {label:32s} {seconds * 1e3:8.1f} ms {predicted * 1e3:8.1f} ms {errors[-1]:+7.1%}")
    worst = max(errors, key=abs)
    mean = sum(abs(e) for e in errors) / len(errors)
    print(f"  fit error: mean |error| {mean:.1%}, worst {worst:+.1%}")


def _cpu_count() -> int:
    import os

    return os.cpu_count() or 1


def _argv() -> list[str]:
    argv = sys.argv[1:]
    return argv[1:] if argv and argv[0] == "calibrate" else argv
