"""Low-rank KV: orthonormal key and value bases fitted on calibration text (PCA per layer).

The ASVD / Palu family (Yuan et al. 2023, arXiv:2312.05821; Chang et al. 2024,
arXiv:2407.21118) stores keys and values in fewer dimensions than the heads have: most of
their energy lies in a small subspace. Here each layer's K and V are fitted separately, over
all KV heads of the layer together (`grouping="layer"`, the default: one
kv_heads x head_dim-wide space, so heads share directions) or per KV head (`"head"`). At the
same bytes the layer grouping keeps more (the per-head bases are one of its candidates; see
docs/compression.md for the measured errors). The fit is a PCA of the keys and values the model
computes over a calibration text: the mean, and the eigenvectors of the covariance sorted by
variance. A token is stored as its coefficients on the first `rank` directions and
reconstructed as `mean + coefficients @ directions^T`; the full rank reproduces it.

Keys are fitted after RoPE, as the pool holds them. Palu projects keys before RoPE (fewer
directions needed, since RoPE spreads each pair of channels over a circle), but then every
attention read must reconstruct and re-rotate the keys at their positions. Here the
reconstruction has to be a drop-in key: the engine's attention reads the pool unchanged, and
a tier codec sees a block without knowing its positions. So post-RoPE it is, calibrated over
`CALIBRATION_TOKENS` positions so the slowly rotating channels are seen at the positions
they will be served at (the text is repeated to that length).

A fit depends only on (model, calibration text, length, grouping), never on the rank: the
bases hold every direction, most variance first, and rank r is the first r of them. Fits are
cached under `$KVTIER_CACHE/lowrank/` as safetensors, so a model is calibrated once.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kvtier.errors import KvtierError
from kvtier.paths import cache_dir

GROUPINGS = ("head", "layer")
DEFAULT_CALIBRATION = "workshop_notes"
CALIBRATION_TOKENS = 4096
# Bump when the fit changes, so stale cached files are not reused.
_FIT_VERSION = 1


@dataclass(frozen=True)
class LowRankBasis:
    """Fitted bases of one model: per layer, K and V, group of KV heads.

    `mean` [layers, 2 (K, V), groups, width]; `directions` [layers, 2, groups, width, width]
    orthonormal columns, most variance first; `variance` [layers, 2, groups, width] the
    calibration variance along each direction. width = head_dim per head (grouping "head")
    or num_kv_heads * head_dim (grouping "layer"). All float32.
    """

    grouping: str
    num_kv_heads: int
    head_dim: int
    mean: torch.Tensor
    directions: torch.Tensor
    variance: torch.Tensor

    @property
    def num_layers(self) -> int:
        return self.mean.shape[0]

    @property
    def width(self) -> int:
        return self.mean.shape[-1]

    def rank_for(self, ratio: float = 0.0, rank: int | None = None) -> int:
        """The rank kept: `rank` as given, else the share `1 - ratio` of the width."""
        if rank is None:
            if not 0.0 <= ratio < 1.0:
                raise KvtierError(
                    "lowrank: ratio must be in [0, 1) (share of the KV bytes removed), "
                    f"got {ratio!r}"
                )
            return max(1, round(self.width * (1.0 - ratio)))
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= self.width:
            raise KvtierError(
                f"lowrank: rank must be an integer from 1 to {self.width} (the width of a "
                f"{self.grouping} group of K or V), got {rank!r}"
            )
        return rank

    def check_geometry(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        mine = (self.num_layers, self.num_kv_heads, self.head_dim)
        if mine != (num_layers, num_kv_heads, head_dim):
            raise KvtierError(
                f"lowrank: the projections were fitted for {mine[0]} layers x {mine[1]} KV heads "
                f"x head dim {mine[2]}, but this KV has {num_layers} x {num_kv_heads} x "
                f"{head_dim}; fit them on the model being served (press option 'model')"
            )

    def encode(self, kv: torch.Tensor, rank: int) -> torch.Tensor:
        """[layers, 2, kv_heads, n, head_dim] -> coefficients [layers, 2, groups, n, rank]."""
        self.check_geometry(kv.shape[0], kv.shape[2], kv.shape[4])
        centred = to_groups(kv.float(), self.grouping) - self.mean[..., None, :]
        return centred @ self.directions[..., :rank]

    def decode(self, coefficients: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Coefficients [layers, 2, groups, n, rank] -> [layers, 2, kv_heads, n, head_dim]."""
        rank = coefficients.shape[-1]
        grouped = coefficients.float() @ self.directions[..., :rank].transpose(-1, -2)
        restored = grouped + self.mean[..., None, :]
        return from_groups(restored, self.grouping, self.num_kv_heads, self.head_dim).to(dtype)

    def reconstruct(self, kv: torch.Tensor, rank: int) -> torch.Tensor:
        """`kv` as it comes back from rank `rank` (same shape and dtype)."""
        return self.decode(self.encode(kv, rank), kv.dtype)


