"""The KV pool's background prefault (engine/prefault.py): on a real mmap-backed pool, the
pages end up resident, no byte changes even while another thread writes the pool, and the
engine's output is the same with it running."""

from __future__ import annotations

import argparse
import ctypes
import mmap
import sys

import pytest
import torch

from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.engine.kv_pool import KVPool
from kvtier.engine.prefault import Prefaulter, page_span
from kvtier.server import command
from kvtier.settings.load import CONFIG_ENV

MIB = 1 << 20
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux")


def resident_fraction(tensor: torch.Tensor) -> float:
    """Share of the tensor's whole pages the kernel has in memory (mincore(2))."""
    address, length = page_span(tensor)
    pages = length // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert mincore(address, length, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector) / pages


def pool(budget: int) -> KVPool:
    # SmolLM2's geometry: 30 layers, 3 KV heads, head dim 64, 16-token blocks
    return KVPool(30, 3, 64, 16, torch.bfloat16, "cpu", budget)


@linux_only
def test_pages_resident_and_contents_unchanged_while_the_pool_is_written():
    kv_pool = pool(128 * MIB)
    (kv,) = kv_pool.buffers()
    assert resident_fraction(kv) < 0.05  # a fresh map: the kernel fills it on first write
    generator = torch.Generator().manual_seed(0)
    expected = torch.zeros_like(kv)
    kv[3] = expected[3] = torch.randn(kv_pool.block_shape, generator=generator)
    # small slices, so the population is still under way while this thread writes blocks
    prefault = Prefaulter([kv], slice_bytes=64 * 1024)
    writes_while_running = 0
    block = 7
    while not prefault.wait(0) and block < kv_pool.num_blocks:
        values = torch.randn(kv_pool.block_shape, generator=generator)
        kv_pool.write_blocks([block], values[None])
        expected[block] = values
        writes_while_running += 1
        block += 5
    assert prefault.wait(60)
    assert prefault.outcome == "done"
    assert writes_while_running > 0  # the engine-side writes did overlap the prefault
    assert resident_fraction(kv) == 1.0
    assert torch.equal(kv, expected)  # every written block kept, every other block zero


@linux_only
def test_close_stops_before_the_end_and_is_idempotent():
    kv_pool = pool(256 * MIB)
    (kv,) = kv_pool.buffers()
    prefault = Prefaulter([kv], slice_bytes=4096)  # 65,536 calls: far from done at once
    prefault.close()
    prefault.close()
    assert prefault.outcome == "stopped"
    assert resident_fraction(kv) < 1.0
    # a second prefault over the same pages finishes the job and leaves them zero
    again = Prefaulter([kv])
    assert again.wait(60) and again.outcome == "done"
    assert resident_fraction(kv) == 1.0 and not kv.any()


def test_tensors_off_the_cpu_are_skipped():
    meta = torch.empty(1 << 20, device="meta")
    prefault = Prefaulter([meta])
    assert prefault.wait(10)
    assert prefault.outcome in ("done", "unsupported")


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 4000 + 100 for j in range(40 + 13 * i)] for i in range(3)]


@linux_only
def test_engine_output_is_the_same_with_the_prefault_running():
    def run(prefault: bool) -> tuple[list[list[int]], Engine]:
        engine = Engine(
            EngineConfig(
                dtype="float32", kv_cache_bytes=192 * MIB, num_threads=1, prefault_kv_pool=prefault
            )
        )
        outputs = engine.generate(PROMPTS, GREEDY)
        return [list(out.token_ids) for out in outputs], engine

    without, plain = run(False)
    assert plain.prefault is None
    plain.close()
    with_prefault, engine = run(True)
    try:
        assert with_prefault == without
        assert engine.prefault.wait(60) and engine.prefault.outcome == "done"
        assert all(resident_fraction(b) == 1.0 for b in engine.kv_pool.buffers())
    finally:
        engine.close()


def test_serve_flag_reaches_the_engine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./kvtier.toml
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert parser.parse_args([]).prefault_kv_pool is None  # EngineConfig's default: on
    assert EngineConfig().prefault_kv_pool is True
    args = parser.parse_args(["--no-prefault-kv-pool", "--kv-cache-bytes", str(8 * MIB)])
    engine = command.build_engine(args)
    try:
        assert engine.config.prefault_kv_pool is False and engine.prefault is None
    finally:
        engine.close()
