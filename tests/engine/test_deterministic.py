"""Deterministic mode (`EngineConfig.deterministic`) on the embedded model in bf16: a prompt's
logits, and a request's greedy tokens, are the same bits alone, in batches of 1 to 32 with
random companions, cut into chunks anywhere, and on KV that decodes wrote instead of a
prefill. Where the mode cannot run, the engine refuses it with the reason."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.compress import CompressionConfig, PressSpec
from kvtier.engine import Engine, EngineConfig, SamplingParams, prefill_attention
from kvtier.engine.engine import default_namespace
from kvtier.errors import KvtierError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not prefill_attention.available(), reason="needs AVX512_BF16 and a C++ compiler"
    ),
]

VOCAB = 49_000


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(deterministic=True, kv_cache_bytes=1 << 29, prefault_kv_pool=False))


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_prompt_logits_alone_in_batches_and_after_a_prefix_hit(engine: Engine):
    rng = random.Random(0)
    prompt = tokens(rng, 1100)  # spans 512-token chunks and 64-key blocks
    engine.reset_prefix_cache()
    (alone,) = engine.score([prompt])
    assert alone.start_position == 0
    for size in (2, 5, 13, 32):
        engine.reset_prefix_cache()
        batch = [tokens(rng, rng.randrange(1, 300)) for _ in range(size - 1)]
        at = rng.randrange(size)
        batch.insert(at, prompt)
        got = engine.score(batch)[at]
        assert torch.equal(got.logits, alone.logits), size
    # a prefix hit of a random length: the rest is one chunk starting mid-prompt
    engine.reset_prefix_cache()
    engine.score([prompt[: rng.randrange(200, 1000)]])
    (rest,) = engine.score([prompt])
    assert 0 < rest.start_position < len(prompt)
    assert torch.equal(rest.logits, alone.logits[rest.start_position :])


def test_chunk_boundaries_do_not_move_a_bit():
    rng = random.Random(1)
    prompt = tokens(rng, 700)
    logits = []
    for budget in (512, 96, 37):  # chunks of the step budget, cut at other positions
        engine = Engine(
            EngineConfig(
                deterministic=True,
                max_num_batched_tokens=budget,
                kv_cache_bytes=1 << 28,
                prefault_kv_pool=False,
            )
        )
        logits.append(engine.score([prompt])[0].logits)
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


def test_greedy_tokens_alone_and_batched_with_random_companions(engine: Engine):
    rng = random.Random(2)
    prompt = tokens(rng, 600)
    engine.reset_prefix_cache()
    (alone,) = engine.generate([prompt], greedy(48))
    for size in (1, 4, 16, 32):
        engine.reset_prefix_cache()
        companions = [tokens(rng, rng.randrange(1, 400)) for _ in range(size)]
        at = rng.randrange(size + 1)
        batch = [*companions[:at], prompt, *companions[at:]]
        params = [greedy(rng.randrange(1, 64)) for _ in batch]
        params[at] = greedy(48)
        assert engine.generate(batch, params)[at].token_ids == alone.token_ids, size


def test_a_turn_over_kv_that_decodes_wrote_equals_it_recomputed(engine: Engine):
    """The next turn's history holds the answer, whose KV the decodes wrote: cached, its
    logits equal those of the same history recomputed by one prefill."""
    rng = random.Random(3)
    for _ in range(3):
        first = tokens(rng, rng.randrange(100, 700))
        engine.reset_prefix_cache()
        (answer,) = engine.generate([first], greedy(rng.randrange(20, 90)))
        second = first + answer.token_ids + tokens(rng, 40)
        (cached,) = engine.score([second])  # decode-written blocks found in the prefix cache
        assert cached.start_position >= len(first)
        engine.reset_prefix_cache()
        (recomputed,) = engine.score([second])
        assert recomputed.start_position == 0
        assert torch.equal(cached.logits, recomputed.logits[cached.start_position :])


def test_where_the_mode_cannot_run_the_engine_says_why():
    with pytest.raises(KvtierError, match=r"deterministic mode is not available here: .*bfloat16"):
        Engine(EngineConfig(deterministic=True, dtype="float32", kv_cache_bytes=1 << 26))
    with pytest.raises(KvtierError, match="no kv_quant"):
        Engine(EngineConfig(deterministic=True, kv_quant="int8", kv_cache_bytes=1 << 26))


def test_its_kv_is_namespaced_apart_from_the_default_mode(engine: Engine):
    """A server in deterministic mode never restores KV that the default mode wrote (its
    decode-written blocks round otherwise)."""
    assert engine.namespace == default_namespace(engine.model_dir, "bfloat16", deterministic=True)
    assert engine.namespace != default_namespace(engine.model_dir, "bfloat16")


def test_a_press_that_scores_attention_is_refused_and_the_pipeline_kept(engine: Engine):
    """h2o reads attention weights, which this mode never computes: refused, and the engine
    keeps serving with the pipeline it had."""
    h2o = CompressionConfig(presses=[PressSpec(name="h2o", keep_tokens=64)])
    before = engine.config.compression
    with pytest.raises(KvtierError, match="attention observers"):
        engine.set_compression(h2o)
    assert engine.config.compression is before and engine.compressor is None
    assert not engine.model.attention.observers
    (out,) = engine.generate([tokens(random.Random(4), 100)], greedy(4))
    assert out.finish_reason == "length"
