"""Bad input fails clearly (KvtierError naming the problem) and never hurts other requests."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.errors import KvtierError
from tests.host_dtype import BLOCK_BYTES

from .conftest import random_prompt


@pytest.fixture(scope="module")
def small_engine() -> Engine:
    """Context capped at 256 tokens; pool of 12 blocks (192 tokens)."""
    return Engine(EngineConfig(max_model_len=256, kv_cache_bytes=12 * BLOCK_BYTES))


@pytest.mark.slow
def test_oversized_prompts_fail_alone(small_engine):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [
        random_prompt(20, 1),
        random_prompt(300, 2),
        random_prompt(200, 3),
        random_prompt(30, 4),
    ]
    outs = small_engine.generate(prompts, greedy)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert "model context is 256" in outs[1].error
    assert "needing 13 KV blocks, but the pool holds 12" in outs[2].error
    assert len(outs[0].token_ids) == len(outs[3].token_ids) == 8
    with pytest.raises(KvtierError, match="model context"):
        small_engine.add_request(random_prompt(256, 5), greedy)


@pytest.mark.slow
def test_generation_that_outgrows_the_pool_ends_with_length(small_engine):
    (out,) = small_engine.generate(
        [random_prompt(180, 6)], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    )
    # 12 blocks hold 192 tokens: 180 prompt + 13 generated (the last needs no KV slot).
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 13
    assert "KV pool exhausted" in out.error
    assert small_engine.stats().kv_blocks_used == 0


@pytest.mark.slow
def test_generation_stops_at_the_model_context():
    engine = Engine(EngineConfig(max_model_len=64, kv_cache_bytes=8 * BLOCK_BYTES))
    (out,) = engine.generate(
        [random_prompt(60, 7)], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    )
    assert out.finish_reason == "length" and len(out.token_ids) == 4


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(small_engine, prompt):
    with pytest.raises(KvtierError, match="prompt is empty"):
        small_engine.add_request(prompt)


def test_bad_token_ids(small_engine):
    with pytest.raises(KvtierError, match="out of the vocabulary"):
        small_engine.add_request([1, 2, 49152])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": -3}, "max_tokens must be >= 1"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer"),
        ({"stop": [""]}, "stop must be a list of non-empty strings"),
        ({"max_tokns": 5}, "unknown sampling parameter.*'max_tokns'"),
        ({"temprature": 0.5, "beam": 2}, "'beam', 'temprature'"),
    ],
)
def test_bad_sampling_params(small_engine, params, message):
    with pytest.raises(KvtierError, match=message):
        SamplingParams.from_dict(params)
    with pytest.raises(KvtierError, match=message):
        small_engine.add_request("hello", params)


def test_stream_of_an_oversized_prompt_raises(small_engine):
    async def consume():
        async for _ in small_engine.stream(random_prompt(300, 8)):
            pass

    try:
        with pytest.raises(KvtierError, match="model context"):
            asyncio.run(consume())
    finally:
        small_engine.close()


def test_config_is_validated():
    with pytest.raises(KvtierError, match="dtype"):
        EngineConfig(dtype="float16")
    with pytest.raises(KvtierError, match="block_size must be a positive integer"):
        EngineConfig(block_size=0)
    with pytest.raises(KvtierError, match="priority"):
        EngineConfig(priority="fifo")
