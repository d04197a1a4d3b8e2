"""`kvtier serve`'s tier flags: each one overrides its key of the [tiers] table
(kvtier.cache.tiers_file), `--tiers-set KEY=VALUE` any other key."""

from __future__ import annotations

import argparse

# flag destination == [tiers] key
_SIZE_HELP = "bytes or e.g. 8GiB"


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV tiers (the [tiers] table of the config file)")
    group.add_argument(
        "--host-bytes",
        metavar="SIZE",
        help=f"host DRAM tier ({_SIZE_HELP}; 0: off; default: a tenth of the machine's memory)",
    )
    group.add_argument("--disk-dir", metavar="DIR", help="persistent disk tier folder (off)")
    group.add_argument(
        "--disk-bytes", metavar="SIZE", help="disk tier budget (default: half the free space)"
    )
    group.add_argument("--remote-url", metavar="URL", help="Redis tier, redis://host:port/db (off)")
    group.add_argument("--remote-bytes", metavar="SIZE", help="this replica's Redis writes (1GiB)")
    group.add_argument(
        "--remote-cluster",
        action="store_const",
        const=True,
        help="--remote-url names a node of a Redis Cluster",
    )
    group.add_argument(
        "--encrypt",
        action="store_const",
        const=True,
        help="seal disk and Redis records (AES-GCM); needs --encrypt-key-file",
    )
    group.add_argument(
        "--encrypt-key-file",
        metavar="PATH",
        help="master key (64 hex digits, mode 0600); without --encrypt it signs Redis values",
    )
    group.add_argument(
        "--create-key",
        action="store_const",
        const=True,
        help="write a fresh key to --encrypt-key-file if it does not exist",
    )
    group.add_argument(
        "--write-through",
        nargs="?",
        const=True,
        choices=("selective",),
        metavar="selective",
        help="copy each finished turn's chunks to the top tier at once; `selective`: only "
        "the chunks its prompt reused (replicas: see docs)",
    )
    group.add_argument(
        "--restore-pipeline",
        choices=("chunk", "layer"),
        help="restore disk and Redis chunks whole before the forward (chunk, the default) "
        "or a layer at a time beside it (layer; docs/tiers.md)",
    )
    group.add_argument(
        "--tiers-set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="set any [tiers] key, e.g. chunk_tokens=64 (repeatable)",
    )


def tier_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The dedicated flags, as [tiers] keys (None: not given)."""
    keys = (
        "host_bytes",
        "disk_dir",
        "disk_bytes",
        "remote_url",
        "remote_bytes",
        "remote_cluster",
        "encrypt",
        "encrypt_key_file",
        "create_key",
        "write_through",
        "restore_pipeline",
    )
    return {key: getattr(args, key) for key in keys}
