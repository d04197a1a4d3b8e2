"""The `--workload` flags of `bench`, `simulate` and `analyze`, and hidden aliases for flags
spelt two ways, without importing anything heavy:
`kvtier --help` builds every sub-command's parser, and the generator's presets and trace
readers pull in numpy and pydantic (0.08 s -> 0.27 s of start-up, measured). The names are
therefore written out here; a test checks they match `workload.presets` and `workload.traces`.
"""

from __future__ import annotations

import argparse
from typing import Any

# = tuple(workload.presets.PRESETS)
PRESET_NAMES = ("quick", "demo", "default", "multiclass", "agentic", "agentic-hints")
# = auto + workload.traces.FORMATS
TRACE_FORMATS = ("auto", "mooncake", "bailian", "sharegpt", "agentic")


def add_workload_arguments(parser: argparse.ArgumentParser, default: str) -> Any:
    """The `workload` flag group every replaying command takes; returns the group so a
    command can add its own flags to it. `load_workload(args.workload, settings=
    args.workload_set, trace_format=args.trace_format, seed=args.seed)` reads them."""
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--workload",
        default=default,
        metavar="PRESET|PATH",
        help=f"generator preset ({', '.join(PRESET_NAMES)}) or trace file (default: {default})",
    )
    trace_format = group.add_argument(
        "--trace-format", default="auto", help=f"one of {', '.join(TRACE_FORMATS)}"
    )
    add_hidden_alias(group, trace_format, "--format")  # analyze's spelling
    group.add_argument(
        "--workload-set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a generator field, e.g. sessions=8 or answer_tokens.mean=200",
    )
    group.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    return group


def add_hidden_alias(parser: Any, action: argparse.Action, *aliases: str) -> None:
    """Accept `aliases` for the value flag `action` without showing them in --help, so every
    command documents one spelling (vLLM's where vLLM has the flag) and the others still work.
    The alias sets nothing unless given, so `action`'s default stands."""
    parser.add_argument(
        *aliases,
        dest=action.dest,
        type=action.type,
        choices=action.choices,
        metavar=action.metavar,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
