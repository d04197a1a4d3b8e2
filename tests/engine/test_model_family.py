"""The Llama-family variants the engine claims beyond SmolLM2, on tiny random models.

What is compared: float32 logits at every prompt position from `Engine.score` against
transformers' own model class (same folder, float32), within 1e-3 max absolute difference.
The models are small random-weight configs written to a temporary folder, with SmolLM2's
tokenizer files beside them (the engine loads a tokenizer with every model).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from kvtier.engine import Engine, EngineConfig
from kvtier.engine.llama import LlamaConfig, rope_inv_freq

from .conftest import MIB, random_prompt

TINY = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def _save(model, folder, model_dir, max_shard_size: str = "5GB") -> None:
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, folder / name)


def _compare(model, folder) -> None:
    engine = Engine(EngineConfig(model_dir=folder, dtype="float32", kv_cache_bytes=4 * MIB))
    prompt = random_prompt(150, 60)  # longer than the llama3 case's original context (64)
    (out,) = engine.score([prompt])
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].float()
    assert (out.logits - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("kind", ["qwen2", "llama3"])
def test_variant_matches_transformers(kind, tmp_path, model_dir):
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if kind == "qwen2":  # q/k/v bias, rope_theta from the config
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, rope_theta=1e6))
    else:  # Llama 3.1 frequency-dependent RoPE scaling
        rope = {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        model = LlamaForCausalLM(HFLlamaConfig(**TINY, rope_parameters=rope))
    model = model.float().eval()
    # The llama3 folder is sharded (model.safetensors.index.json), the qwen2 one is not.
    _save(model, tmp_path, model_dir, max_shard_size="4MB" if kind == "llama3" else "5GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == (kind == "llama3")
    _compare(model, tmp_path)


def test_llama3_inverse_frequencies_match_transformers():
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf_config = HFLlamaConfig(
        **{**TINY, "hidden_size": 2048, "num_attention_heads": 16}, rope_parameters=rope
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = rope_inv_freq(LlamaConfig.from_dict(hf_config.to_dict()))
    assert torch.allclose(ours, expected)


def test_sliding_window_caps_the_context():
    raw = {**TINY, "model_type": "mistral", "sliding_window": 128}
    assert LlamaConfig.from_dict(raw).max_context == 128
    qwen = {**TINY, "model_type": "qwen2", "sliding_window": 128, "use_sliding_window": False}
    assert LlamaConfig.from_dict(qwen).max_context == 512
