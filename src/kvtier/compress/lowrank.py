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
bases hold every direction, most variance first, and rank r is the first r of them.

This module is the basis and its arithmetic only. Fitting one runs the model, so it is a
calibration step above the engine (`kvtier.lowrank.bases`: a prefill feeding
`MomentAccumulator`, the disk cache of fits); it hands the press a ready basis through
`kvtier.compress.fitted_bases`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvtier.errors import KvtierError

GROUPINGS = ("head", "layer")
DEFAULT_CALIBRATION = "workshop_notes"
CALIBRATION_TOKENS = 4096


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
