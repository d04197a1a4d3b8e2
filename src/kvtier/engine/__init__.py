"""Paged-KV serving engine: nano-vllm in size, vLLM v1 in behaviour. See docs/engine.md."""

from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.outputs import GenerationOutput, RequestOutput, ScoreOutput
from kvtier.engine.sampling import SamplingParams

__all__ = [
    "Engine",
    "EngineConfig",
    "GenerationOutput",
    "RequestOutput",
    "SamplingParams",
    "ScoreOutput",
]
