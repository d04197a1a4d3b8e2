"""Issue #18, `kvtier plan`: the README's commands work as written, bad geometry is one clear
line with exit 2 (never a traceback), and the plan says how to make weights fit."""

from __future__ import annotations

import json
import shlex
from importlib import resources

import pytest

from kvtier.cli import main

README_PLAN = shlex.split(
    "--layers 32 --kv-heads 8 --head-dim 128 --params 8e9 --context 8192"
)  # as README.md shows it


def run_plan(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def plan_json(capsys, *args: str) -> dict:
    code, out, err = run_plan(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def config_with(tmp_path, **fields) -> str:
    """Llama-3.1-8B's bundled config.json with `fields` replaced, as a file."""
    path = resources.files("kvtier") / "data" / "models" / "llama-3.1-8b.json"
    config = {**json.loads(path.read_text()), **fields}
    target = tmp_path / "config.json"
    target.write_text(json.dumps(config))
    return str(target)


def test_the_readme_geometry_flags_plan_without_query_heads_or_hidden_size(capsys):
    code, out, err = run_plan(capsys, *README_PLAN)
    assert code == 0, err
    assert "131,072 B/token" in out  # 2 x 32 layers x 8 KV heads x 128 x 2 B
    assert "Assumed: 32 query heads" in out and "pass --heads" in out
    assert "custom at 8,192 tokens: 1.07 GB KV" in out
    document = plan_json(capsys, *README_PLAN)
    model = document["model"]
    assert (model["num_attention_heads"], model["num_kv_heads"], model["hidden_size"]) == (
        32,
        8,
        4096,
    )
    assert len(model["assumed"]) == 2  # query heads and hidden size, each said
    assert document["weight_bytes"] == 16 * 10**9


def test_given_query_heads_are_used_and_nothing_is_assumed_about_them(capsys):
    model = plan_json(capsys, *README_PLAN, "--heads", "64", "--hidden", "8192")["model"]
    assert (model["num_attention_heads"], model["hidden_size"], model["assumed"]) == (64, 8192, [])


def test_a_bundled_model_assumes_nothing(capsys):
    assert plan_json(capsys, "--model", "llama-3.1-8b")["model"]["assumed"] == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "32", "--params", "8e9"], "pass --kv-heads and --head-dim"),
        (["--kv-heads", "64", "--heads", "32", "--head-dim", "128", "--layers", "32",
          "--params", "8e9"], "64 KV heads must divide the 32 query heads"),
        (["--kv-heads", "7", "--heads", "32", "--head-dim", "128", "--layers", "32",
          "--params", "8e9"], "7 KV heads must divide the 32 query heads"),
        (["--model", "llama-3.1-8b", "--layers", "0"], "between 1 and 1,024, not 0"),
        (["--model", "llama-3.1-8b", "--layers", "5000"], "(--layers) must be between 1"),
        (["--model", "llama-3.1-8b", "--head-dim", "100000"], "(--head-dim) must be between"),
        (["--model", "llama-3.1-8b", "--params", "1e30"], "'num_parameters' must be a positive"),
        (["--model", "llama-3.1-8b", "--context", "1e20"], "'1e20' is not a whole number"),
        (["--model", "llama-3.1-8b", "--context", "100000000000000000000"],
         "must be between 1 and 16,777,216 tokens"),
        (["--model", "llama-3.1-8b", "--context", "8000,16777217"], "16,777,217"),
        (["--model", "llama-3.1-8b", "--tier-size", "1e400GB"], "size '1e400GB' is too large"),
        (["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--params", "1e400"],
         "count '1e400' is too large"),
    ],
)  # fmt: skip
def test_bad_geometry_flags_are_one_line_and_exit_2(capsys, args, message):
    code, out, err = run_plan(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("kvtier: error: ") and err.count("\n") == 1
    assert message in err


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_hidden_layers": 1e30}, "'num_hidden_layers' (--layers) must be between 1 and"),
        ({"num_hidden_layers": float("inf")}, "must be a whole number"),
        ({"num_attention_heads": 32.5}, "must be a whole number, not 32.5"),
        ({"num_key_value_heads": 64}, "64 KV heads must divide the 32 query heads"),
        ({"num_key_value_heads": 7}, "7 KV heads must divide the 32 query heads"),
        ({"hidden_size": "4096"}, "'hidden_size' (--hidden) must be a whole number"),
        ({"vocab_size": 10**12}, "'vocab_size' must be between 1 and"),
        ({"intermediate_size": -1}, "'intermediate_size' must be between 1 and"),
        ({"max_position_embeddings": [8192]}, "'max_position_embeddings' must be a whole number"),
        ({"sliding_window": 4096, "layer_types": "sliding"}, "layer_types must list one entry"),
        ({"sliding_window": 4096, "sliding_window_pattern": 0}, "'sliding_window_pattern'"),
    ],
)
def test_bad_config_json_fields_are_one_line_and_exit_2(capsys, tmp_path, fields, message):
    code, _, err = run_plan(capsys, "--model", config_with(tmp_path, **fields))
    assert code == 2
    assert err.startswith("kvtier: error: ") and err.count("\n") == 1
    assert message in err and "config.json" in err


def test_an_moe_config_with_a_zero_layer_frequency_is_refused(capsys, tmp_path):
    moe = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_layer_freq": 0}
    code, _, err = run_plan(capsys, "--model", config_with(tmp_path, **moe))
    assert code == 2 and "'moe_layer_freq' must be between 1 and" in err


def test_weights_that_do_not_fit_get_the_weight_dtype_that_would(capsys):
    code, out, _ = run_plan(capsys, "--model", "deepseek-v3", "--hardware", "h200")
    assert code == 0
    assert "of weights alone exceed 8x H200" in out
    assert "in fp8 (--weight-dtype fp8) they take 671 GB and fit" in out
    hinted = plan_json(capsys, "--model", "deepseek-v3", "--hardware", "h200")
    assert hinted["weight_dtype_that_fits"] == "fp8"
    # taking the hint fits, and then there is nothing to hint
    fitted = plan_json(
        capsys, "--model", "deepseek-v3", "--hardware", "h200", "--weight-dtype", "fp8"
    )
    assert fitted["device_free_bytes"] > 0 and fitted["weight_dtype_that_fits"] is None


def test_no_hint_when_even_the_narrowest_weights_do_not_fit(capsys):
    args = ("--model", "llama-3.1-405b", "--hardware", "l40s", "--gpus", "1")
    assert plan_json(capsys, *args)["weight_dtype_that_fits"] is None
    _, out, _ = run_plan(capsys, *args)
    assert "--weight-dtype" not in out


def test_the_served_model_id_smollm2_plans_the_bundled_smollm2_135m(capsys):
    served = plan_json(capsys, "--model", "smollm2")
    bundled = plan_json(capsys, "--model", "smollm2-135m")
    assert served["model"]["name"] == "smollm2-135m"
    assert served["bytes_per_token"] == bundled["bytes_per_token"] == 23_040
