"""`EngineConfig.prefill_attention` on a real engine: what computes a bf16 prefill's
attention is settled at start, kept in the config (the startup line names it), and the kernel
asked by name where it cannot run is refused with the reason before the weights load."""

from __future__ import annotations

import pytest

from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.engine import prefill_attention as kernel
from kvtier.engine.config import resolve_prefill_attention
from kvtier.errors import KvtierError
from kvtier.host_cpu import host_cpu

POOL = 1 << 24


def test_auto_settles_on_what_runs_on_this_host():
    engine = Engine(EngineConfig(kv_cache_bytes=POOL))
    runs_kernel = (
        engine.config.dtype == "bfloat16"
        and not host_cpu().amx  # there torch's flash attention uses the AMX tiles
        and kernel.available()
    )
    assert engine.config.prefill_attention == ("kernel" if runs_kernel else "torch")
    assert engine.model.attention.prefill_kernel is runs_kernel
    assert resolve_prefill_attention("auto") == ("torch" if host_cpu().amx else "kernel")


def test_torch_by_name_runs_on_any_host():
    """In bf16, where the kernel would run on an AVX512_BF16 CPU without AMX."""
    config = EngineConfig(kv_cache_bytes=POOL, dtype="bfloat16", prefill_attention="torch")
    engine = Engine(config)
    assert engine.config.prefill_attention == "torch"
    assert engine.model.attention.prefill_kernel is False
    (out,) = engine.generate(
        ["The capital of France is"], SamplingParams(temperature=0, max_tokens=8)
    )
    assert "Paris" in out.text


def test_the_kernel_by_name_where_it_cannot_run_is_refused_with_the_reason():
    with pytest.raises(
        KvtierError,
        match="prefill_attention 'kernel' is not available here: it needs dtype bfloat16",
    ):
        Engine(EngineConfig(kv_cache_bytes=POOL, dtype="float32", prefill_attention="kernel"))


def test_deterministic_mode_refuses_torch_by_name():
    """Its kernel computes every row, prefill chunks too."""
    config = EngineConfig(kv_cache_bytes=POOL, deterministic=True, prefill_attention="torch")
    with pytest.raises(KvtierError, match="'torch' does not combine with deterministic mode"):
        Engine(config)


@pytest.mark.skipif(not kernel.available(), reason="deterministic mode needs AVX512_BF16 and g++")
def test_deterministic_mode_names_its_kernel_whatever_auto_would_pick():
    engine = Engine(EngineConfig(kv_cache_bytes=POOL, dtype="bfloat16", deterministic=True))
    assert engine.config.prefill_attention == "kernel"
