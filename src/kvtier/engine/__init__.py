"""Paged-KV serving engine: nano-vllm in size, vLLM v1 in behaviour. See docs/engine.md."""

from __future__ import annotations

from kvtier.lazy_exports import lazy_getattr

_EXPORTS = {
    "Engine": "kvtier.engine.engine",
    "EngineConfig": "kvtier.engine.config",
    "GenerationOutput": "kvtier.engine.outputs",
    "RequestOutput": "kvtier.engine.outputs",
    "SamplingParams": "kvtier.engine.sampling",
    "ScoreOutput": "kvtier.engine.outputs",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
