"""Long-text perplexity through the engine: teacher forcing on the real decode path, the full
cache against a plain forward pass, and a StreamingLLM cache that really stays bounded."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvtier.cli import main
from kvtier.engine import Engine, EngineConfig
from kvtier.errors import KvtierError
from kvtier.eval.perplexity import long_text, run_perplexity

LENGTH = 96  # tokens of prose: six 16-token blocks
SINKS_AND_WINDOW = 32


@pytest.fixture(scope="module")
def engine() -> Engine:
    # fp32 for exact comparisons; no prefix cache, so every position is computed
    return Engine(
        EngineConfig(
            dtype="float32",
            kv_cache_bytes=32 << 20,
            enable_prefix_caching=False,
            num_threads=1,
        )
    )


@pytest.fixture(scope="module")
def text(engine) -> list[int]:
    return long_text(engine.tokenizer, LENGTH)


@pytest.fixture(scope="module")
def runs(engine, text):
    # Only the first 8 tokens are prefilled; the other 88 are teacher-forced decode steps.
    full, bounded, roomy = run_perplexity(
        engine, text, [SINKS_AND_WINDOW, 4 * LENGTH], prefix_tokens=8
    )
    return {"full": full, "bounded": bounded, "roomy": roomy}


def plain_forward_perplexity(model, token_ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1].double()
    log_probs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids[1:])[:, None])
    return math.exp(-log_probs.mean().item())


@pytest.mark.slow
def test_full_cache_equals_a_plain_forward_pass(runs, text, hf_model_fp32):
    full = runs["full"]
    assert full.spec == "full" and full.budget is None
    assert full.num_tokens == LENGTH and full.num_scored == LENGTH - 1
    assert full.perplexity == pytest.approx(plain_forward_perplexity(hf_model_fp32, text), rel=1e-4)
    assert 1.0 < full.perplexity < 1000.0  # English prose, not noise


@pytest.mark.slow
def test_a_budget_at_least_the_length_equals_the_full_cache(runs):
    roomy, full = runs["roomy"], runs["full"]
    assert roomy.spec == f"streaming_llm@{4 * LENGTH}"
    assert roomy.nll == full.nll  # nothing was evicted: the very same computation
    assert roomy.peak_kv_bytes == full.peak_kv_bytes


@pytest.mark.slow
def test_a_small_budget_evicts_and_holds_fewer_bytes(runs, engine):
    bounded, full = runs["bounded"], runs["full"]
    assert bounded.spec == f"streaming_llm@{SINKS_AND_WINDOW}"
    assert bounded.nll != full.nll  # 4 sinks + 28 recent tokens see less of the text
    # The full cache ends holding the 95 computed positions (6 blocks); the bounded one
    # never more than budget + a block's worth of slots (47 -> 3 blocks).
    block = engine.kv_pool.bytes_per_block
    assert full.peak_kv_bytes == 6 * block
    assert bounded.peak_kv_bytes == 3 * block
    assert bounded.mean_kv_bytes < full.mean_kv_bytes


@pytest.mark.slow
def test_engine_is_left_as_found(engine, runs):
    from kvtier.engine.sampling import Sampler

    assert type(engine.sampler) is Sampler
    assert engine.config.compression is None
    assert not engine.has_unfinished_requests()


def test_bad_input(engine, text):
    with pytest.raises(KvtierError, match="must exceed the 4 attention sinks"):
        run_perplexity(engine, text, [4])
    with pytest.raises(KvtierError, match="at least one cache budget"):
        run_perplexity(engine, text, [])
    with pytest.raises(KvtierError, match="prefix_tokens must be at least 1"):
        run_perplexity(engine, text, [32], prefix_tokens=0)
    with pytest.raises(KvtierError, match="longer than the shipped prose"):
        long_text(engine.tokenizer, 100_000)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "perplexity,passkey"], "--tasks perplexity runs on its own"),
        (["--tasks", "passkey", "--budgets", "256"], "--budgets is for --tasks perplexity"),
        (["--tasks", "perplexity", "--budgets", "2,x"], "--budgets takes token counts"),
        (["--tasks", "perplexity", "--budgets", "3"], "must exceed the 4 attention sinks"),
        (["--tasks", "perplexity", "--lengths", "64k"], "longer than the shipped prose"),
    ],
)
def test_cli_errors_are_one_line(argv, message, capsys, tmp_path):
    assert main(["eval", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: ") and message in err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_cli_writes_the_table_and_json(tmp_path, capsys):
    argv = ["eval", "--tasks", "perplexity", "--lengths", "256", "--budgets", "200,300"]
    assert main([*argv, "--threads", "1", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "perplexity.json").read_text())
    specs = [run["spec"] for run in doc["runs"]]
    assert specs == ["full", "streaming_llm@200", "streaming_llm@300"]
    full, bounded, roomy = doc["runs"]
    assert roomy["nll"] == full["nll"]  # 300 >= 256 tokens: nothing evicted
    assert bounded["peak_kv_bytes"] < full["peak_kv_bytes"]
    table = (tmp_path / "perplexity.md").read_text()
    assert table.startswith("| method | tokens | budget | perplexity | vs full |")
    assert "| streaming_llm@200 | 256 | 200 |" in table
    assert "perplexity" in capsys.readouterr().out
