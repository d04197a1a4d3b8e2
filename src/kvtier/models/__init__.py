"""Model files: the embedded SmolLM2 (converted from its GGUF once) and user HF folders."""

from kvtier.models.resolve import EMBEDDED_MODEL_NAME, resolve_model_dir

__all__ = ["EMBEDDED_MODEL_NAME", "resolve_model_dir"]
