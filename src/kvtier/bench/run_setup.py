"""What a `kvtier bench` run replays and on what: the workload the flags describe, and the
run's settings (kvtier.settings: the same [tiers], [scheduling], [policy] and [compression]
tables and flags as `kvtier serve`), with the bench's own defaults where it wants a small
pool that idle sessions compete for."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.settings.load import Settings
    from kvtier.workload.model import Workload

SETTINGS_TABLES = ("tiers", "scheduling", "policy", "compression")
DEFAULT_KV_BYTES = "64MiB"
# --quick: the demo's two ~4.3K-token histories do not both fit (5.1K tokens of SmolLM2)
QUICK_KV_BYTES = "112MiB"
# Both sizes are bfloat16 KV: a float32 engine (`--dtype auto` on a CPU without bf16 dot
# products) gets twice the bytes, so its pool holds the same tokens and the runs contend alike.
# the bench's running set: a handful of sessions, so the pool, not the batch, is contended
BENCH_MAX_NUM_SEQS = 8


@dataclass(frozen=True)
class RunSettings:
    settings: Settings
    # the engine's [scheduling] fields for this run: the bench's defaults, then what is given
    scheduling: dict[str, Any]

    @property
    def resume_after_s(self) -> float:
        return self.scheduling["session_resume_after_s"]

    @property
    def kv_cache_bytes(self) -> int:
        return self.scheduling["kv_cache_bytes"]


def run_settings(args: argparse.Namespace, *, engine_tiers: bool = True) -> RunSettings:
    """`engine_tiers` False: the replay runs against a server, whose tiers are its own, so
    the [tiers] table is merged but no tier is built (no key file read or created)."""
    from kvtier.engine.config import EngineConfig
    from kvtier.settings.flags import from_args
    from kvtier.units import parse_size

    settings = from_args(args, SETTINGS_TABLES, engine_tiers=engine_tiers)
    defaults = EngineConfig()
    dtype = EngineConfig(dtype=args.dtype, device=args.device).resolved_dtype()
    bf16_bytes = parse_size(QUICK_KV_BYTES if args.quick else DEFAULT_KV_BYTES)
    scheduling = {
        "kv_cache_bytes": bf16_bytes * (2 if dtype == "float32" else 1),
        "max_num_seqs": BENCH_MAX_NUM_SEQS,
        "max_num_batched_tokens": defaults.max_num_batched_tokens,
        "session_resume_after_s": defaults.session_resume_after_s,
        **settings.scheduling,
    }
    return RunSettings(settings, scheduling)


def load_workload(args: argparse.Namespace, resume_after_s: float) -> Workload:
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
        resume_after_s=resume_after_s,
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


def compression(
    args: argparse.Namespace, run: RunSettings, workload: Workload
) -> tuple[Any, dict[str, Any] | None]:
    """The [compression] table of the config file (same file as [policy]) as the engine's
    pipeline, with `preset = "auto"` resolved from this workload and the device KV budget;
    and what the results record about it (None: no compression configured)."""
    section = run.settings.compression
    kv_bytes = run.kv_cache_bytes
    choice = None
    if section.is_auto:
        from kvtier.bench.auto_compression import choose_for_workload
        from kvtier.engine.config import EngineConfig
        from kvtier.models import resolve_model_dir
        from kvtier.plan.geometry import load_geometry

        geometry = load_geometry(str(resolve_model_dir(args.model)))
        dtype = EngineConfig(dtype=args.dtype, device=args.device).resolved_dtype()
        kv_dtype = "fp32" if dtype == "float32" else "bf16"
        choice = choose_for_workload(
            workload, geometry, kv_bytes, kv_dtype=kv_dtype, resume_after_s=run.resume_after_s
        )
        print(f"compression auto -> {choice}")
    from kvtier.lowrank.bases import with_fitted_bases

    compression = with_fitted_bases(section.build(choice))
    if compression is None and choice is None:
        return None, None
    note = section.model_dump(exclude_none=True)
    note["pipeline"] = None if compression is None else compression.model_dump()
    if choice is not None:
        note["auto"] = {"preset": choice.preset, "method": choice.method, "reason": choice.reason}
    return compression, note