class MomentAccumulator:
    """Running sums of K/V (float64) per layer, K|V and group, block by block: fed each block
    as the engine fills it, the calibration KV is never held in full (4K tokens of SmolLM2 in
    float32 would be 190 MB)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, grouping: str) -> None:
        check_grouping(grouping)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        groups, width = (num_kv_heads, head_dim)
        if grouping == "layer":
            groups, width = 1, num_kv_heads * head_dim
        self.grouping = grouping
        self.count = 0
        self.total = torch.zeros(num_layers, 2, groups, width, dtype=torch.float64)
        self.gram = torch.zeros(num_layers, 2, groups, width, width, dtype=torch.float64)

    def add(self, kv: torch.Tensor) -> None:
        """Tokens [layers, 2, kv_heads, n, head_dim]."""
        x = to_groups(kv.to("cpu", torch.float64), self.grouping)  # [L, 2, G, n, width]
        self.count += x.shape[-2]
        self.total += x.sum(-2)
        self.gram += x.transpose(-1, -2) @ x

    def basis(self) -> LowRankBasis:
        """PCA of what was seen: mean, and covariance eigenvectors by falling variance."""
        if self.count < 2:
            raise KvtierError("lowrank: calibration produced no full KV block to fit on")
        mean = self.total / self.count
        covariance = self.gram / self.count - mean[..., :, None] * mean[..., None, :]
        covariance = (covariance + covariance.transpose(-1, -2)) / 2  # exact symmetry
        variance, directions = torch.linalg.eigh(covariance)  # ascending
        variance, directions = variance.flip(-1), directions.flip(-1)
        # An eigenvector's sign is arbitrary: fix it (largest entry positive) so that two
        # fits of the same data give the same file.
        largest = directions.abs().argmax(dim=-2, keepdim=True)
        signs = directions.gather(-2, largest).sign()
        directions = directions * torch.where(signs == 0, 1.0, signs)
        return LowRankBasis(
            self.grouping,
            self.num_kv_heads,
            self.head_dim,
            mean.float(),
            directions.float().contiguous(),
            variance.clamp(min=0).float(),
        )


def to_groups(kv: torch.Tensor, grouping: str) -> torch.Tensor:
    """[layers, 2, kv_heads, n, head_dim] -> [layers, 2, groups, n, width]."""
    if grouping == "head":
        return kv
    layers, _, heads, n, dim = kv.shape
    return kv.permute(0, 1, 3, 2, 4).reshape(layers, 2, 1, n, heads * dim)


def from_groups(x: torch.Tensor, grouping: str, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """The inverse of `to_groups`."""
    if grouping == "head":
        return x
    layers, _, _, n, _ = x.shape
    split = x.reshape(layers, 2, n, num_kv_heads, head_dim)
    return split.permute(0, 1, 3, 2, 4).contiguous()


def check_grouping(grouping: str) -> None:
    if grouping not in GROUPINGS:
        raise KvtierError(f"lowrank: grouping must be one of {GROUPINGS}, got {grouping!r}")


def calibration_text(name: str) -> str:
    """A calibration text by name: a file of `kvtier/data/calibration/`, or "prose" for the
    packaged prose that `kvtier eval` builds its haystacks from (a matched calibration)."""
    if name == "prose":
        folder = resources.files("kvtier") / "data" / "text"
        names = sorted(i.name for i in folder.iterdir() if i.name.endswith(".txt"))
        return "\n".join((folder / n).read_text(encoding="utf-8") for n in names)
    folder = resources.files("kvtier") / "data" / "calibration"
    known = sorted(i.name.removesuffix(".txt") for i in folder.iterdir() if i.name.endswith(".txt"))
    if name not in known:
        raise KvtierError(
            f"lowrank: unknown calibration text {name!r}; known: {', '.join([*known, 'prose'])}"
        )
    return (folder / f"{name}.txt").read_text(encoding="utf-8")


def calibration_tokens(tokenizer: Any, text: str, num_tokens: int) -> list[int]:
    """The text's token ids, repeated (a newline between copies) up to `num_tokens`."""
    ids = tokenizer.encode(text.strip() + "\n\n", add_special_tokens=False)
    return (ids * math.ceil(num_tokens / len(ids)))[:num_tokens]


class _BlockReader:
    """A block listener handing the KV of every block the engine fills to `take`, in token
    order. (Not a subclass of the engine's listener base: importing the engine here would
    be circular.)"""

    def __init__(self, pool: Any, take: Callable[[torch.Tensor], None]) -> None:
        self.pool, self.take = pool, take

    def on_block_filled(self, block_id: int, key: bytes) -> None:
        self.take(self.pool.read_block(block_id))

    def on_block_freed(self, block_id: int) -> None:
        pass

    def on_block_evicted(self, block_id: int, key: bytes) -> None:
        pass


