"""The engine computes the same logits as transformers' LlamaForCausalLM.

What is compared: for each prompt, the float32 logits the engine computes at every position
it runs (through its real scheduler, paged pool and attention, via `Engine.score`) against
the logits transformers' `LlamaForCausalLM` (same folder, float32, one unpadded sequence per
forward, no cache) gives at the same positions. Tolerance: 1e-3 max absolute difference.
"""

from __future__ import annotations

import torch

from .conftest import random_prompt

TOL = 1e-3


def reference_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def assert_matches(hf_model, token_ids: list[int], out) -> None:
    ref = reference_logits(hf_model, token_ids)[out.start_position :]
    assert out.logits.shape == ref.shape
    diff = (out.logits - ref).abs().max().item()
    assert diff < TOL, f"max abs logit difference {diff:.2e} over {len(token_ids)} tokens"


def test_single_sequences_match(fp32_engine, hf_model_fp32):
    for n, seed in ((1, 1), (17, 2), (150, 3)):
        prompt = random_prompt(n, seed)
        (out,) = fp32_engine.score([prompt])
        assert out.start_position == 0
        assert_matches(hf_model_fp32, prompt, out)


def test_mixed_batch_in_one_step_matches(fp32_engine, hf_model_fp32):
    prompts = [random_prompt(n, 10 + n) for n in (5, 33, 64, 120)]
    steps_before = fp32_engine.stats().num_steps
    outs = fp32_engine.score(prompts)
    # All four prompts (222 tokens < the 512-token budget) ran as one flat batch.
    assert fp32_engine.stats().num_steps == steps_before + 1
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches(hf_model_fp32, prompt, out)


def test_prefix_cache_hit_matches(fp32_engine, hf_model_fp32):
    shared = random_prompt(80, 20)  # 5 full blocks of 16
    first = shared + random_prompt(7, 21)
    second = shared + random_prompt(30, 22)
    fp32_engine.score([first])
    (out,) = fp32_engine.score([second])
    assert out.num_cached_tokens == 80
    assert out.start_position == 80  # the shared blocks were reused, not recomputed
    assert_matches(hf_model_fp32, second, out)


def test_chunked_prefill_matches(chunked_engine, hf_model_fp32):
    prompt = random_prompt(100, 30)
    steps_before = chunked_engine.stats().num_steps
    (out,) = chunked_engine.score([prompt])
    assert chunked_engine.stats().num_steps == steps_before + 4  # 32 + 32 + 32 + 4 tokens
    assert_matches(hf_model_fp32, prompt, out)


def test_chunked_prefill_with_cached_prefix_matches(chunked_engine, hf_model_fp32):
    """A chunk boundary (32) that does not coincide with the cached prefix (48)."""
    prompt = random_prompt(100, 31)
    chunked_engine.score([prompt[:50]])
    (out,) = chunked_engine.score([prompt])
    assert out.start_position == 48
    assert_matches(hf_model_fp32, prompt, out)
