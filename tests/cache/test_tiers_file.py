"""The [tiers] table of kvtier.toml and the flags over it -> TiersConfig (through
kvtier.settings, the one loader every command uses)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cache.config import TiersConfig, default_host_bytes
from kvtier.cache.tiers_file import table_keys
from kvtier.errors import KvtierError
from kvtier.settings.load import load_settings


def load_tiers(path, *, settings=(), overrides=None) -> TiersConfig | None:
    """The [tiers] table of `path`, then --tiers-set `settings`, then flags `overrides`."""
    return load_settings(
        None if path is None else str(path),
        env={},
        sets={"tiers": settings},
        flags={"tiers": overrides or {}},
    ).tiers


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    return path


def test_the_table_with_sizes_and_remote_names(tmp_path: Path):
    path = write(
        tmp_path,
        f"""
[tiers]
host_bytes = "64MiB"
disk_dir = "{tmp_path / "kv"}"
disk_bytes = 1048576
remote_url = "redis://127.0.0.1:6379/0"
remote_bytes = "2GiB"
remote_cluster = true
chunk_tokens = 64
forms = {{disk = "int8"}}
""",
    )
    tiers = load_tiers(path)
    assert tiers is not None
    assert tiers.host_bytes == 64 << 20
    assert (tiers.disk_bytes, tiers.disk_persist) == (1 << 20, True)  # a disk tier persists
    assert (tiers.redis_url, tiers.redis_bytes, tiers.redis_cluster) == (
        "redis://127.0.0.1:6379/0",
        2 << 30,
        True,
    )
    assert tiers.chunk_tokens == 64
    assert tiers.tier_forms()["disk"] == "int8"


def test_flags_override_settings_override_the_file(tmp_path: Path):
    path = write(tmp_path, '[tiers]\nhost_bytes = "64MiB"\nchunk_tokens = 64\n')
    tiers = load_tiers(
        path,
        settings=["chunk_tokens=32", "host_bytes=1MiB"],
        overrides={"host_bytes": "2MiB", "disk_dir": None},
    )
    assert tiers is not None
    assert (tiers.host_bytes, tiers.chunk_tokens) == (2 << 20, 32)


def test_the_restore_pipeline_from_the_table_or_its_flag(tmp_path: Path):
    import argparse

    from kvtier.settings.flags import add_table_arguments, flag_values

    path = write(tmp_path, '[tiers]\nrestore_pipeline = "layer"\n')
    assert load_tiers(path).restore_pipeline == "layer"
    assert load_tiers(None).restore_pipeline == "chunk"  # the default
    parser = argparse.ArgumentParser()
    add_table_arguments(parser, "tiers")
    flags = flag_values(parser.parse_args(["--restore-pipeline", "chunk"]), "tiers")
    assert load_tiers(path, overrides=flags).restore_pipeline == "chunk"


def test_kept_blocks_from_the_table_or_tiers_set(tmp_path: Path):
    """`kvtier serve --tiers-set keep_moved=true` and the table both turn kept blocks on."""
    path = write(tmp_path, '[tiers]\nhost_bytes = "1MiB"\nkeep_moved = true\n')
    assert load_tiers(path).keep_moved is True
    assert load_tiers(None, settings=["host_bytes=1MiB"]).keep_moved is False
    assert load_tiers(None, settings=["host_bytes=1MiB", "keep_moved=true"]).keep_moved is True


def test_defaults_host_from_the_machine_and_nothing_else():
    tiers = load_tiers(None)
    assert tiers is not None
    assert tiers.host_bytes == default_host_bytes() > 0
    assert tiers.disk_bytes == 0 and tiers.redis_url is None


def test_every_tier_off_is_device_only():
    assert load_tiers(None, overrides={"host_bytes": "0"}) is None


def test_a_key_file_gives_the_master_key(tmp_path: Path):
    key_file = tmp_path / "master.key"
    tiers = load_tiers(
        None,
        overrides={"encrypt": True, "encrypt_key_file": str(key_file), "create_key": True},
    )
    assert tiers is not None and tiers.encrypt
    assert tiers.encrypt_key == bytes.fromhex(key_file.read_text())


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("colour = 1", "tiers.colour (from {path}): unknown key; allowed: "),
        ('host_bytes = "lots"', "tiers.host_bytes (from {path}): "),
        ("host_bytes = -1", "tiers.host_bytes (from {path}): must be >= 0"),
        ("disk_bytes = 1048576", "tiers.disk_bytes (from {path}): needs tiers.disk_dir"),
        ("encrypt = true", "tiers.encrypt (from {path}): needs tiers.encrypt_key_file"),
        ("create_key = true", "tiers.create_key (from {path}): needs tiers.encrypt_key_file"),
        ('restore = "sometimes"', "tiers.restore must be load, plan or recompute"),
        ('restore_pipeline = "token"', "tiers.restore_pipeline must be chunk or layer"),
        ("tiers = 1", "tiers.tiers (from {path}): unknown key"),
        ('keep_moved = "yes"', "tiers.keep_moved must be true or false"),
    ],
)
def test_bad_values_name_the_key_and_where_it_came_from(tmp_path: Path, table, message):
    path = write(tmp_path, f"[tiers]\n{table}\n")
    with pytest.raises(KvtierError) as error:
        load_tiers(path)
    assert message.format(path=path) in str(error.value)


def test_the_allowed_keys_are_tiers_config_s_with_remote_names():
    keys = table_keys()
    assert {"host_bytes", "remote_url", "encrypt_key_file", "create_key", "forms"} <= set(keys)
    assert not {"redis_url", "encrypt_key", "cost_profile", "disk_persist"} & set(keys)
