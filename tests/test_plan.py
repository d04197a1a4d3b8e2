"""`kvtier plan`: KV bytes per model geometry, what fits where, reload vs recompute.

Figures pinned here come from the project's source documents (a 70B model with 80 layers, 8 KV
heads of dim 128 in fp16) and from the published configs of the bundled models.
"""

from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources

import pytest

from kvtier.cli import main
from kvtier.errors import KvtierError
from kvtier.plan.config import bundled_names
from kvtier.plan.geometry import ModelGeometry, load_geometry
from kvtier.plan.hardware import ACCELERATORS, DEFAULT_EFFICIENCY, transfer_seconds
from kvtier.plan.kv_dtypes import get_kv_dtype
from kvtier.plan.planner import plan, prefill_flops
from kvtier.plan.report import verdict
from kvtier.units import format_bytes, format_gib, parse_size, parse_token_counts

GB = 10**9


def run_plan(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def bundled_config(name: str) -> dict:
    return json.loads((resources.files("kvtier") / "data" / "models" / f"{name}.json").read_text())


def make_plan(model: str, *contexts: int, **options):
    settings = {
        "kv_dtype": get_kv_dtype("bf16"),
        "weight_dtype": get_kv_dtype("bf16"),
        "accelerator": ACCELERATORS["h100-sxm"],
        "group_size": 32,
        "efficiency": DEFAULT_EFFICIENCY,
    }
    return plan(load_geometry(model), contexts, **{**settings, **options})


# --- bytes per token and per sequence --------------------------------------------------------


def test_seed_70b_needs_327680_bytes_per_token():
    assert load_geometry("seed-70b").bytes_per_token("fp16") == 327_680  # 2 x 80 x 8 x 128 x 2


@pytest.mark.parametrize(
    ("tokens", "gb", "gib"),
    [(8_000, "2.62 GB", "2.44 GiB"), (128_000, "41.9 GB", "39.1 GiB")],
)
def test_seed_70b_sequence_sizes_in_decimal_and_binary_units(tokens, gb, gib):
    nbytes = load_geometry("seed-70b").kv_bytes(tokens, "fp16")
    assert nbytes == tokens * 327_680
    assert (format_bytes(nbytes), format_gib(nbytes)) == (gb, gib)


def test_smollm2_135m_needs_23040_bytes_per_token_in_bf16():
    assert load_geometry("smollm2-135m").bytes_per_token("bf16") == 23_040


def test_gqa_with_8_of_64_heads_is_exactly_8x_smaller_than_mha():
    gqa = load_geometry("seed-70b")
    mha = replace(gqa, num_kv_heads=64)
    assert (gqa.attention, mha.attention) == ("GQA", "MHA")
    assert mha.kv_bytes(128_000) == 8 * gqa.kv_bytes(128_000)


def test_one_kv_head_is_mqa():
    assert replace(load_geometry("seed-70b"), num_kv_heads=1).attention == "MQA"


def test_gemma_3_sliding_layers_hold_at_most_the_window():
    gemma = load_geometry("gemma-3-27b")
    assert (gemma.num_layers, gemma.num_kv_heads, gemma.head_dim) == (62, 16, 128)
    assert gemma.sliding_window == 1024
    # 5 local layers then 1 global: layers 6, 12, ..., 60 (1-based) are global
    assert gemma.num_sliding_layers == 52
    assert not gemma.sliding_layers[5] and gemma.sliding_layers[4]

    per_layer_token = 2 * 16 * 128 * 2
    tokens = 128_000
    expected = (10 * tokens + 52 * 1024) * per_layer_token
    dense = 62 * tokens * per_layer_token
    assert gemma.kv_bytes(tokens) == expected
    assert gemma.kv_bytes(tokens) < dense / 5
    # asymptotically only the global layers grow; below the window every layer counts
    assert gemma.bytes_per_token() == 10 * per_layer_token
    assert gemma.average_bytes_per_token(1000) == 62 * per_layer_token


def test_deepseek_v3_caches_one_latent_per_layer_and_token():
    deepseek = load_geometry("deepseek-v3")
    assert deepseek.attention == "MLA"
    assert deepseek.bytes_per_token("bf16") == 61 * (512 + 64) * 2 == 70_272


def test_qwen_configs_with_sliding_window_disabled_are_dense():
    qwen = load_geometry("qwen2.5-7b")
    assert qwen.num_sliding_layers == 0
    assert qwen.bytes_per_token() == 2 * 28 * 4 * 128 * 2


def test_mistral_style_config_slides_on_every_layer():
    mistral = ModelGeometry.from_hf_config(
        {
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 4096,
            "sliding_window": 4096,
            "num_parameters": 7_000_000_000,
        }
    )
    assert mistral.num_sliding_layers == 32
    assert mistral.kv_bytes(100_000) == mistral.kv_bytes(4096)


# --- quantized KV ---------------------------------------------------------------------------


def test_int4_payload_and_group_overhead_on_seed_70b_at_128k():
    seed = load_geometry("seed-70b")
    elements = seed.kv_elements(128_000)
    assert elements * 4 // 8 == 10_485_760_000  # 4-bit payload: 10.5 GB
    with_scales = seed.kv_bytes(128_000, "int4", group_size=32)  # + fp16 scale and zero / 32
    assert with_scales == 13_107_200_000
    assert format_bytes(with_scales) == "13.1 GB"


@pytest.mark.parametrize(
    ("dtype", "group", "bytes_per_element"),
    [("fp32", 32, 4), ("fp16", 32, 2), ("fp8", 32, 1), ("int8", 32, 1.125), ("int2", 64, 0.3125)],
)
def test_bytes_per_element_includes_group_metadata_for_integer_formats(
    dtype, group, bytes_per_element
):
    assert get_kv_dtype(dtype).bytes_per_element(group) == bytes_per_element


def test_unknown_kv_dtype_is_a_clear_error():
    with pytest.raises(KvtierError, match="int3"):
        get_kv_dtype("int3")


# --- configs --------------------------------------------------------------------------------


def test_every_bundled_config_loads():
    names = bundled_names()
    assert {"seed-70b", "llama-3.1-405b", "gemma-3-27b", "deepseek-v3", "smollm2-135m"} <= set(
        names
    )
    for name in names:
        geometry = load_geometry(name)
        assert geometry.bytes_per_token() > 0 and geometry.num_parameters > 0


def test_names_are_case_insensitive_and_hub_ids_are_aliases():
    assert load_geometry("meta-llama/Llama-3.1-8B-Instruct").name == "llama-3.1-8b"
    assert load_geometry("LLAMA-3.1-70B").name == "llama-3.1-70b"
    assert load_geometry("google/gemma-3-27b-it").name == "gemma-3-27b"


def test_parameter_counts_match_published_sizes():
    assert load_geometry("smollm2-135m").num_parameters == 134_515_008
    assert load_geometry("llama-3.1-8b").num_parameters == 8_030_261_248
    assert load_geometry("llama-3.1-70b").num_parameters == pytest.approx(70.55e9, rel=1e-3)


def test_moe_counts_all_experts_for_memory_and_routed_ones_for_compute():
    config = bundled_config("deepseek-v3")
    del config["num_parameters"], config["num_active_parameters"]
    derived = ModelGeometry.from_hf_config(config)
    assert derived.num_parameters == pytest.approx(671e9, rel=0.01)
    assert derived.num_active_parameters == pytest.approx(37e9, rel=0.05)
    stated = load_geometry("deepseek-v3")
    assert (stated.num_parameters, stated.num_active_parameters) == (671e9, 37e9)


def test_a_config_folder_with_nested_text_config_loads(tmp_path):
    config = {
        "text_config": {
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "hidden_size": 256,
            "vocab_size": 1000,
            "intermediate_size": 512,
        }
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    geometry = load_geometry(str(tmp_path))
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) == (2, 4, 64)


def test_explicit_dimensions_override_the_config():
    assert load_geometry("seed-70b", {"num_key_value_heads": 64}).attention == "MHA"
    custom = load_geometry(
        None,
        {
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "hidden_size": 8192,
            "num_parameters": 70_000_000_000,
        },
    )
    assert custom.bytes_per_token("fp16") == 327_680


# --- capacity, transfer and recompute -------------------------------------------------------


def test_reading_40_gb_takes_8_s_at_5_gb_s_and_2_9_s_at_14_gb_s():
    assert transfer_seconds(40 * GB, 5 * GB) == pytest.approx(8.0)
    assert transfer_seconds(40 * GB, 14 * GB) == pytest.approx(2.9, abs=0.05)


def test_sequences_that_fit_are_counted_after_the_weights():
    result = make_plan("seed-70b", 8_000, 128_000, gpus=2, tier_bytes=512 * GB)
    free = 2 * 80 * 2**30 - result.weight_bytes
    assert result.weight_bytes == 2 * result.geometry.num_parameters  # bf16
    assert [c.device_fit for c in result.contexts] == [free // (8_000 * 327_680), 0]
    assert [c.tier_fit for c in result.contexts] == [195, 12]


def test_weights_that_do_not_fit_leave_no_room_and_the_verdict_says_so():
    result = make_plan("seed-70b", 8_000, gpus=1)
    assert result.contexts[0].device_fit == 0
    assert "exceed 1x H100 SXM" in verdict(result, result.contexts[0])


def test_gpu_count_defaults_to_the_fewest_that_hold_the_weights():
    assert make_plan("llama-3.1-8b", 8_000).gpus == 1
    assert make_plan("seed-70b", 8_000).gpus == 2


def test_longer_sequences_take_longer_to_recompute_and_to_load():
    result = make_plan("llama-3.1-8b", 1_000, 8_000, 128_000)
    recompute = [c.recompute_seconds for c in result.contexts]
    load = [c.loads[0].seconds for c in result.contexts]
    assert recompute == sorted(recompute) and load == sorted(load)
    # attention makes prefill grow faster than linearly
    assert recompute[2] / recompute[1] > 128_000 / 8_000


def test_prefill_flops_are_two_per_active_parameter_plus_causal_attention():
    seed = load_geometry("seed-70b")
    tokens = 10_000
    attention = 2 * 80 * tokens**2 * 64 * 128
    expected = 2 * seed.num_active_parameters * tokens + attention
    assert prefill_flops(seed, tokens) == pytest.approx(expected)


def test_efficiency_scales_recompute_time():
    half = make_plan("llama-3.1-8b", 8_000, efficiency=0.5).contexts[0]
    full = make_plan("llama-3.1-8b", 8_000, efficiency=1.0).contexts[0]
    assert half.recompute_seconds == pytest.approx(2 * full.recompute_seconds)


# --- input parsing --------------------------------------------------------------------------


def test_sizes_read_decimal_and_binary_units():
    assert parse_size("512GB") == 512 * GB
    assert parse_size("64GiB") == 64 * 2**30
    with pytest.raises(KvtierError):
        parse_size("lots")


@pytest.mark.parametrize("text", ["-5", "0", "abc", "1.5", "8000,"])
def test_context_lengths_must_be_positive_whole_numbers(text):
    with pytest.raises(KvtierError):
        parse_token_counts(text)


# --- command line ---------------------------------------------------------------------------


def test_cli_prints_the_seed_70b_figures_and_a_verdict(capsys):
    code, out, _ = run_plan(capsys, "--model", "seed-70b", "--context", "8000,128000")
    assert code == 0
    for figure in ("327,680", "2.62 GB", "2.44 GiB", "41.9 GB", "39.1 GiB"):
        assert figure in out
    verdicts = [line for line in out.splitlines() if line.startswith("seed-70b at ")]
    assert len(verdicts) == 2
    assert "128,000 tokens: 41.9 GB KV (39.1 GiB)" in verdicts[1]
    assert "recompute" in verdicts[1]


def test_cli_json_is_documented_and_parses(capsys):
    code, out, _ = run_plan(capsys, "--model", "seed-70b", "--context", "8000,128000", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["schema"] == "kvtier.plan/1"
    assert data["bytes_per_token"] == 327_680
    assert data["model"]["attention"] == "GQA"
    first, second = data["contexts"]
    assert (first["tokens"], first["kv_bytes"]) == (8_000, 2_621_440_000)
    assert second["kv_bytes"] == 41_943_040_000
    for key in ("device_fit", "recompute_seconds", "loads", "verdict"):
        assert key in second
    assert {load["link"] for load in second["loads"]} >= {"pcie5", "nvme4", "nvme5"}


def test_cli_explicit_dimensions_without_a_model(capsys):
    code, out, _ = run_plan(
        capsys,
        "--layers",
        "80",
        "--heads",
        "64",
        "--kv-heads",
        "8",
        "--hidden",
        "8192",
        "--params",
        "70B",
        "--kv-dtype",
        "fp16",
        "--json",
    )
    assert code == 0
    assert json.loads(out)["bytes_per_token"] == 327_680


def test_cli_lists_hardware_presets(capsys):
    code, out, _ = run_plan(capsys, "--hardware", "list")
    assert code == 0
    assert "H200" in out and "NVMe Gen5" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "no-such-model"], "seed-70b"),  # lists the bundled names
        (["--model", "seed-70b", "--context", "-5"], "-5"),
        (["--model", "seed-70b", "--context", "0"], "between 1 and"),
        (["--model", "seed-70b", "--context", "abc"], "abc"),
        (["--model", "seed-70b", "--hardware", "tpu-v9"], "h100-sxm"),
        (["--model", "seed-70b", "--tier-size", "lots"], "lots"),
        (["--context", "8000"], "--model"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(capsys, args, message):
    code, _, err = run_plan(capsys, *args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("kvtier: error: ")
    assert message in err and "Traceback" not in err


def test_cli_config_missing_a_field_names_the_field_and_file(capsys, tmp_path):
    config = bundled_config("llama-3.1-8b")
    del config["num_hidden_layers"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, _, err = run_plan(capsys, "--model", str(path))
    assert code == 2
    assert "num_hidden_layers" in err and str(path) in err and "--layers" in err
    assert err.count("\n") == 1
