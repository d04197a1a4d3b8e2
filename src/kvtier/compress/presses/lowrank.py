"""Low rank: each kept token's K and V replaced by its projection on a fitted rank-r basis.

ASVD (Yuan et al. 2023, arXiv:2312.05821) and Palu (Chang et al. 2024, arXiv:2407.21118)
store the KV cache as low-rank coefficients; the bases here are a PCA of calibration KV
(`kvtier.compress.lowrank`), fitted before the engine builds the press
(`kvtier.lowrank.bases`). The press keeps every token and every head; what it removes is
dimensions: rank r of a `width`-wide group keeps r / width of the bytes (`ratio` is the share
removed, as for the other presses, or give `rank`).

In the engine the press is a simulation, like `kivi`: it writes the rank-r reconstruction
back into the bfloat16 pool, so the accuracy effect is real but `kv_bytes_held` does not
drop. `LowRankCodec` is the stored form that really is smaller: a pool block as float16
coefficients (form "lowrank<r>") for the tier boundary, r / width of the block's bfloat16
bytes (width = kv_heads x head_dim with the default grouping; the bases are per model, not
per block).
"""

from __future__ import annotations

import torch

from kvtier.compress.lowrank import LowRankBasis
from kvtier.errors import KvtierError


class LowRankPress:
    """The first `sinks` tokens and the `residual` most recent ones stay exact.

    Sinks: the first token of a sequence is an attention sink whose K/V no fitted subspace
    holds (SmolLM2, rank 96 of 192: an error of 108% of its value norm and 60% of its key
    norm, against 40% / 22% for the median token; benchmarks/lowrank_error.py), and every
    query attends to it. Keeping 4 exact costs 4 tokens. `residual` is KIVI's recent window;
    0 by default.
    """

    def __init__(self, basis: LowRankBasis, rank: int, residual: int = 0, sinks: int = 4) -> None:
        for name, value in (("residual", residual), ("sinks", sinks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise KvtierError(f"lowrank: {name} must be an integer >= 0, got {value!r}")
        self.basis = basis
        self.rank = basis.rank_for(rank=rank)
        self.residual = residual
        self.sinks = sinks

    def apply(self, tokens: torch.Tensor) -> torch.Tensor:
        """[layers, 2, kv_heads, n, head_dim] -> the same, as rebuilt from rank r (all but
        the sinks and the residual window)."""
        start, end = self.sinks, tokens.shape[3] - self.residual
        if end <= start:
            return tokens
        out = tokens.clone()
        out[:, :, :, start:end] = self.basis.reconstruct(tokens[:, :, :, start:end], self.rank)
        return out


class LowRankCodec:
    """A `BlockCodec`: a pool block [layers, 2, kv_heads, block_size, head_dim] <-> its
    rank-r coefficients, one flat float16 tensor viewed as bytes."""

    def __init__(self, basis: LowRankBasis, rank: int) -> None:
        self.basis = basis
        self.rank = basis.rank_for(rank=rank)
        self.form = f"lowrank{self.rank}"

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        coefficients = self.basis.encode(block, self.rank)
        # float16 keeps 11 significant bits, more than the bfloat16 pool; clamp so an
        # outlier beyond its range cannot turn into inf.
        limit = torch.finfo(torch.float16).max
        return coefficients.clamp(-limit, limit).half().reshape(-1).view(torch.uint8)

    def decode(self, payload: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        layers, _, heads, tokens, _ = shape
        groups = heads if self.basis.grouping == "head" else 1
        coefficients = payload.view(torch.float16).reshape(layers, 2, groups, tokens, self.rank)
        return self.basis.decode(coefficients, dtype)
