"""engine/native.py: C++ kernels built with the system compiler, cached, and loaded beside
torch; without a compiler (or with a source that does not build) the caller is told None and
keeps its other path."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from kvtier.engine import native, paged_decode

SOURCE = Path(paged_decode.__file__).with_name("paged_decode.cpp")


def test_the_kernel_runs_on_torchs_own_openmp_runtime():
    assert paged_decode.available()
    torch.ones(1 << 20).sum()  # torch's OpenMP workers started
    mapped = set(re.findall(r"\S*libgomp\S*", Path("/proc/self/maps").read_text()))
    assert len(mapped) == 1  # one OpenMP runtime in the process: torch's, not a second one
    assert Path(torch.__file__).parent in Path(next(iter(mapped))).parents


def test_a_build_is_cached_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CACHE", str(tmp_path))
    assert native.load(SOURCE) is not None
    (built,) = (tmp_path / "native").glob("paged_decode-*.so")
    stamp = built.stat().st_mtime_ns
    assert native.load(SOURCE) is not None
    assert built.stat().st_mtime_ns == stamp  # loaded, not built again
    assert [p.name for p in (tmp_path / "native").iterdir()] == [built.name]  # no leftovers


def test_without_a_compiler_the_caller_is_told_none(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVTIER_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "kvtier-no-such-compiler")
    with caplog.at_level(logging.WARNING, "kvtier.engine.native"):
        assert native.load(SOURCE) is None
    assert len(caplog.records) == 1 and "no C++ compiler" in caplog.text


@pytest.mark.parametrize("source", ["int broken(", "#error not this one\n"])
def test_a_failing_build_is_reported_in_one_line(tmp_path, monkeypatch, caplog, source):
    monkeypatch.setenv("KVTIER_CACHE", str(tmp_path))
    bad = tmp_path / "bad.cpp"
    bad.write_text(source)
    with caplog.at_level(logging.WARNING, "kvtier.engine.native"):
        assert native.load(bad) is None
    assert len(caplog.records) == 1 and "building bad.cpp failed" in caplog.text
    assert not list((tmp_path / "native").glob("*.so"))
