"""Find and read a model's Hugging Face `config.json`: a bundled name, a file, or a folder.

Bundled configs live in `kvtier/data/models/<name>.json` and hold config.json contents only.
Two extra keys are allowed there and in any config: `num_parameters` and `num_active_parameters`
override the counts derived from the dimensions (a mixture-of-experts model multiplies only its
active parameters per token).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError

# config field -> command-line flag that can supply or override it
FIELD_FLAGS = {
    "num_hidden_layers": "--layers",
    "num_key_value_heads": "--kv-heads",
    "head_dim": "--head-dim",
    "num_attention_heads": "--heads",
    "hidden_size": "--hidden",
    "num_parameters": "--params",
}

# Upper bounds of a config's counts: ten times the largest published models (126 layers, 128
# heads, head_dim 256, hidden 18,432), to catch typos and values that would overflow, not to
# judge designs. Other counts (vocab, MLP width, windows, positions) get MAX_COUNT.
FIELD_LIMITS = {
    "num_hidden_layers": 1_024,
    "num_attention_heads": 1_024,
    "num_key_value_heads": 1_024,
    "head_dim": 4_096,
    "hidden_size": 2**17,
}
MAX_COUNT = 2**30

# extra names people use for a bundled model, after _normalize()
_ALIASES = {
    "meta-llama-3.1-8b": "llama-3.1-8b",
    "meta-llama-3.1-70b": "llama-3.1-70b",
    "meta-llama-3.1-405b": "llama-3.1-405b",
    "mistral-7b-v0.3": "mistral-7b",
    "smollm2-135m-instruct": "smollm2-135m",
    "smollm2": "smollm2-135m",  # the id `kvtier serve` serves the embedded model under
    "deepseek-v3-base": "deepseek-v3",
    "deepseek-v3-0324": "deepseek-v3",
}


@dataclass(frozen=True)
class ModelConfig:
    """A config dict flattened for a language model, and where it came from (for messages)."""

    name: str
    source: str
    values: Mapping[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        value = self.values.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        value = self.values.get(key)
        if value is None:
            hint = f" (or pass {FIELD_FLAGS[key]})" if key in FIELD_FLAGS else ""
            raise KvtierError(f"missing required field {key!r} in {self.source}{hint}")
        return value

    def count(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        """A whole number in [minimum, the field's limit]; required when `default` is None."""
        value = self.require(key) if default is None else self.get(key, default)
        return self._checked(key, value, minimum)

    def optional_count(self, key: str, minimum: int = 1) -> int | None:
        value = self.get(key)
        return None if value is None else self._checked(key, value, minimum)

    def _checked(self, key: str, value: Any, minimum: int) -> int:
        name = f"{self.source}: {key!r}" + (f" ({FIELD_FLAGS[key]})" if key in FIELD_FLAGS else "")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value != int(value):
            raise KvtierError(f"{name} must be a whole number, not {value!r}")
        limit = FIELD_LIMITS.get(key, MAX_COUNT)
        if not minimum <= value <= limit:
            raise KvtierError(f"{name} must be between {minimum} and {limit:,}, not {value:,}")
        return int(value)

    def with_overrides(self, overrides: Mapping[str, Any]) -> ModelConfig:
        if not overrides:
            return self
        flags = " ".join(FIELD_FLAGS.get(key, key) for key in overrides)
        return ModelConfig(self.name, f"{self.source} with {flags}", {**self.values, **overrides})


def flatten(config: Mapping[str, Any]) -> dict[str, Any]:
    """Multimodal configs (Gemma 3) nest the language model in `text_config`; its keys win."""
    text = config.get("text_config") or {}
    outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    return {**outer, **text}


def bundled_names() -> list[str]:
    folder = resources.files("kvtier") / "data" / "models"
    return sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )


def _normalize(name: str) -> str:
    """'meta-llama/Llama-3.1-8B-Instruct' -> 'llama-3.1-8b'."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    for suffix in ("-instruct", "-it"):
        key = key.removesuffix(suffix)
    return _ALIASES.get(key, key)


def _read_json(path: Path, source: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise KvtierError(f"cannot read {source}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise KvtierError(f"{source} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise KvtierError(f"{source} does not hold a JSON object")
    return data


def load_config(name_or_path: str) -> ModelConfig:
    """A bundled model name (case-insensitive, hub ids accepted), or a path to a config.json
    file or to a folder that holds one."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise KvtierError(f"folder {name_or_path} has no config.json")
    if path.is_file():
        name = path.resolve().parent.name if path.name == "config.json" else path.stem
        return ModelConfig(name, str(path), flatten(_read_json(path, str(path))))

    name = _normalize(name_or_path)
    known = bundled_names()
    if name not in known:
        raise KvtierError(
            f"unknown model {name_or_path!r}: not a bundled name or an existing config.json path; "
            f"bundled models: {', '.join(known)}"
        )
    resource = resources.files("kvtier") / "data" / "models" / f"{name}.json"
    with resources.as_file(resource) as file:
        values = flatten(_read_json(file, f"bundled config {name}"))
    return ModelConfig(name, f"bundled config {name}", values)
