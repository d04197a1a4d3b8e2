"""The embedded model: conversion from GGUF, tokenizer, chat template, quality checks."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvtier.errors import KvtierError
from kvtier.models import resolve_model_dir
from kvtier.models.embedded import (
    _MARKER,
    ensure_embedded_model,
    find_embedded_gguf,
    is_converted,
)
from kvtier.models.tokenizer import chat_token_ids

DATA_DIR = Path(__file__).parent / "data"

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def gguf_model_fp32():
    from transformers import AutoModelForCausalLM

    gguf = find_embedded_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.mark.slow
def test_converted_weights_are_the_gguf_weights_rounded_to_bf16(model_dir, gguf_model_fp32):
    from safetensors.torch import load_file

    converted = load_file(str(model_dir / "model.safetensors"))
    reference = gguf_model_fp32.state_dict()
    # Tied embeddings: lm_head shares embed_tokens and is not stored twice.
    assert set(converted) == set(reference) - {"lm_head.weight"}
    for name, tensor in converted.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name


@pytest.mark.slow
def test_converted_model_reproduces_gguf_logits(tokenizer, hf_model_fp32, gguf_model_fp32):
    """Max |logit difference| over every position of a 60-token prompt, both run in fp32.

    The only difference is bf16 rounding of the de-quantized Q4_1 weights (relative error
    <= 2^-9 per weight), so logits agree to ~0.1 on a scale of ~30 and the greedy choice at
    every position is the same.
    """
    text = (DATA_DIR / "english.txt").read_text()[:300]
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.inference_mode():
        converted = hf_model_fp32(ids).logits[0]
        original = gguf_model_fp32(ids).logits[0]
    max_abs = (converted - original).abs().max().item()
    assert max_abs < 0.5, max_abs
    assert torch.equal(converted.argmax(-1), original.argmax(-1))


def test_tokenizer_special_tokens(tokenizer):
    assert tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.unk_token == "<|endoftext|>"
    assert tokenizer.is_fast


def test_tokenizer_adds_no_bos_on_encode(tokenizer):
    ids = tokenizer.encode("Hello world")
    assert ids[0] != tokenizer.bos_token_id
    assert tokenizer.convert_ids_to_tokens(ids) == ["Hello", "Ġworld"]


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is Paris.",
        "  leading spaces, tabs\tand\nnewlines\n\n",
        "Unicode: naïve café, 東京, emoji 🚀, maths ∑x² ≥ 0",
        "code: def f(x):\n    return x ** 2  # square",
    ],
)
def test_tokenizer_round_trips_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template_matches_smollm2(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        f"<|im_start|>system\n{SMOLLM2_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    rendered = tokenizer.apply_chat_template(with_system, tokenize=False)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_chat_token_ids_have_exactly_one_bos_per_message(tokenizer):
    ids = chat_token_ids(tokenizer, [{"role": "user", "content": "Hi"}])
    # system, user, and the assistant generation prompt each open with <|im_start|>
    assert ids.count(tokenizer.bos_token_id) == 3
    assert ids[0] == tokenizer.bos_token_id


def test_greedy_generation_knows_the_capital_of_france(tokenizer, hf_model_fp32):
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    with torch.inference_mode():
        out = hf_model_fp32.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def _perplexity(model, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:]))
    return math.exp(nll.item())


def test_perplexity_on_plain_english_is_low(tokenizer, hf_model_fp32):
    ids = tokenizer.encode((DATA_DIR / "english.txt").read_text())
    assert len(ids) >= 300
    assert _perplexity(hf_model_fp32, ids) < 30


def test_perplexity_rises_on_shuffled_words(tokenizer, hf_model_fp32):
    """The check above can fail: the same words in a random order score far worse."""
    import random

    words = (DATA_DIR / "english.txt").read_text().split()
    random.Random(0).shuffle(words)
    ids = tokenizer.encode(" ".join(words))
    assert _perplexity(hf_model_fp32, ids) > 100


def test_embedded_model_is_converted_once(model_dir):
    marker = model_dir / _MARKER
    before = marker.stat().st_mtime_ns
    started = time.perf_counter()
    assert ensure_embedded_model() == model_dir
    assert time.perf_counter() - started < 1.0  # a check, not a conversion
    assert marker.stat().st_mtime_ns == before
    assert json.loads(marker.read_text())["source"].endswith(".gguf")


def test_folder_without_marker_is_not_treated_as_converted(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert not is_converted(tmp_path)
    (tmp_path / _MARKER).write_text(json.dumps({"version": -1}))
    assert not is_converted(tmp_path)


def test_user_model_folder_is_accepted(model_dir):
    assert resolve_model_dir(str(model_dir)) == model_dir


@pytest.mark.parametrize("layout", ["missing", "no-config", "no-weights"])
def test_bad_model_folder_is_a_clear_error(tmp_path, layout):
    folder = tmp_path / "m"
    if layout != "missing":
        folder.mkdir()
    if layout == "no-weights":
        (folder / "config.json").write_text("{}")
    with pytest.raises(KvtierError, match=r"config\.json|safetensors|neither"):
        resolve_model_dir(str(folder))


def test_cli_reports_bad_model_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "model", "info", "--model", str(tmp_path / "x")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("kvtier: error:")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr
