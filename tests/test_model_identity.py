"""A model's KV namespace is a digest of its bytes: a fine-tune in a folder of the same name,
with the same config and weight files of the same sizes, never shares KV with its base."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kvtier.engine.engine import default_namespace
from kvtier.models.identity import identity_files, model_digest, model_identity


def nudge_attention(folder: Path, factor: float = 1.02) -> None:
    """Scale every attention projection of `folder`'s weights by `factor` in place: the file
    keeps its size (same names, shapes and dtypes), as a light fine-tune would."""
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    for name, tensor in tensors.items():
        if "self_attn" in name:
            tensors[name] = (tensor.float() * factor).to(tensor.dtype)
    save_file(tensors, weights, metadata={"format": "pt"})


def copy_model(model_dir: Path, parent: Path) -> Path:
    """`model_dir` copied into `parent` under the same folder name."""
    copy = parent / model_dir.name
    shutil.copytree(model_dir, copy)
    return copy


@pytest.fixture(scope="module")
def fine_tune(model_dir: Path, tmp_path_factory) -> Path:
    copy = copy_model(model_dir, tmp_path_factory.mktemp("fine-tune"))
    nudge_attention(copy)
    original = {p.name: p.stat().st_size for p in model_dir.iterdir()}
    assert {p.name: p.stat().st_size for p in copy.iterdir()} == original
    return copy


def test_a_fine_tune_of_the_same_name_config_and_sizes_is_another_namespace(
    model_dir: Path, fine_tune: Path
):
    assert fine_tune.name == model_dir.name
    assert default_namespace(fine_tune, "bfloat16") != default_namespace(model_dir, "bfloat16")


def test_a_byte_identical_copy_shares_the_namespace(model_dir: Path, tmp_path: Path):
    copy = copy_model(model_dir, tmp_path)
    assert default_namespace(copy, "bfloat16") == default_namespace(model_dir, "bfloat16")


def test_a_changed_tokenizer_or_an_added_adapter_is_another_namespace(
    model_dir: Path, tmp_path: Path
):
    copy = copy_model(model_dir, tmp_path)
    before = model_digest(copy)
    (copy / "adapter_config.json").write_text('{"r": 8}')
    with_adapter = model_digest(copy)
    assert with_adapter != before
    tokenizer = copy / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace('"<|im_end|>"', '"<|im_stop|>"', 1))
    assert model_digest(copy) not in (before, with_adapter)


def test_a_weight_changed_after_its_digest_was_kept_is_hashed_again(
    model_dir: Path, tmp_path: Path
):
    """The kept per-file digests are reused only while a file's stat signature holds; a
    rewrite with the old size and the old mtime put back still changes its ctime."""
    copy = copy_model(model_dir, tmp_path)
    weights = copy / "model.safetensors"
    kept = model_digest(copy)
    times = weights.stat()
    nudge_attention(copy, factor=0.99)
    os.utime(weights, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert weights.stat().st_size == times.st_size
    assert model_digest(copy) != kept


def test_the_digest_covers_weights_config_and_tokenizer_not_generation_settings(
    model_dir: Path,
):
    names = {p.name for p in identity_files(model_dir)}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
    assert "generation_config.json" not in names and "chat_template.jinja" not in names


def test_vllm_namespaces_a_local_folder_by_its_digest_and_a_hub_id_by_its_name(
    model_dir: Path, tmp_path: Path
):
    """The same folder path before and after its weights change: two namespaces."""
    copy = copy_model(model_dir, tmp_path)
    before = model_identity(str(copy))
    nudge_attention(copy)
    assert model_identity(str(copy)) != before
    assert model_identity("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )


@pytest.mark.slow
def test_a_fine_tune_served_over_its_base_models_disk_cache_restores_none_of_it(
    fine_tune: Path, tmp_path: Path
):
    """The base model serves a turn and writes its KV to disk; the fine-tune, started on the
    same disk folder, finds none of it and answers as it does with no tiers at all."""
    from tests.server.serve_process import SMALL_POOL, ServeProcess, first_turn, second_turn

    disk = ["--host-bytes", "0", "--disk-dir", str(tmp_path / "kv"), "--write-through"]

    def serve(log: str, *flags: str) -> ServeProcess:
        return ServeProcess(tmp_path / log, *SMALL_POOL, *flags).start()

    base = serve("base.log", *disk)
    try:
        first = first_turn(base.base_url)
        assert second_turn(base.base_url, first).sources["disk"] > 0  # the base's own KV
    finally:
        base.stop()
    tuned = serve("tuned.log", "--model", str(fine_tune), *disk)
    try:
        over_base_cache = second_turn(tuned.base_url, first)
    finally:
        tuned.stop()
    alone = serve("alone.log", "--model", str(fine_tune), "--host-bytes", "0")
    try:
        reference = second_turn(alone.base_url, first)
    finally:
        alone.stop()
    assert over_base_cache.sources["disk"] == 0, over_base_cache.sources
    assert over_base_cache.sources["host"] == over_base_cache.sources["remote"] == 0
    assert over_base_cache.text == reference.text
