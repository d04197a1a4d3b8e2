"""Shared fixtures: the embedded model is converted once per machine and loaded once per run."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA_DIR = Path(__file__).parent / "data"


def pytest_collection_modifyitems(config, items) -> None:
    """`@pytest.mark.requires_cuda` tests are skipped where torch sees no CUDA device (the
    list is in docs/gpu.md); on a GPU machine they run with the rest."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (docs/gpu.md)")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


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
