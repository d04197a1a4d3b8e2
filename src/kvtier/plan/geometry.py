"""Model geometry: the shape facts that decide how many bytes of KV a sequence needs.

Per layer and token a dense attention layer stores K and V for each KV head:
`2 x kv_heads x head_dim` elements. GQA/MQA shrink `kv_heads` below the query heads (Ainslie et
al. 2023, arXiv:2305.13245). Two layouts change the sum over layers:

- sliding-window layers (Mistral, Gemma 2/3) keep only the last `sliding_window` tokens, so they
  hold `min(T, window)` tokens; Gemma 3 interleaves 5 such layers with 1 global layer;
- multi-head latent attention (DeepSeek-V2/V3, arXiv:2405.04434) caches one compressed latent of
  `kv_lora_rank` plus a shared RoPE key of `qk_rope_head_dim` per layer and token, for all heads
  at once (that is what vLLM and SGLang store; a naive implementation that caches the
  decompressed K and V needs far more).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvtier.errors import KvtierError
from kvtier.plan.config import ModelConfig, flatten, load_config
from kvtier.plan.kv_dtypes import DEFAULT_GROUP_SIZE, KVDtype, get_kv_dtype
from kvtier.plan.params import count_parameters

# model types whose configs leave the local:global layer pattern to the modelling code
_DEFAULT_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}


@dataclass(frozen=True)
class ModelGeometry:
    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int  # query/key head dim (for MLA: nope + rope part)
    hidden_size: int
    num_parameters: int  # what the weights occupy
    num_active_parameters: int  # what one prompt token is multiplied by (see params.py)
    v_head_dim: int | None = None  # None: same as head_dim
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()  # per layer: True = keeps the last window only
    kv_lora_rank: int | None = None  # MLA latent width; None for other attention kinds
    qk_rope_head_dim: int = 0
    max_position_embeddings: int | None = None
    source: str = ""

    @property
    def attention(self) -> str:
        if self.kv_lora_rank:
            return "MLA"
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def num_sliding_layers(self) -> int:
        return sum(self.sliding_layers)

    @property
    def kv_elements_per_layer_token(self) -> int:
        if self.kv_lora_rank:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_elements(self, tokens: int) -> int:
        """Elements cached for one sequence of `tokens` tokens, all layers, K and V."""
        global_layers = self.num_layers - self.num_sliding_layers
        sliding_tokens = min(tokens, self.sliding_window or tokens)
        layer_tokens = global_layers * tokens + self.num_sliding_layers * sliding_tokens
        return self.kv_elements_per_layer_token * layer_tokens

    def kv_bytes(
        self, tokens: int, dtype: KVDtype | str = "bf16", group_size: int = DEFAULT_GROUP_SIZE
    ) -> int:
        """Bytes of KV for one sequence of `tokens` tokens (group metadata included)."""
        bpe = get_kv_dtype(dtype).bytes_per_element(group_size)
        return math.ceil(self.kv_elements(tokens) * bpe)

    def bytes_per_token(
        self, dtype: KVDtype | str = "bf16", group_size: int = DEFAULT_GROUP_SIZE
    ) -> float:
        """Bytes each further token adds once every sliding window is full. Without sliding
        layers this is the textbook `2 x layers x kv_heads x head_dim x bytes_per_element`."""
        bpe = get_kv_dtype(dtype).bytes_per_element(group_size)
        global_layers = self.num_layers - self.num_sliding_layers
        return float(self.kv_elements_per_layer_token * global_layers * bpe)

    def average_bytes_per_token(
        self, tokens: int, dtype: KVDtype | str = "bf16", group_size: int = DEFAULT_GROUP_SIZE
    ) -> float:
        """Effective bytes per token at this length (above the asymptote for sliding models)."""
        return self.kv_bytes(tokens, dtype, group_size) / tokens

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any] | ModelConfig, name: str = "custom", source: str = "config"
    ) -> ModelGeometry:
        """Read a Hugging Face config.json dict (nested `text_config` accepted)."""
        if isinstance(config, ModelConfig):
            cfg = config
        else:
            cfg = ModelConfig(name, source, flatten(config))
        layers = _positive_int(cfg, "num_hidden_layers")
        heads = _positive_int(cfg, "num_attention_heads")
        hidden = _positive_int(cfg, "hidden_size")
        if cfg.get("kv_lora_rank") is not None:  # MLA
            kv_lora_rank = _positive_int(cfg, "kv_lora_rank")
            rope = _positive_int(cfg, "qk_rope_head_dim")
            nope = _positive_int(cfg, "qk_nope_head_dim")
            head_dim, v_head_dim = nope + rope, _positive_int(cfg, "v_head_dim", nope)
        else:
            kv_lora_rank, rope, v_head_dim = None, 0, None
            head_dim = _positive_int(cfg, "head_dim", hidden // heads)
        window, sliding = _sliding_layers(cfg, layers)
        shape = cls(
            name=cfg.name,
            num_layers=layers,
            num_attention_heads=heads,
            num_kv_heads=_positive_int(cfg, "num_key_value_heads", heads),
            head_dim=head_dim,
            hidden_size=hidden,
            num_parameters=0,
            num_active_parameters=0,
            v_head_dim=v_head_dim,
            sliding_window=window,
            sliding_layers=sliding,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=rope,
            max_position_embeddings=cfg.get("max_position_embeddings"),
            source=cfg.source,
        )
        total, active = count_parameters(cfg, shape)
        return replace(shape, num_parameters=total, num_active_parameters=active)


def load_geometry(
    name_or_path: str | None, overrides: Mapping[str, Any] | None = None
) -> ModelGeometry:
    """Geometry of a bundled model or a config.json path/folder; `overrides` replace config
    fields (the command's explicit flags). With no model at all, the overrides are the config."""
    if name_or_path is None:
        config = ModelConfig("custom", "the model flags", dict(overrides or {}))
    else:
        config = load_config(name_or_path).with_overrides(overrides or {})
    return ModelGeometry.from_hf_config(config)


def _positive_int(cfg: ModelConfig, key: str, default: int | None = None) -> int:
    value = cfg.require(key) if default is None else cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise KvtierError(f"{cfg.source}: field {key!r} must be a whole number, not {value!r}")
    if value <= 0:
        raise KvtierError(f"{cfg.source}: field {key!r} must be at least 1, not {value!r}")
    return int(value)


def _sliding_layers(cfg: ModelConfig, layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """Which layers attend to a sliding window, following the modelling code's conventions."""
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    pattern = cfg.get("sliding_window_pattern", _DEFAULT_SLIDING_PATTERN.get(cfg.get("model_type")))
    if layer_types is not None:
        if len(layer_types) != layers:
            raise KvtierError(
                f"{cfg.source}: layer_types has {len(layer_types)} entries for {layers} layers"
            )
        sliding = tuple(kind == "sliding_attention" for kind in layer_types)
    elif not window or cfg.get("use_sliding_window") is False:
        sliding = (False,) * layers
    elif pattern:
        # every `pattern`-th layer is global (Gemma 3: 5 local, then 1 global)
        sliding = tuple((i + 1) % pattern != 0 for i in range(layers))
    elif cfg.get("max_window_layers") is not None:
        # Qwen2 with use_sliding_window: layers from max_window_layers on slide
        sliding = tuple(i >= cfg.get("max_window_layers") for i in range(layers))
    else:
        sliding = (True,) * layers  # Mistral v0.1: every layer slides
    if not any(sliding):
        return None, sliding
    return _positive_int(cfg, "sliding_window"), sliding
