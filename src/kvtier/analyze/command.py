"""`kvtier analyze`: new vs continuing vs resumed turns, idle gaps, prefix sharing, history
growth, and the KV cache they imply, for a trace or a generated workload.

Examples:
  kvtier analyze conversation_trace.jsonl      # Mooncake's whole trace (docs/workloads.md)
  kvtier analyze chats.json --trace-format sharegpt --resume-after 60 --json out/chats.json
  kvtier analyze --generate default --seed 3 --model llama-3.1-8b --kv-dtype int8
  kvtier analyze trace.jsonl --decode-tok-s inf       # gaps from arrival to arrival
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.errors import KvtierError
from kvtier.workload.flags import PRESET_NAMES, TRACE_FORMATS, add_hidden_alias

if TYPE_CHECKING:
    from kvtier.workload.model import Workload

DEFAULT_MODEL = "llama-3.1-70b"
DEFAULT_OUT = "out/analyze"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 3)[3]
    parser.add_argument(
        "trace", nargs="?", help="trace file (Mooncake, Qwen-Bailian, ShareGPT, agentic)"
    )
    trace_format = parser.add_argument(
        "--trace-format",
        default="auto",
        metavar="FMT",
        help=f"trace format: {', '.join(TRACE_FORMATS)}",
    )
    add_hidden_alias(parser, trace_format, "--format")  # its spelling before bench's
    parser.add_argument(
        "--generate",
        metavar="PRESET",
        help=f"analyze a generated workload instead: {', '.join(PRESET_NAMES)}",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="generator seed (also times ShareGPT turns)"
    )
    parser.add_argument(
        "--scale-to-context",
        type=int,
        metavar="TOKENS",
        help="shrink all lengths so the longest prompt + answer fits this context",
    )
    parser.add_argument(
        "--resume-after",
        type=float,
        default=30.0,
        metavar="S",
        help="a gap above this many seconds makes a turn resumed, not continuing (default 30)",
    )
    parser.add_argument(
        "--decode-tok-s",
        type=float,
        default=50.0,
        metavar="RATE",
        help="answer speed used to estimate when a turn ended; gaps start there (default 50; "
        "'inf' measures from arrival)",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="NAME|PATH",
        help=f"model whose KV bytes to report (default {DEFAULT_MODEL}; see kvtier plan)",
    )
    parser.add_argument("--kv-dtype", default="bf16", help="KV format (default bf16)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    parser.add_argument(
        "--out", default=DEFAULT_OUT, metavar="DIR", help=f"PNG plots go here ({DEFAULT_OUT})"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def run(args: argparse.Namespace) -> int:
    from kvtier.analyze.metrics import analyze
    from kvtier.analyze.report import print_report, to_json
    from kvtier.plan.geometry import load_geometry
    from kvtier.plan.kv_dtypes import get_kv_dtype

    if (args.trace is None) == (args.generate is None):
        raise KvtierError("give a trace file or --generate PRESET (one of them)")
    if args.resume_after < 0:
        raise KvtierError(f"--resume-after must be >= 0 seconds, not {args.resume_after:g}")
    if math.isnan(args.decode_tok_s) or args.decode_tok_s <= 0:
        raise KvtierError(f"--decode-tok-s must be > 0 (or inf), not {args.decode_tok_s:g}")
    kv_dtype = get_kv_dtype(args.kv_dtype).name
    geometry = load_geometry(args.model)
    workload = _load(args)
    analysis = analyze(
        workload,
        geometry,
        kv_dtype=kv_dtype,
        resume_after_s=args.resume_after,
        decode_tok_s=args.decode_tok_s,
    )
    print_report(analysis)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(to_json(analysis), indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    if not args.no_plots:
        from kvtier.analyze.plots import write_plots

        for path in write_plots(analysis, args.out):
            print(f"wrote {path}")
    return 0


def _load(args: argparse.Namespace) -> Workload:
    from kvtier.workload.scale import scale_to_context

    if args.generate is not None:
        from kvtier.workload.generator import generate

        workload = generate(args.generate, seed=args.seed)
    else:
        from kvtier.workload.traces import load_trace

        workload = load_trace(args.trace, args.trace_format, seed=args.seed)
    if args.scale_to_context is not None:
        workload = scale_to_context(workload, args.scale_to_context)
    return workload
