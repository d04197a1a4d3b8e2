"""Pipeline configs and the CLI method strings: what is accepted, and clear errors otherwise."""

from __future__ import annotations

import pytest

from kvtier.compress import CompressionConfig, PressSpec, parse_method
from kvtier.errors import KvtierError


def test_parse_method_forms():
    assert parse_method("full") is None
    (snap,) = parse_method("snapkv:0.5").presses
    assert (snap.name, snap.ratio, snap.keep_tokens) == ("snapkv", 0.5, None)
    (window,) = parse_method("streaming_llm@256").presses
    assert (window.name, window.keep_tokens) == ("streaming_llm", 256)
    (kivi,) = parse_method("kivi4").presses
    assert (kivi.name, kivi.options) == ("kivi", {"bits": 4})
    assert parse_method("kivi:2").presses[0].options == {"bits": 2}
    pipeline = parse_method("snapkv:0.5+kivi8")
    assert [p.name for p in pipeline.presses] == ["snapkv", "kivi"]


def test_ratio_zero_is_identity():
    assert parse_method("tova:0").is_identity
    assert not parse_method("tova:0.25").is_identity
    assert not parse_method("streaming_llm@64").is_identity


@pytest.mark.parametrize("ratio", [1.0, -0.1, 1.5])
def test_ratio_outside_unit_interval_is_rejected(ratio):
    with pytest.raises(KvtierError, match=r"ratio must be in \[0, 1\)"):
        PressSpec(name="snapkv", ratio=ratio)


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("magic:0.5", "unknown compression method 'magic:0.5'"),
        ("snapkv:half", "'half' is not a float"),
        ("snapkv:1", r"ratio must be in \[0, 1\)"),
        ("streaming_llm@0", "keep_tokens must be a positive"),
    ],
)
def test_bad_method_strings(method, message):
    with pytest.raises(KvtierError, match=message):
        parse_method(method)


def test_unknown_press_and_double_budget():
    with pytest.raises(KvtierError, match="unknown press 'magic'"):
        CompressionConfig(presses=[{"name": "magic"}])
    with pytest.raises(KvtierError, match="either ratio or keep_tokens"):
        PressSpec(name="h2o", ratio=0.5, keep_tokens=10)


@pytest.mark.slow
def test_bad_press_options_fail_when_the_engine_builds_the_press(engine):
    with pytest.raises(KvtierError, match="press 'snapkv': bad options"):
        engine.set_compression(
            CompressionConfig(presses=[PressSpec(name="snapkv", ratio=0.5, options={"x": 1})])
        )
    with pytest.raises(KvtierError, match="pooling must be 'max' or 'avg'"):
        engine.set_compression(
            CompressionConfig(
                presses=[PressSpec(name="snapkv", ratio=0.5, options={"pooling": "median"})]
            )
        )


def test_every_preset_parses_to_a_pipeline():
    from kvtier.compress.presets import PRESETS

    for name, method in PRESETS.items():
        assert parse_method(name) == parse_method(method), name
    assert [p.name for p in parse_method("edge_device").presses] == ["streaming_llm", "kivi"]
