"""`EngineConfig.prefill_attention` on a real engine: what computes a bf16 prefill's
attention is settled at start, kept in the config (the startup line names it), and the kernel
asked by name where it cannot run is refused with the reason before the weights load."""

from __future__ import annotations

import pytest

from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.engine import prefill_attention as kernel
from kvtier.errors import KvtierError

POOL = 1 << 24


def test_auto_settles_on_the_kernel_wherever_it_runs():
    """AMX CPUs included: the kernel gives a row the same bits in any chunk."""
    engine = Engine(EngineConfig(kv_cache_bytes=POOL))
    runs_kernel = engine.config.dtype == "bfloat16" and kernel.available()
    assert engine.config.prefill_attention == ("kernel" if runs_kernel else "torch")
    assert engine.model.attention.prefill_kernel is runs_kernel
    with pytest.raises(KvtierError, match="prefill_attention must be 'auto', 'kernel' or 'torch'"):
        EngineConfig(prefill_attention="flash")  # type: ignore[arg-type]


def test_torch_by_name_runs_on_any_host():
    """In bf16, where the kernel would run on an AVX512_BF16 CPU."""
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
