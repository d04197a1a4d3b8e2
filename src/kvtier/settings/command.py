"""`kvtier config show`: the settings a command would run with, from the same file,
environment and flags, each value with where it came from.

Examples:
  kvtier config show
  kvtier config show --config kvtier.toml --host-bytes 8GiB --policy offload
  KVTIER_TIERS__CHUNK_TOKENS=64 kvtier config show
"""

from __future__ import annotations

import argparse

from kvtier.settings.flags import add_config_argument, add_table_arguments, from_args

TABLES = ("tiers", "scheduling", "policy", "compression", "server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n", 3)[3]
    parser.add_argument("action", choices=("show",), help="show: print the effective settings")
    add_config_argument(parser)
    for table in TABLES:
        add_table_arguments(parser, table)


def run(args: argparse.Namespace) -> int:
    from kvtier.settings.show import render

    print(render(from_args(args, TABLES)))
    return 0
