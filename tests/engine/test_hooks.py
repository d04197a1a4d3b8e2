"""Hooks seen from the outside: attention observers and block lifecycle listeners."""

from __future__ import annotations

import torch

from kvtier.engine import SamplingParams

from .conftest import random_prompt
from .test_block_pool import Recorder


class WeightRecorder:
    needs_weights = True

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def observe(self, layer_idx, request_ids, query, key, attn_weights, key_lens) -> None:
        self.calls.append(
            (layer_idx, list(request_ids), query.shape, key.shape, attn_weights, key_lens)
        )


def test_observer_sees_every_layer_and_does_not_change_results(fp32_engine):
    prompt = random_prompt(40, 50)
    (plain,) = fp32_engine.score([prompt])
    fp32_engine.reset_prefix_cache()
    observer = WeightRecorder()
    fp32_engine.add_attention_observer(observer)
    try:
        (observed,) = fp32_engine.score([prompt])
    finally:
        fp32_engine.remove_attention_observer(observer)

    assert torch.allclose(plain.logits, observed.logits, atol=1e-4)
    assert [c[0] for c in observer.calls] == list(range(30))
    _, request_ids, q_shape, k_shape, weights, key_lens = observer.calls[0]
    assert len(request_ids) == 1
    assert q_shape == (1, 9, 40, 64) and k_shape == (1, 3, 40, 64)
    assert weights.shape == (1, 9, 40, 40) and key_lens.tolist() == [40]
    assert torch.allclose(weights.sum(-1), torch.ones(1, 9, 40))
    assert torch.all(weights.triu(1) == 0)  # causal: no weight on future positions


def test_observer_on_a_padded_decode_batch(bf16_engine):
    observer = WeightRecorder()
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    bf16_engine.add_request(random_prompt(10, 51), params)
    bf16_engine.add_request(random_prompt(30, 52), params)
    bf16_engine.step()  # both prefills
    bf16_engine.add_attention_observer(observer)
    try:
        bf16_engine.step()  # one decode each, batched and padded to the longer context
    finally:
        bf16_engine.remove_attention_observer(observer)
    _, request_ids, q_shape, _, weights, key_lens = observer.calls[0]
    assert len(request_ids) == 2 and q_shape == (2, 9, 1, 64)
    assert key_lens.tolist() == [11, 31]  # running order: the 10-token prompt first
    assert torch.all(weights[0, :, :, 11:] == 0)  # nothing on the padding
    assert torch.allclose(weights.float().sum(-1), torch.ones(2, 9, 1), atol=1e-2)


def test_block_listener_sees_fill_free_and_eviction(bf16_engine):
    recorder = Recorder()
    bf16_engine.add_block_listener(recorder)
    try:
        bf16_engine.generate([random_prompt(40, 53)], SamplingParams(temperature=0, max_tokens=1))
        filled = [e for e in recorder.events if e[0] == "filled"]
        freed = [e for e in recorder.events if e[0] == "freed"]
        assert len(filled) == 2  # 40 tokens: two full blocks of 16 are cached
        assert {e[1] for e in freed} == {e[1] for e in filled}  # idle, still cached
        bf16_engine.reset_prefix_cache()
        evicted = [e for e in recorder.events if e[0] == "evicted"]
        assert {(e[1], e[2]) for e in evicted} == {(e[1], e[2]) for e in filled}
    finally:
        bf16_engine.remove_block_listener(recorder)
