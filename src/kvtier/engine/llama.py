"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, SmolLM2) in plain PyTorch, varlen style.

All tokens of a step, from every sequence, are one flat [num_tokens, hidden] batch for the
linear layers; only attention (`PagedAttention`) knows where one sequence ends and the next
begins. q/k/v and gate/up weights are concatenated at load time so each is one matmul.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kvtier.engine.attention import AttentionMetadata, PagedAttention
from kvtier.errors import KvtierError

_SUPPORTED_TYPES = {"llama", "mistral", "qwen2"}


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> LlamaConfig:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        model_type = raw.get("model_type", "")
        if model_type not in _SUPPORTED_TYPES:
            raise KvtierError(
                f"model_type {model_type!r} is not supported by the kvtier engine "
                f"(supported: {', '.join(sorted(_SUPPORTED_TYPES))})"
            )
        # transformers 5 writes `rope_parameters` (theta + scaling in one dict); older
        # configs have `rope_theta` and `rope_scaling` side by side.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        heads = raw["num_attention_heads"]
        window = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            window = None
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            sliding_window=window,
        )

    @property
    def max_context(self) -> int:
        """Longest sequence served exactly: attention inside a sliding window equals full
        attention, so a windowed model is capped at its window instead of approximated."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """RoPE inverse frequencies (float32), with Llama 3.1 frequency-dependent scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] != "llama3":
        raise KvtierError(f"rope_type {scaling['rope_type']!r} is not supported (llama3 is)")
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(config: LlamaConfig, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [num_positions, head_dim] in float32 (computed as transformers does)."""
    freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), rope_inv_freq(config))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder's safetensors, single file or sharded (index.json)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise KvtierError(f"no *.safetensors weights in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(model_dir / name), device="cpu"))
    return weights


# oneDNN computes a one-row bf16 matmul with another kernel, and past 1,024 input features
# that kernel rounds some outputs differently from the same row in a call of 2 to 700 rows
# (measured on real activations: 10% of the down projection's rows of SmolLM2, none of its
# 576-feature matmuls; benchmarks/records/2026-12-02-one-row-matmuls.md). A sequence decoding
# alone would then answer otherwise than beside another request, so `Linear` never hands it one
# such row.
ONE_ROW_MAX_IN = 1024


class Linear:
    """y = x @ W^T (+ b), with the weight pre-packed for oneDNN on CPU in bf16.

    `F.linear` re-lays out a plain bf16 weight into oneDNN's blocked format on every call;
    packing once at load made the model's matmuls ~1.8x faster at decode batch sizes on
    this CPU (and never slower at prefill sizes), with bitwise identical results. This is
    the packing torch.compile's CPU backend does; other devices and dtypes use F.linear.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.packed = _can_pack(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        if x.dim() == 2 and x.shape[0] == 1 and x.shape[1] > ONE_ROW_MAX_IN:
            return self._packed(x.expand(2, -1).contiguous())[:1]
        return self._packed(x)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Variance in float32 whatever the model dtype, as the reference implementation does,
    with the same roundings in the same order (so the same bits), in fewer passes: the
    scaling in place on the float32 copy, the weight in place on the result."""
    x32 = x.to(torch.float32, copy=True)
    inv_rms = x32.square().mean(-1, keepdim=True).add_(eps).rsqrt_()
    return x32.mul_(inv_rms).to(x.dtype).mul_(weight)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: what `apply_rope` multiplies the swapped halves by."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim]; cos and `signed_sin(sin)` [N, 1, head_dim]. Rotates the two
    halves: x * cos + cat(-x2, x1) * sin, computed as x * cos + cat(x2, x1) * signed sin
    (the same bits: negating before or after a rounded product is exact), one pass less."""
    half = x.shape[-1] // 2
    out = x * cos
    out += torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(sin_signed)
    return out


class LlamaModel:
    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        attention: PagedAttention,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        self.config = config
        self.attention = attention
        self.dtype = dtype

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KvtierError(f"weight {name!r} missing from the model folder")
            return weights[name].to(device=device, dtype=dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in weights else None

        self.embed = take("model.embed_tokens.weight")
        self.final_norm = take("model.norm.weight")
        lm_head = maybe("lm_head.weight")
        self.lm_head = Linear(
            self.embed if lm_head is None or config.tie_word_embeddings else lm_head
        )
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            biases = [maybe(f"{attn}{n}_proj.bias") for n in "qkv"]
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=Linear(
                        torch.cat([take(f"{attn}{n}_proj.weight") for n in "qkv"]),
                        None if biases[0] is None else torch.cat(biases),
                    ),
                    o=Linear(take(attn + "o_proj.weight")),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=Linear(
                        torch.cat(
                            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
                        )
                    ),
                    down=Linear(take(p + "mlp.down_proj.weight")),
                )
            )
        cos, sin = rope_tables(config, config.max_position_embeddings)
        # Tables in the model dtype: transformers casts cos/sin to the activations' dtype.
        self.cos = cos.to(device=device, dtype=dtype)
        self.sin_signed = signed_sin(sin.to(device=device, dtype=dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        layer_ready: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run one step; return float32 logits of the rows `logits_indices` only.

        layer_ready: called with i before layer i's attention reads the KV pool, so that a
            restore filling the pool layer by layer can run beside the layers before it."""
        cfg = self.config
        n = input_ids.shape[0]
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin_signed[positions].unsqueeze(1)
        heads = cfg.num_heads + cfg.num_kv_heads
        h = F.embedding(input_ids, self.embed)
        for layer_idx, w in enumerate(self.layers):
            x = rms_norm(h, w.input_norm, cfg.rms_norm_eps)
            qkv = w.qkv(x)
            # q and k rotated in one pass: adjacent columns of qkv, [N, heads + kv_heads, D].
            qk = apply_rope(qkv[:, : q_size + kv_size].view(n, heads, cfg.head_dim), cos, sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, q_size + kv_size :].view(n, cfg.num_kv_heads, cfg.head_dim)
            if layer_ready is not None:
                layer_ready(layer_idx)
            h += w.o(self.attention(layer_idx, q, k, v, meta))
            x = rms_norm(h, w.post_norm, cfg.rms_norm_eps)
            gate, up = w.gate_up(x).chunk(2, dim=-1)
            h += w.down(F.silu(gate) * up)
        h = rms_norm(h[logits_indices], self.final_norm, cfg.rms_norm_eps)
        return self.lm_head(h).float()
