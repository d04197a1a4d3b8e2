"""Turn what a user passes as `--model` into a local HF model folder."""

from __future__ import annotations

from pathlib import Path

from kvtier.errors import KvtierError

EMBEDDED_MODEL_NAME = "smollm2"
_EMBEDDED_ALIASES = {"smollm2", "smollm2-135m", "smollm2-135m-instruct", "embedded"}


def resolve_model_dir(model: str | None) -> Path:
    """The embedded model (converted on first use) or a local folder with weights.

    A user folder must hold `config.json` and at least one `*.safetensors` file; nothing is
    ever fetched from a hub.
    """
    if model is None or model.lower() in _EMBEDDED_ALIASES:
        from kvtier.models.embedded import ensure_embedded_model

        return ensure_embedded_model()
    folder = Path(model).expanduser()
    if not folder.is_dir():
        raise KvtierError(
            f"model {model!r} is neither a local folder nor the embedded model "
            f"({EMBEDDED_MODEL_NAME}); kvtier never downloads weights"
        )
    if not (folder / "config.json").is_file():
        raise KvtierError(f"model folder {folder} has no config.json")
    if not any(folder.glob("*.safetensors")):
        raise KvtierError(f"model folder {folder} has no *.safetensors weights")
    return folder
