"""Shared fixtures: the embedded model is converted once per machine and loaded once per run."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA_DIR = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from kvtier.models import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from kvtier.models.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def hf_model_fp32(model_dir):
    """transformers' own LlamaForCausalLM on the converted folder: the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()
