"""The engine on a packed KV pool (EngineConfig.kv_quant), real model, against full precision.

`kv_quant=None` keeps the full-precision pool: every other test in tests/engine runs on it
(tests/engine/test_parity.py compares its logits and greedy tokens with transformers).
"""

from __future__ import annotations

import pytest
import torch

from kvtier.compress import parse_method
from kvtier.engine import Engine, EngineConfig
from kvtier.engine.quant_pool import QuantizedKVPool
from kvtier.errors import KvtierError

from .conftest import MIB, random_prompt

GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
LONG_GREEDY = {**GREEDY, "max_tokens": 64}


@pytest.fixture(scope="module")
def int8_engine() -> Engine:
    """fp32 model, INT8 pool; 32-token steps so prompts are prefilled in chunks."""
    config = EngineConfig(
        dtype="float32",
        kv_quant="int8",
        kv_cache_bytes=48 * MIB,
        max_num_seqs=8,
        max_num_batched_tokens=32,
    )
    return Engine(config)


@pytest.fixture
def int8(int8_engine: Engine):
    int8_engine.reset_prefix_cache()
    yield int8_engine
    int8_engine.set_compression(None)


def english(engine: Engine, n: int) -> list[int]:
    from pathlib import Path

    text = (Path(__file__).parents[1] / "data" / "english.txt").read_text()
    return engine.tokenizer.encode(text)[:n]


@pytest.mark.slow
def test_int8_logits_stay_close_to_full_precision(int8, fp32_engine):
    prompt = english(int8, 200)
    full = fp32_engine.score([prompt])[0].logits
    packed = int8.score([prompt])[0].logits
    # Measured on this prompt (chunks of 32, earlier chunks read back from INT8): max
    # |difference| 0.33, mean 0.011; the top token the same at 199 of 200 positions.
    assert (packed - full).abs().max() < 0.5
    assert (packed - full).abs().mean() < 0.02
    assert (packed.argmax(-1) == full.argmax(-1)).sum() >= 198


@pytest.mark.slow
def test_int8_greedy_tokens_match_full_precision(int8, fp32_engine):
    prompt = english(int8, 100)
    full = fp32_engine.generate([prompt], LONG_GREEDY)[0].token_ids
    packed = int8.generate([prompt], LONG_GREEDY)[0].token_ids
    assert packed == full  # measured: all 64 tokens equal


@pytest.mark.slow
def test_prefix_hit_returns_what_a_miss_returns(int8):
    prompt = random_prompt(45, seed=11)  # a miss prefills 32 + 13 tokens: blocks 0-1 cached
    miss = int8.generate([prompt], GREEDY)[0]
    hit = int8.generate([prompt], GREEDY)[0]
    assert (miss.num_cached_tokens, hit.num_cached_tokens) == (0, 32)
    assert hit.token_ids == miss.token_ids


@pytest.mark.slow
def test_pool_bytes_held_drop_by_the_packed_ratio(int8, fp32_engine):
    prompt = random_prompt(100, seed=3)
    full = fp32_engine.generate([prompt], {"max_tokens": 1})[0]
    packed = int8.generate([prompt], {"max_tokens": 1})[0]
    pool = int8.kv_pool
    measured_block = pool.packed.nbytes // pool.num_blocks  # bytes the tensor really holds
    assert packed.kv_bytes_held == 7 * measured_block  # ceil(101 / 16) blocks
    assert full.kv_bytes_held == 7 * fp32_engine.kv_pool.kv[0].nbytes
    assert packed.kv_bytes_held / full.kv_bytes_held == pytest.approx(0.297, abs=0.001)


@pytest.mark.slow
def test_the_tail_block_stays_full_precision(int8, fp32_engine):
    """Layer 0's K/V depend on the token embeddings only, so both engines compute them
    identically: the staged tail equals the full pool's bytes, full blocks are within the
    quantizer's half step."""
    prompt = random_prompt(40, seed=5)
    tables = []
    for engine in (int8, fp32_engine):
        rid = engine.add_request(prompt, {"max_tokens": 2})
        while engine.scheduler.requests[rid].num_computed_tokens < len(prompt):
            engine.step()
        tables.append(list(engine.kv_manager.block_table(rid)))
    pool, full_pool = int8.kv_pool, fp32_engine.kv_pool
    assert [pool.is_staged(b) for b in tables[0]] == [False, False, True]
    key, value = pool.gather(0, torch.tensor([tables[0]]))
    want_key, want_value = full_pool.gather(0, torch.tensor([tables[1]]))
    assert torch.equal(key[..., 32:40, :], want_key[..., 32:40, :])
    assert torch.equal(value[..., 32:40, :], want_value[..., 32:40, :])
    assert not torch.equal(key[..., :32, :], want_key[..., :32, :])
    step = (want_key[..., :16, :].amax(2) - want_key[..., :16, :].amin(2)) / 255
    assert torch.all((key[..., :16, :] - want_key[..., :16, :]).abs() <= step[:, :, None] + 1e-6)
    for engine in (int8, fp32_engine):
        while engine.has_unfinished_requests():
            engine.step()


@pytest.mark.slow
def test_eviction_presses_compact_a_packed_pool(int8):
    prompt = english(int8, 160)
    int8.set_compression(parse_method("snapkv:0.5"))
    out = int8.generate([prompt], GREEDY)[0]
    assert out.kv_tokens_held == 80
    assert out.kv_bytes_held == 5 * int8.kv_pool.bytes_per_block
    assert len(out.token_ids) == 24


@pytest.mark.slow
def test_a_kivi_press_on_a_packed_pool(int8):
    int8.set_compression(parse_method("kivi8"))  # what the pool already does: dropped
    assert int8.compressor is None
    with pytest.raises(KvtierError, match="would quantize it twice"):
        int8.set_compression(parse_method("kivi4"))


def test_unsupported_combinations_are_clear_errors(tmp_path):
    with pytest.raises(KvtierError, match="kv_quant must be"):
        EngineConfig(kv_quant="fp8")
    with pytest.raises(KvtierError, match="lower max_num_seqs"):
        QuantizedKVPool(30, 3, 64, 16, torch.float32, "cpu", 4 * MIB, "int4", staging_blocks=64)
