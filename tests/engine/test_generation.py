"""Generation: greedy output equals transformers', stop conditions, sampling reproducibility.

Greedy equality is checked in float32 on both sides. In bf16 the two implementations round
differently (fused q/k/v and gate/up matmuls, paged attention vs one dense call), and after
a few dozen tokens a near-tie in the argmax can flip, so bf16 equality would be luck.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import SamplingParams

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a hash function is in one sentence.",
    "Who wrote Romeo and Juliet?",
]


@pytest.mark.slow
def test_greedy_matches_transformers_generate(fp32_engine, hf_model_fp32, tokenizer):
    """64 greedy tokens for 5 chat prompts; the engine runs them as one concurrent batch,
    transformers one at a time (no padding)."""
    from kvtier.models.tokenizer import chat_token_ids

    prompts = [chat_token_ids(tokenizer, [{"role": "user", "content": c}]) for c in CHATS]
    outs = fp32_engine.generate(prompts, SamplingParams(temperature=0, max_tokens=64))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf_model_fp32.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=64,
                eos_token_id=2,
                pad_token_id=2,
            )[0, len(prompt) :].tolist()
        assert out.token_ids == ref, (out.text, tokenizer.decode(ref))
        expected_reason = "stop" if ref[-1] == 2 else "length"
        assert out.finish_reason == expected_reason


def test_text_is_the_decoded_tokens(bf16_engine, tokenizer):
    (out,) = bf16_engine.generate(
        ["Once upon a time"], SamplingParams(temperature=0, max_tokens=40)
    )
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_stop_string_is_trimmed(bf16_engine):
    prompt = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    (full,) = bf16_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40))
    assert "5" in full.text
    stop = full.text[full.text.index("5") : full.text.index("5") + 2]
    (out,) = bf16_engine.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    )
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]


def test_stop_token_ids_and_max_tokens(bf16_engine):
    (free,) = bf16_engine.generate(["The sky is"], SamplingParams(temperature=0, max_tokens=8))
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    stop_id = free.token_ids[3]
    (out,) = bf16_engine.generate(
        ["The sky is"], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id])
    )
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_whatever_the_batch(bf16_engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=24, seed=1234)
    (alone,) = bf16_engine.generate(["Tell me a story."], params)
    batch = bf16_engine.generate(
        ["Tell me a story.", "Another prompt", "And a third one"],
        [params, SamplingParams(temperature=1.0, max_tokens=30), SamplingParams(temperature=0)],
    )
    assert batch[0].token_ids == alone.token_ids


@pytest.mark.slow
def test_top_k_one_is_greedy(bf16_engine):
    (greedy,) = bf16_engine.generate(["Paris is"], SamplingParams(temperature=0, max_tokens=16))
    (top1,) = bf16_engine.generate(
        ["Paris is"], SamplingParams(temperature=1.5, top_k=1, max_tokens=16)
    )
    assert top1.token_ids == greedy.token_ids


def test_metrics_are_recorded(bf16_engine):
    (out,) = bf16_engine.generate(
        ["Hello"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    m = out.metrics
    assert m.ttft_s is not None and m.ttft_s > 0
    assert len(m.itl_s) == 4 and all(x >= 0 for x in m.itl_s)
    assert m.e2e_s >= m.ttft_s


class _CountingSampler:
    """The engine's own sampler, counting its calls and rows; rows of requests with seed
    `poison` raise, as a NaN row would."""

    def __init__(self, inner, poison: int | None = None) -> None:
        self.inner, self.poison = inner, poison
        self.calls: list[int] = []

    def __call__(self, logits, params, generators):
        self.calls.append(len(params))
        if self.poison is not None and any(p.seed == self.poison for p in params):
            raise RuntimeError("injected sampling fault")
        return self.inner(logits, params, generators)


def test_a_step_samples_all_its_rows_in_one_call(bf16_engine):
    """One call per step: on a GPU one copy of the ids to the host, not one per sequence."""
    sampler = _CountingSampler(bf16_engine.sampler)
    bf16_engine.sampler = sampler
    try:
        outs = bf16_engine.generate(
            ["One", "Two words", "Three words here"],
            [
                SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True),
                *[SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 2,
            ],
        )
    finally:
        bf16_engine.sampler = sampler.inner
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    assert sampler.calls == [3] * 6  # the prefill step, then 5 decode steps: 3 rows each


@pytest.mark.slow
def test_a_row_that_cannot_be_sampled_fails_alone_with_the_same_draws(bf16_engine):
    params = SamplingParams(temperature=0.9, top_k=50, max_tokens=12, seed=77)
    (alone,) = bf16_engine.generate(["Tell me a story."], params)
    sampler = _CountingSampler(bf16_engine.sampler, poison=4711)
    bf16_engine.sampler = sampler
    try:
        good, bad = bf16_engine.generate(
            ["Tell me a story.", "Another prompt"],
            [params, SamplingParams(temperature=0.9, max_tokens=12, seed=4711)],
        )
    finally:
        bf16_engine.sampler = sampler.inner
    assert bad.finish_reason == "error" and "sampling" in (bad.error or "")
    # the batch call failed, its generators were put back, the row was sampled alone
    assert good.token_ids == alone.token_ids


def test_a_greedy_answer_is_bitwise_the_same_alone_and_beside_a_request_that_joins(bf16_engine):
    """A sequence decoding alone runs its matmuls on one row; once another request joins,
    on many. oneDNN takes another kernel for one row, which rounded some outputs differently
    on real activations, so the engine never hands it one row (`llama.Linear`): every step's
    logits are the same bits either way, so the answer cannot change."""
    engine = bf16_engine
    good = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    steps: dict[str, list[torch.Tensor]] = {}
    inner, phase = engine.sampler, ["alone"]

    def recording(logits, params, generators):
        for row, p in enumerate(params):
            if p.max_tokens == good.max_tokens and p.temperature == 0:
                steps.setdefault(phase[0], []).append(logits[row].clone())
        return inner(logits, params, generators)

    prompt = [{"role": "user", "content": CHATS[3]}]
    engine.sampler = recording
    try:
        engine.add_request(prompt, good)
        while engine.has_unfinished_requests():
            engine.step()
        engine.reset_prefix_cache()
        phase[0] = "beside"
        engine.add_request(prompt, good)
        for _ in range(3):  # the prefill and two decodes alone
            engine.step()
        # mid-answer: the other's prefill joins the decodes, then they decode side by side
        engine.add_request("Name a colour.", SamplingParams(temperature=0.7, seed=3, max_tokens=6))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.sampler = inner
    assert len(steps["alone"]) == len(steps["beside"]) == good.max_tokens
    for alone, beside in zip(steps["alone"], steps["beside"], strict=True):
        assert torch.equal(alone, beside)
