"""The `[compression]` table of kvtier.toml: a preset or a pipeline of presses, validated with
errors that say what to change, and what the bench and serve commands build from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.compress import CompressionConfig, PressSpec, parse_method
from kvtier.errors import KvtierError
from kvtier.policy.config import load_config
from kvtier.settings.load import load_settings


def load_compression(path):
    """The [compression] table of the file at `path` as every command reads it."""
    return load_settings(None if path is None else str(path), env={}).compression


PIPELINE = """
[policy]
name = "retain"

[compression]
presses = [
  { name = "streaming_llm", keep_tokens = 1024, options = { num_sinks = 8 } },
  { name = "kivi", options = { bits = 4, residual = 32 } },
]
"""


@pytest.fixture
def toml(tmp_path):
    def write(text: str) -> Path:
        path = tmp_path / "kvtier.toml"
        path.write_text(text)
        return path

    return write


def test_a_pipeline_of_presses_with_options(toml):
    path = toml(PIPELINE)
    config = load_compression(path).build()
    assert config == CompressionConfig(
        presses=[
            PressSpec(name="streaming_llm", keep_tokens=1024, options={"num_sinks": 8}),
            PressSpec(name="kivi", options={"bits": 4, "residual": 32}),
        ]
    )
    assert load_config(path).name == "retain"  # the policy table beside it is unaffected


@pytest.mark.parametrize("preset", ["edge_device", "multi_turn_chat", "long_code"])
def test_a_preset_is_its_pipeline(toml, preset):
    built = load_compression(toml(f'[compression]\npreset = "{preset}"\n')).build()
    assert built == parse_method(preset)


@pytest.mark.parametrize(
    "text", ["", "[policy]\nname = 'retain'\n", '[compression]\npreset = "full"']
)
def test_no_table_no_presses_or_full_means_no_compression(toml, text):
    assert load_compression(toml(text)).build() is None
    assert load_compression(None).build() is None


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('preset = "fastest"', "compression.preset (from {path}): unknown preset 'fastest'; "),
        (
            'preset = "edge_device"\npresses = [{ name = "tova", ratio = 0.5 }]',
            "give either preset or presses, not both",
        ),
        ('presses = [{ name = "magic", ratio = 0.5 }]', "presses[0]: name: unknown press 'magic'"),
        (
            'presses = [{ name = "tova", ratio = 0.5 }, { name = "snapkv", ratio = 1.5 }]',
            "presses[1]: ratio: compression ratio must be in [0, 1)",
        ),
        ('presses = [{ name = "tova", budget = 3 }]', "presses[0]: budget: Extra inputs"),
        ("presses = []", "presses is empty"),
        ('presets = "edge_device"', "compression.presets (from {path}): unknown key; did you "),
    ],
)
def test_bad_tables_are_clear_errors(toml, table, message):
    path = toml(f"[compression]\n{table}\n")
    with pytest.raises(KvtierError) as caught:
        load_compression(path)
    assert message.format(path=path) in str(caught.value)
    assert str(path) in str(caught.value)


def test_file_problems_are_clear(tmp_path, toml):
    with pytest.raises(KvtierError, match="does not exist"):
        load_compression(tmp_path / "missing.toml")
    with pytest.raises(KvtierError, match="must be a table"):
        load_compression(toml('compression = "edge_device"\n'))


def test_auto_needs_a_workload(toml):
    section = load_compression(toml('[compression]\npreset = "auto"\n'))
    assert section.is_auto
    with pytest.raises(KvtierError, match='preset = "auto" picks by observed workload'):
        section.build()


def test_bench_resolves_auto_from_its_workload_and_pool(toml, capsys, model_dir):
    """What `kvtier bench --config` hands the engine: auto's pick for the workload it replays
    and its --kv-cache-bytes, printed and recorded with the reason."""
    from kvtier.bench.run_setup import compression as bench_compression
    from kvtier.bench.run_setup import run_settings
    from kvtier.cli import build_parser
    from kvtier.workload.generator import generate

    def pick(config: str, kv_bytes: int):
        args = build_parser().parse_args(
            ["bench", "--config", config, "--kv-cache-bytes", str(kv_bytes)]
        )
        return bench_compression(args, run_settings(args), workload)

    workload = generate("quick", seed=0)  # short chats
    auto = str(toml('[compression]\npreset = "auto"\n'))
    compression, note = pick(auto, 64 << 20)
    assert note["auto"]["preset"] == "multi_turn_chat"
    assert compression == parse_method("multi_turn_chat")
    assert note["pipeline"] == compression.model_dump()
    assert "compression auto -> multi_turn_chat (tova:0.25)" in capsys.readouterr().out
    # With a pool where everything fits, auto leaves the KV alone.
    compression, note = pick(auto, 1 << 30)
    assert compression is None and note["auto"]["preset"] == "full"
    # No [compression] table: nothing configured, nothing recorded.
    assert pick(str(toml("[policy]\nname = 'retain'\n")), 1 << 30) == (None, None)


def test_serve_refuses_auto_before_loading_a_model(toml, capsys):
    from kvtier.cli import main

    path = toml('[compression]\npreset = "auto"\n')
    assert main(["serve", "--config", str(path), "--port", "0"]) == 2
    assert 'preset = "auto" picks by observed workload' in capsys.readouterr().err
