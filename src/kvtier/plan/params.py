"""Parameter counts derived from a config: what the weights occupy, and what one prompt token
is multiplied by.

Total = embedding table + LM head (unless tied) + per layer (attention projections + MLP + two
RMSNorm vectors) + final norm. MLPs are gated (SwiGLU/GeGLU: gate, up, down), as in every bundled
model. Biases and the extra per-head norms some models carry are under 0.01% and left out; so
are DeepSeek-V3's multi-token-prediction layers, which inference does not need.

Active = the per-layer part only, with a mixture-of-experts layer counting its top-k routed plus
shared experts. The embedding is a lookup and prefill computes logits for the last token only,
so neither matrix multiplies every prompt token. A config can state both numbers outright with
`num_parameters` / `num_active_parameters` (bundled DeepSeek-V3 uses the published 671B / 37B).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.errors import KvtierError

MAX_PARAMETERS = 10**15  # a thousand times the largest published models: a typo, not a model
_EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")  # DeepSeek, Mixtral, Qwen

if TYPE_CHECKING:
    from kvtier.plan.config import ModelConfig
    from kvtier.plan.geometry import ModelGeometry


def count_parameters(cfg: ModelConfig, shape: ModelGeometry) -> tuple[int, int]:
    """(total, active) parameters; explicit `num_parameters`/`num_active_parameters` win."""
    total = _stated(cfg, "num_parameters")
    active = _stated(cfg, "num_active_parameters")
    if total is not None and active is not None:
        return total, active
    try:
        counted_total, counted_active = _count(cfg, shape)
    except KvtierError:
        if total is None:
            raise
        return total, total  # only the total is known: treat every parameter as active
    return total or counted_total, active or counted_active


def _stated(cfg: ModelConfig, key: str) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not 0 < value <= MAX_PARAMETERS:
        raise KvtierError(
            f"{cfg.source}: {key!r} must be a positive number up to {MAX_PARAMETERS:.0e}, "
            f"not {value!r}"
        )
    return int(value)


def _need(cfg: ModelConfig, key: str) -> int:
    if cfg.get(key) is None:
        raise KvtierError(
            f"cannot count parameters without {key!r} (missing in {cfg.source}); "
            "pass --params or add num_parameters to the config"
        )
    return cfg.count(key)


def _attention(cfg: ModelConfig, g: ModelGeometry) -> int:
    h, heads = g.hidden_size, g.num_attention_heads
    if not g.kv_lora_rank:
        q_and_o = 2 * h * heads * g.head_dim
        return q_and_o + 2 * h * g.num_kv_heads * g.head_dim
    # MLA: low-rank query, joint compressed KV (+ shared RoPE key), per-head up-projection
    q_rank = cfg.optional_count("q_lora_rank")
    q = q_rank * (h + 1 + heads * g.head_dim) if q_rank else h * heads * g.head_dim
    v_dim = g.v_head_dim or g.head_dim
    kv_down = h * (g.kv_lora_rank + g.qk_rope_head_dim) + g.kv_lora_rank
    kv_up = g.kv_lora_rank * heads * (g.head_dim - g.qk_rope_head_dim + v_dim)
    return q + kv_down + kv_up + heads * v_dim * h


def _mlp(cfg: ModelConfig, g: ModelGeometry) -> tuple[int, int]:
    """(total, active) MLP parameters over all layers."""
    h, layers = g.hidden_size, g.num_layers
    experts = next(
        (cfg.count(key) for key in _EXPERT_KEYS if cfg.get(key)),
        None,
    )
    if not experts:
        dense = layers * 3 * h * _need(cfg, "intermediate_size")
        return dense, dense
    expert = (
        3 * h * (cfg.optional_count("moe_intermediate_size") or _need(cfg, "intermediate_size"))
    )
    shared = cfg.count("n_shared_experts", 0, minimum=0) * expert
    shared += 3 * h * cfg.count("shared_expert_intermediate_size", 0, minimum=0)  # Qwen-MoE style
    router = experts * h
    first_dense = cfg.count("first_k_dense_replace", 0, minimum=0)
    every = cfg.count("moe_layer_freq", 1)
    moe_layers = sum(1 for i in range(first_dense, layers) if i % every == 0)
    dense_layers = layers - moe_layers
    dense = dense_layers * 3 * h * _need(cfg, "intermediate_size") if dense_layers else 0
    top_k = _need(cfg, "num_experts_per_tok")
    total = dense + moe_layers * (experts * expert + shared + router)
    active = dense + moe_layers * (top_k * expert + shared + router)
    return total, active


def _count(cfg: ModelConfig, g: ModelGeometry) -> tuple[int, int]:
    h = g.hidden_size
    embedding = _need(cfg, "vocab_size") * h
    lm_head = 0 if cfg.get("tie_word_embeddings", False) else embedding
    mlp_total, mlp_active = _mlp(cfg, g)
    per_layer = g.num_layers * (_attention(cfg, g) + 2 * h) + h
    return embedding + lm_head + per_layer + mlp_total, per_layer + mlp_active
