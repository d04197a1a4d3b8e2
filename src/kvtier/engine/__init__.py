"""Paged-KV serving engine: nano-vllm in size, vLLM v1 in behaviour. See docs/engine.md."""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use (PEP 562): importing one light module of the package (its
# settings, say) must not load torch and every backend with it.
_EXPORTS = {
    "Engine": "kvtier.engine.engine",
    "EngineConfig": "kvtier.engine.config",
    "GenerationOutput": "kvtier.engine.outputs",
    "RequestOutput": "kvtier.engine.outputs",
    "SamplingParams": "kvtier.engine.sampling",
    "ScoreOutput": "kvtier.engine.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
