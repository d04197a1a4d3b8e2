"""The example tier of docs/design.md (one file per chunk, read through mmap) keeps the tier
contract: round trip, budgets, namespaces apart, damage is a counted miss, and it is
reachable from configuration through its one registration line."""

from __future__ import annotations

import pytest
import torch

from kvtier.cache import TiersConfig
from kvtier.errors import KvtierError
from kvtier.tiers import Payload
from kvtier.tiers.factory import build_backends
from kvtier.tiers.mmap_file import MmapFileTier


def payload(n: int, seed: int = 0) -> Payload:
    values = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return Payload.of(values.to(torch.bfloat16))


def test_round_trip_and_out_buffer(tmp_path):
    tier = MmapFileTier(tmp_path, 1 << 20)
    stored = payload(1000)
    assert tier.put(b"k", stored, namespace="a")
    back = tier.get(b"k", namespace="a")
    assert torch.equal(back.tensor(), stored.tensor())
    out = torch.empty(stored.nbytes + 10, dtype=torch.uint8)
    into = tier.get(b"k", namespace="a", out=out)
    assert into.data.data_ptr() == out.data_ptr()
    assert torch.equal(into.tensor(), stored.tensor())


def test_budget_and_namespaces(tmp_path):
    tier = MmapFileTier(tmp_path, 3000)
    assert tier.put(b"k", payload(1000), namespace="a")  # 2000 bytes
    assert not tier.put(b"j", payload(1000), namespace="a")  # would exceed 3000
    assert tier.get(b"k", namespace="b") is None  # another tenant's key is a miss
    assert tier.used_bytes == 2000
    tier.delete(b"k", namespace="a")
    assert tier.used_bytes == 0 and not tier.contains(b"k", namespace="a")


def test_a_damaged_file_is_a_counted_miss(tmp_path):
    tier = MmapFileTier(tmp_path, 1 << 20)
    tier.put(b"k", payload(1000), namespace="a")
    (path,) = tier.folder.iterdir()
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert tier.get(b"k", namespace="a") is None
    assert tier.stats.errors == 1


def test_close_removes_only_its_own_folder(tmp_path):
    (tmp_path / "keep.txt").write_text("user file")
    tier = MmapFileTier(tmp_path, 1 << 20)
    tier.put(b"k", payload(10))
    tier.close()
    assert not tier.folder.exists()
    assert (tmp_path / "keep.txt").read_text() == "user file"


def test_configuration_selects_it_and_refuses_what_it_cannot_do(tmp_path):
    config = TiersConfig(host_bytes=0, disk_dir=tmp_path, disk_bytes=1 << 20, disk_backend="mmap")
    (tier,) = build_backends(config.storage())
    assert isinstance(tier, MmapFileTier) and tier.name == "disk"
    tier.close()
    with pytest.raises(KvtierError, match="neither encrypts nor persists"):
        TiersConfig(disk_dir=tmp_path, disk_bytes=1, disk_backend="mmap", encrypt=True)
    with pytest.raises(KvtierError, match="unknown 'tape'"):
        TiersConfig(disk_dir=tmp_path, disk_bytes=1, disk_backend="tape")


def test_serve_and_the_toml_table_reach_it(tmp_path):
    from kvtier.settings.load import load_settings

    tiers = load_settings(
        None,
        env={},
        sets={"tiers": ["disk_backend=mmap", "host_bytes=0"]},
        flags={"tiers": {"disk_dir": str(tmp_path)}},
    ).tiers
    assert tiers.disk_backend == "mmap" and not tiers.disk_persist  # it cannot persist
