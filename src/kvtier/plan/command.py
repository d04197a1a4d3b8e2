"""`kvtier plan`: KV bytes per token and per sequence, what fits where, reload vs recompute.

Examples:
  kvtier plan --model seed-70b --context 8000,128000
  kvtier plan --model ./my-model/ --kv-dtype int4 --hardware h200 --tier-size 512GB --json
  kvtier plan --layers 80 --heads 64 --kv-heads 8 --hidden 8192 --params 70B --context 32000
  kvtier plan --layers 32 --kv-heads 8 --head-dim 128 --params 8e9   # query heads assumed
"""

from __future__ import annotations

import argparse
import json

from kvtier.errors import KvtierError
from kvtier.plan.config import FIELD_FLAGS
from kvtier.plan.hardware import ACCELERATORS, DEFAULT_EFFICIENCY, LINKS
from kvtier.plan.kv_dtypes import DEFAULT_GROUP_SIZE, KV_DTYPES, WEIGHT_DTYPES

DEFAULT_CONTEXT = "8192"
# flag destination -> config field it supplies
_FIELD_FOR_DEST = {
    flag.removeprefix("--").replace("-", "_"): key for key, flag in FIELD_FLAGS.items()
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 2)[2]
    model = parser.add_argument_group("model (a name or config, and/or explicit dimensions)")
    model.add_argument(
        "--model",
        metavar="NAME|PATH",
        help="bundled model name (e.g. llama-3.1-70b, meta-llama/Llama-3.1-8B) or a config.json "
        "file or folder",
    )
    model.add_argument("--layers", type=int, help="number of layers (num_hidden_layers)")
    model.add_argument(
        "--heads",
        type=int,
        help="query heads (default: hidden / head dim, else 4 per KV head; only FLOPs use them)",
    )
    model.add_argument("--kv-heads", type=int, help="KV heads (default: --heads, i.e. MHA)")
    model.add_argument("--head-dim", type=int, help="head dimension (default: hidden / heads)")
    model.add_argument("--hidden", type=int, help="hidden size (default: heads x head dim)")
    model.add_argument("--params", help="parameter count, e.g. 70B, 135M, 7.6e9")

    parser.add_argument(
        "--context",
        default=DEFAULT_CONTEXT,
        help=f"comma-separated sequence lengths in tokens (default {DEFAULT_CONTEXT})",
    )
    parser.add_argument("--kv-dtype", default="bf16", choices=list(KV_DTYPES), help="KV format")
    parser.add_argument(
        "--group-size",
        type=int,
        default=DEFAULT_GROUP_SIZE,
        help="elements per fp16 scale + zero point for int KV formats "
        f"(default {DEFAULT_GROUP_SIZE})",
    )
    parser.add_argument(
        "--weight-dtype",
        default="bf16",
        choices=WEIGHT_DTYPES,
        help="weight format (default bf16)",
    )
    parser.add_argument(
        "--hardware",
        default="h100-sxm",
        metavar="PRESET",
        help=f"accelerator preset: {', '.join(ACCELERATORS)}; 'list' shows their figures",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        help="accelerators holding the model (default: fewest of 1/2/4/8 that hold the weights)",
    )
    parser.add_argument(
        "--efficiency",
        type=float,
        default=DEFAULT_EFFICIENCY,
        help=f"share of peak FLOP/s a prefill reaches (default {DEFAULT_EFFICIENCY})",
    )
    parser.add_argument(
        "--tier-size", metavar="SIZE", help="an extra tier to fill, e.g. 512GB host DRAM, 4TB NVMe"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (schema kvtier.plan/1)")


def _print_hardware() -> None:
    for hw in ACCELERATORS.values():
        print(
            f"{hw.key:10} {hw.name:10} {hw.peak_flops / 1e12:6.0f} TFLOP/s bf16  "
            f"{hw.memory_bytes / 2**30:4.0f} GiB  {hw.memory_bandwidth / 1e12:.2f} TB/s"
        )
    for link in LINKS:
        print(f"{link.key:10} {link.name:14} {link.bandwidth / 1e9:g} GB/s")


def run(args: argparse.Namespace) -> int:
    from kvtier.plan.geometry import load_geometry
    from kvtier.plan.hardware import get_accelerator
    from kvtier.plan.kv_dtypes import get_kv_dtype
    from kvtier.plan.planner import plan
    from kvtier.units import parse_count, parse_size, parse_token_counts

    if args.hardware == "list":
        _print_hardware()
        return 0
    contexts = parse_token_counts(args.context)
    overrides = {}
    for dest, key in _FIELD_FOR_DEST.items():
        value = getattr(args, dest)
        if value is None:
            continue
        overrides[key] = parse_count(value) if dest == "params" else value
    if args.model is None and not overrides:
        raise KvtierError(
            "say which model: --model NAME|PATH, or --layers --kv-heads --head-dim --params"
        )
    geometry = load_geometry(args.model, overrides)
    result = plan(
        geometry,
        contexts,
        kv_dtype=get_kv_dtype(args.kv_dtype),
        weight_dtype=get_kv_dtype(args.weight_dtype),
        accelerator=get_accelerator(args.hardware),
        group_size=args.group_size,
        efficiency=args.efficiency,
        gpus=args.gpus,
        tier_bytes=parse_size(args.tier_size) if args.tier_size else None,
    )

    from kvtier.plan import report

    if args.json:
        print(json.dumps(report.to_json(result), indent=2))
    else:
        report.print_report(result)
    return 0
