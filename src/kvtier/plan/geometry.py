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
# query heads per KV head when only KV heads are given: Llama 3 8B's and Mistral 7B's (32 / 8)
ASSUMED_GQA_GROUP = 4


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
    assumed: tuple[str, ...] = ()  # what was not given and is assumed, for the report

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
        layers = cfg.count("num_hidden_layers")
        assumed: list[str] = []
        if cfg.get("kv_lora_rank") is not None:  # MLA
            heads, hidden = cfg.count("num_attention_heads"), cfg.count("hidden_size")
            kv_heads = cfg.count("num_key_value_heads", heads)
            kv_lora_rank = cfg.count("kv_lora_rank")
            rope = cfg.count("qk_rope_head_dim")
            nope = cfg.count("qk_nope_head_dim")
            head_dim, v_head_dim = nope + rope, cfg.count("v_head_dim", nope)
        else:
            kv_lora_rank, rope, v_head_dim = None, 0, None
            heads, kv_heads, head_dim, hidden = _attention_shape(cfg, assumed)
        window, sliding = _sliding_layers(cfg, layers)
        shape = cls(
            name=cfg.name,
            num_layers=layers,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            hidden_size=hidden,
            num_parameters=0,
            num_active_parameters=0,
            v_head_dim=v_head_dim,
            sliding_window=window,
            sliding_layers=sliding,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=rope,
            max_position_embeddings=cfg.optional_count("max_position_embeddings"),
            source=cfg.source,
            assumed=tuple(assumed),
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


def _attention_shape(cfg: ModelConfig, assumed: list[str]) -> tuple[int, int, int, int]:
    """(query heads, KV heads, head_dim, hidden size) of dense attention. KV bytes need only
    KV heads and head_dim; the rest is derived where the usual identity `hidden = heads x
    head_dim` allows, or assumed and said (`assumed`), so `--layers --kv-heads --head-dim
    --params` is enough to plan."""
    heads = cfg.optional_count("num_attention_heads")
    kv_heads = cfg.optional_count("num_key_value_heads")
    head_dim = cfg.optional_count("head_dim")
    hidden = cfg.optional_count("hidden_size")
    if head_dim is None and heads is not None and hidden is not None:
        head_dim = cfg.count("head_dim", hidden // heads)
    if head_dim is None or (heads is None and kv_heads is None):
        raise KvtierError(
            f"{cfg.source}: KV bytes need the KV heads and the head dimension: pass --kv-heads "
            "and --head-dim (or --heads and --hidden)"
        )
    if heads is None and hidden is not None and hidden % head_dim == 0:
        heads = cfg.count("num_attention_heads", hidden // head_dim)
        assumed.append(f"{heads} query heads = hidden size / head_dim (pass --heads)")
    if heads is None:
        heads = kv_heads * ASSUMED_GQA_GROUP
        assumed.append(
            f"{heads} query heads ({ASSUMED_GQA_GROUP} per KV head, as Llama 3 8B and Mistral 7B; "
            "they count only in attention FLOPs: pass --heads)"
        )
    kv_heads = kv_heads or heads
    if heads % kv_heads:
        raise KvtierError(
            f"{cfg.source}: {kv_heads} KV heads must divide the {heads} query heads "
            "(each KV head serves a whole group of query heads)"
        )
    if hidden is None:
        hidden = cfg.count("hidden_size", heads * head_dim)
        assumed.append(f"hidden size {hidden:,} = query heads x head_dim (pass --hidden)")
    return heads, kv_heads, head_dim, hidden


def _sliding_layers(cfg: ModelConfig, layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """Which layers attend to a sliding window, following the modelling code's conventions."""
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    pattern = cfg.optional_count("sliding_window_pattern") or _DEFAULT_SLIDING_PATTERN.get(
        cfg.get("model_type")
    )
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            raise KvtierError(f"{cfg.source}: layer_types must list one entry per layer ({layers})")
        sliding = tuple(kind == "sliding_attention" for kind in layer_types)
    elif not window or cfg.get("use_sliding_window") is False:
        sliding = (False,) * layers
    elif pattern:
        # every `pattern`-th layer is global (Gemma 3: 5 local, then 1 global)
        sliding = tuple((i + 1) % pattern != 0 for i in range(layers))
    elif cfg.get("max_window_layers") is not None:
        # Qwen2 with use_sliding_window: layers from max_window_layers on slide
        first = cfg.count("max_window_layers", minimum=0)
        sliding = tuple(i >= first for i in range(layers))
    else:
        sliding = (True,) * layers  # Mistral v0.1: every layer slides
    if not any(sliding):
        return None, sliding
    return cfg.count("sliding_window"), sliding