def _prefill_with(engine: Any, token_ids: list[int], take: Callable[[torch.Tensor], None]) -> None:
    """One prefill of `token_ids`, handing the KV of every block it fills to `take`.

    The engine must cache prefixes (full blocks are read as they are registered), run no
    compression and be idle; its prefix cache is reset first so every block is computed, and
    after (the prefix is of no use to anyone)."""
    if not engine.config.enable_prefix_caching:
        raise KvtierError("lowrank calibration needs an engine with prefix caching on")
    if engine.config.compression is not None and not engine.config.compression.is_identity:
        raise KvtierError("lowrank calibration needs an engine without compression")
    if engine.has_unfinished_requests():
        raise KvtierError("lowrank calibration needs an idle engine")
    from kvtier.engine import SamplingParams

    reader = _BlockReader(engine.kv_pool, take)
    engine.reset_prefix_cache()
    engine.add_block_listener(reader)
    try:
        [out] = engine.generate([token_ids], SamplingParams(temperature=0, max_tokens=1))
    finally:
        engine.remove_block_listener(reader)
    if out.finish_reason == "error":
        raise KvtierError(f"lowrank calibration failed: {out.error}")
    engine.reset_prefix_cache()


def prompt_kv(engine: Any, token_ids: list[int]) -> torch.Tensor:
    """[layers, 2, kv_heads, tokens, head_dim] the engine computes for `token_ids`, whole
    blocks only (for measuring how well a basis fits real KV)."""
    blocks: list[torch.Tensor] = []
    _prefill_with(engine, token_ids, blocks.append)
    return torch.cat(blocks, dim=3)


def fit_basis(engine: Any, token_ids: list[int], grouping: str = "layer") -> LowRankBasis:
    """Fit bases on the KV `engine` computes for `token_ids` (one prefill, see `_prefill_with`
    for what the engine must be)."""
    pool = engine.kv_pool
    moments = MomentAccumulator(pool.num_layers, pool.num_kv_heads, pool.head_dim, grouping)
    _prefill_with(engine, token_ids, moments.add)
    return moments.basis()


def load_or_fit(
    model: str | None = None,
    calibration: str = DEFAULT_CALIBRATION,
    grouping: str = "layer",
    num_tokens: int = CALIBRATION_TOKENS,
) -> LowRankBasis:
    """The bases of `model` (None: the embedded SmolLM2), from the disk cache or fitted now
    (a float32 engine prefilling `num_tokens` of the calibration text) and cached."""
    check_grouping(grouping)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 64:
        raise KvtierError(f"lowrank: calibrate on at least 64 tokens, got {num_tokens!r}")
    from kvtier.models.resolve import resolve_model_dir

    model_dir = resolve_model_dir(model)
    text = calibration_text(calibration)
    path = cache_path(model_dir, calibration, grouping, num_tokens)
    return _load_or_fit(path, str(model_dir), text, grouping, num_tokens)


def cache_path(model_dir: Path, calibration: str, grouping: str, num_tokens: int) -> Path:
    """Where the fit of (model, calibration text, grouping, length) is cached. The model is
    its block-key id (folder, digest of config and weight files), the text its content."""
    from kvtier.engine.engine import default_namespace

    key = "|".join(
        (
            f"v{_FIT_VERSION}",
            default_namespace(model_dir, "float32"),
            hashlib.sha256(calibration_text(calibration).encode()).hexdigest(),
            grouping,
            str(num_tokens),
        )
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = f"{model_dir.name}-{calibration}-{grouping}-{num_tokens}-{digest}.safetensors"
    return cache_dir() / "lowrank" / name


@cache
def _load_or_fit(
    path: Path, model_dir: str, text: str, grouping: str, num_tokens: int
) -> LowRankBasis:
    if path.is_file():
        return load_basis(path)
    from kvtier.engine import Engine, EngineConfig

    engine = Engine(
        EngineConfig(
            model_dir=model_dir,
            dtype="float32",
            # the engine sets torch's global thread count: keep the caller's
            num_threads=torch.get_num_threads(),
            kv_cache_bytes=_pool_bytes_for(model_dir, num_tokens),
        )
    )
    try:
        basis = fit_basis(engine, calibration_tokens(engine.tokenizer, text, num_tokens), grouping)
    finally:
        engine.close()
    save_basis(basis, path)
    return basis


def _pool_bytes_for(model_dir: str, num_tokens: int) -> int:
    from kvtier.engine.llama import LlamaConfig

    per_token = LlamaConfig.from_model_dir(Path(model_dir)).kv_bytes_per_token(torch.float32)
    return per_token * (num_tokens + 64)  # the prompt, its first token, block rounding


def save_basis(basis: LowRankBasis, path: Path) -> None:
    """Write atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tensors = {"mean": basis.mean, "directions": basis.directions, "variance": basis.variance}
    metadata = {
        "grouping": basis.grouping,
        "num_kv_heads": str(basis.num_kv_heads),
        "head_dim": str(basis.head_dim),
    }
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)


def load_basis(path: Path) -> LowRankBasis:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    try:
        tensors = load_file(str(path))
        return LowRankBasis(
            metadata["grouping"],
            int(metadata["num_kv_heads"]),
            int(metadata["head_dim"]),
            tensors["mean"],
            tensors["directions"],
            tensors["variance"],
        )
    except (KeyError, ValueError) as exc:
        raise KvtierError(
            f"lowrank: {path} is not a kvtier projection file ({exc}); delete it"
        ) from None
