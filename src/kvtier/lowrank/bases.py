"""The low-rank bases a compression pipeline names, ready before the engine builds its press.

`with_fitted_bases(compression)` is what every command (bench, eval, serve) and benchmark
calls on a pipeline before handing it to the engine: for each lowrank press it reads the
basis from the disk cache, or fits it now (a float32 engine prefilling the calibration text,
about 40 s on one thread for SmolLM2's 4,096 tokens) and caches it, then hands it to the
press (`kvtier.compress.fitted_bases`). Fits are cached under `$KVTIER_CACHE/lowrank/` as
safetensors, so a model is calibrated once.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

import torch

from kvtier.compress.config import CompressionConfig
from kvtier.compress.fitted_bases import LowRankFit, has_basis, provide_basis
from kvtier.compress.lowrank import LowRankBasis, load_basis, save_basis
from kvtier.engine import Engine, EngineConfig
from kvtier.engine.engine import default_namespace
from kvtier.engine.llama import LlamaConfig
from kvtier.lowrank.fit import calibration_text, calibration_tokens, fit_basis
from kvtier.models.resolve import resolve_model_dir
from kvtier.paths import cache_dir

# Bump when the fit changes, so stale cached files are not reused.
_FIT_VERSION = 1


def with_fitted_bases(compression: CompressionConfig | None) -> CompressionConfig | None:
    """`compression` unchanged, once every basis its lowrank presses name is ready for the
    press (read from the disk cache, or fitted now and cached)."""
    for spec in [] if compression is None else compression.presses:
        if spec.name != "lowrank" or spec.is_identity:
            continue
        fit = LowRankFit.of(spec)
        if not has_basis(fit):
            provide_basis(fit, load_or_fit(fit))
    return compression


def load_or_fit(fit: LowRankFit) -> LowRankBasis:
    """The basis `fit` names, from the disk cache or fitted now (a float32 engine prefilling
    `fit.num_tokens` of the calibration text) and cached."""
    model_dir = resolve_model_dir(fit.model)
    text = calibration_text(fit.calibration)
    path = cache_path(model_dir, fit.calibration, fit.grouping, fit.num_tokens)
    return _load_or_fit(path, str(model_dir), text, fit.grouping, fit.num_tokens)


def cache_path(model_dir: Path, calibration: str, grouping: str, num_tokens: int) -> Path:
    """Where the fit of (model, calibration text, grouping, length) is cached. The model is
    its block-key id (folder, digest of config and weight files), the text its content."""
    key = "|".join(
        (
            f"v{_FIT_VERSION}",
            default_namespace(model_dir, "float32"),
            hashlib.sha256(calibration_text(calibration).encode()).hexdigest(),
            grouping,
            str(num_tokens),
        )
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = f"{model_dir.name}-{calibration}-{grouping}-{num_tokens}-{digest}.safetensors"
    return cache_dir() / "lowrank" / name


@cache
def _load_or_fit(
    path: Path, model_dir: str, text: str, grouping: str, num_tokens: int
) -> LowRankBasis:
    if path.is_file():
        return load_basis(path)
    engine = Engine(
        EngineConfig(
            model_dir=model_dir,
            dtype="float32",
            # the engine sets torch's global thread count: keep the caller's
            num_threads=torch.get_num_threads(),
            kv_cache_bytes=_pool_bytes_for(model_dir, num_tokens),
        )
    )
    try:
        basis = fit_basis(engine, calibration_tokens(engine.tokenizer, text, num_tokens), grouping)
    finally:
        engine.close()
    save_basis(basis, path)
    return basis


def _pool_bytes_for(model_dir: str, num_tokens: int) -> int:
    per_token = LlamaConfig.from_model_dir(Path(model_dir)).kv_bytes_per_token(torch.float32)
    return per_token * (num_tokens + 64)  # the prompt, its first token, block rounding
