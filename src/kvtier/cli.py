"""The `kvtier` command line: one sub-command per module, imported lazily.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`. Lazy import keeps
`kvtier plan` free of torch start-up time.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvtier import __version__
from kvtier.errors import KvtierError

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("kvtier.plan.command", "KV bytes, what fits where, transfer vs recompute times"),
    "analyze": (
        "kvtier.analyze.command",
        "new/continuing/resumed turns, gaps, prefix sharing, KV a workload implies",
    ),
    "bench": (
        "kvtier.bench.command",
        "run a multi-turn workload on the real engine under several policies",
    ),
    "simulate": (
        "kvtier.sim.command",
        "the same policies at data-centre scale on hardware profiles, in simulated time",
    ),
    "export": (
        "kvtier.workload.export_command",
        "write a workload (preset or trace) as an agentic trace file (LLMServingSim's format)",
    ),
    "calibrate": ("kvtier.sim.calibrate_command", "time the engine here, fit a local-cpu profile"),
    "serve": (
        "kvtier.server.command",
        "OpenAI-compatible server with sessions, tenants and Prometheus metrics",
    ),
    "eval": (
        "kvtier.eval.command",
        "long-context accuracy of KV compression methods (RULER-style)",
    ),
    "config": (
        "kvtier.settings.command",
        "the effective settings (file, environment, flags), each with its origin",
    ),
    "model": (
        "kvtier.model_command",
        "locate/convert the embedded model, run a generation smoke test",
    ),
}


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like KvtierError
        self.exit(2, f"kvtier: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="kvtier", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=_ArgumentParser
    )
    for name, (module_name, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Line by line into a log or a pipe too (Python buffers whole blocks there): a command of
    # minutes shows each policy, run or task as it finishes, not everything at its end.
    if not sys.stdout.isatty() and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except KvtierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
