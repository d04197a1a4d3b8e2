"""`kvtier export`: write a workload (a generator preset or a trace) as a trace file in the
agentic format (LLMServingSim's sessions of sub-requests, `workload/agentic_trace.py`), for
LLMServingSim or for `--workload FILE` here.

Examples:
  kvtier export agentic.jsonl                        # the agentic preset, seed 0
  kvtier export small.jsonl --workload agentic-hints --workload-set sessions=20 --seed 3
  kvtier export sample-agentic.jsonl --workload sample
"""

from __future__ import annotations

import argparse

from kvtier.workload.flags import add_workload_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 3)[3]
    parser.add_argument("path", metavar="PATH", help="the trace file to write (JSON lines)")
    add_workload_arguments(parser, default="agentic")


def run(args: argparse.Namespace) -> int:
    from kvtier.workload.agentic_trace import write_agentic
    from kvtier.workload.source import load_workload

    workload = load_workload(
        args.workload, settings=args.workload_set, trace_format=args.trace_format, seed=args.seed
    )
    sessions = write_agentic(workload, args.path)
    print(f"wrote {args.path}: {sessions:,} sessions, {workload.num_turns:,} calls")
    return 0
