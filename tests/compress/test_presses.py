"""Each press on hand-made layers: it keeps exactly its budget, and the tokens it should."""

from __future__ import annotations

import pytest
import torch

from kvtier.compress.presses.base import LayerView
from kvtier.compress.presses.h2o import H2OPress
from kvtier.compress.presses.knorm import KnormPress
from kvtier.compress.presses.scissorhands import ScissorhandsPress
from kvtier.compress.presses.snapkv import SnapKVPress
from kvtier.compress.presses.streaming_llm import StreamingLLMPress
from kvtier.compress.presses.tova import TOVAPress
from kvtier.errors import KvtierError

HEADS, GROUP, T, D = 3, 3, 100, 16


def make_view(seed: int = 0, window: int = 8, attention_sum: bool = False) -> LayerView:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(HEADS, T, D, generator=g)
    queries = torch.randn(HEADS, GROUP, window, D, generator=g)
    view = LayerView(
        layer=0,
        keys=keys,
        values=torch.randn(HEADS, T, D, generator=g),
        key_positions=torch.arange(T).expand(HEADS, -1),
        queries=queries,
        query_positions=torch.arange(T - window, T),
        attention_sum=None,
        scale=D**-0.5,
    )
    if attention_sum:
        view.attention_sum = view.window_attention().sum(dim=2)
    return view


def make_needle_view(needle: int, window: int = 8) -> LayerView:
    """A layer whose last queries all point at the key of token `needle` (in every head)."""
    view = make_view(window=window)
    direction = torch.zeros(D)
    direction[0] = 1.0
    view.keys[:, needle] = direction * 4
    view.queries[:] = direction * 8
    return view


ALL_PRESSES = [
    StreamingLLMPress,
    KnormPress,
    TOVAPress,
    SnapKVPress,
    H2OPress,
    ScissorhandsPress,
]


@pytest.mark.parametrize("press_class", ALL_PRESSES)
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.875])
def test_keeps_exactly_the_budget_per_head(press_class, ratio):
    press = press_class(ratio=ratio)
    view = make_view(attention_sum=True)
    budget = press.budget(T)
    assert budget == int(T * (1 - ratio))
    kept = press.select(view, budget)
    assert kept.shape == (HEADS, budget)
    for head in kept:
        assert head.unique().numel() == budget  # no slot twice
        assert torch.all(head[1:] > head[:-1])  # ascending: slots stay in position order


@pytest.mark.parametrize("press_class", ALL_PRESSES)
def test_keep_tokens_budget(press_class):
    press = press_class(keep_tokens=30)
    assert press.budget(T) == 30
    assert press.budget(20) == 20  # never more than there is
    assert press.select(make_view(attention_sum=True), 30).shape == (HEADS, 30)


def test_streaming_llm_keeps_sinks_and_recent_window():
    kept = StreamingLLMPress(keep_tokens=20, num_sinks=4).select(make_view(), 20)
    expected = torch.cat((torch.arange(4), torch.arange(T - 16, T)))
    assert torch.equal(kept, expected.expand(HEADS, -1))


def test_streaming_llm_decode_bound():
    press = StreamingLLMPress(keep_tokens=20, num_sinks=4)
    assert press.decode_keep(20) is None
    keep = press.decode_keep(50)
    assert torch.equal(keep, torch.cat((torch.arange(4), torch.arange(34, 50))))
    assert StreamingLLMPress(ratio=0.5).decode_keep(10_000) is None  # a ratio never bounds


def test_knorm_keeps_the_smallest_keys():
    view = make_view()
    kept = KnormPress(ratio=0.5).select(view, 50)
    norms = view.keys.norm(dim=-1)
    for head in range(HEADS):
        threshold = norms[head].sort().values[49]
        assert torch.all(norms[head, kept[head]] <= threshold)


@pytest.mark.parametrize("press_class", [TOVAPress, SnapKVPress, ScissorhandsPress, H2OPress])
def test_query_aware_presses_keep_what_the_question_attends_to(press_class):
    needle = 37
    view = make_needle_view(needle)
    view.attention_sum = view.window_attention().sum(dim=2)
    kept = press_class(ratio=0.875).select(view, 12)
    assert torch.all((kept == needle).any(dim=-1)), f"{press_class.__name__} lost the needle"


def test_snapkv_keeps_its_observation_window_and_neighbours():
    view = make_needle_view(40, window=8)
    kept = SnapKVPress(ratio=0.8, window=8, kernel_size=5).select(view, 20)
    for head in kept.tolist():
        assert set(range(T - 8, T)) <= set(head)  # the window
        assert {38, 39, 40, 41, 42} <= set(head)  # the needle and its pooled neighbours


def test_snapkv_is_gqa_aware_per_kv_head():
    # Each KV head's group looks at a different token: each head keeps its own.
    view = make_view(window=4)
    view.queries[:] = 0
    for head, needle in enumerate((10, 20, 30)):
        view.keys[head, needle] = 0
        view.keys[head, needle, head] = 6.0
        view.queries[head, :, :, head] = 6.0
    kept = SnapKVPress(ratio=0.9, window=4, kernel_size=1).select(view, 10)
    for head, needle in enumerate((10, 20, 30)):
        assert needle in kept[head].tolist()
        others = {10, 20, 30} - {needle}
        assert not others & set(kept[head].tolist())


def test_tova_keeps_the_same_tokens_in_every_head():
    kept = TOVAPress(ratio=0.5).select(make_view(), 50)
    assert torch.equal(kept[0], kept[1]) and torch.equal(kept[1], kept[2])
    assert (kept == T - 1).any(dim=-1).all()  # the last token is always kept


def test_h2o_reserves_the_recent_share():
    view = make_view(attention_sum=True)
    kept = H2OPress(ratio=0.5, recent_share=0.5).select(view, 50)
    for head in kept.tolist():
        assert set(range(T - 25, T)) <= set(head)


def test_h2o_without_recorded_attention_is_a_clear_error():
    with pytest.raises(KvtierError, match="accumulated attention"):
        H2OPress(ratio=0.5).select(make_view(), 50)


def test_bad_ratio_on_a_press_object():
    with pytest.raises(KvtierError, match=r"\[0, 1\)"):
        SnapKVPress(ratio=1.0)
