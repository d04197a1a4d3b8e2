"""Decode attention alone at long context: the pool gather + SDPA against the paged kernel.

`--batch` sequences decoding at `--context` tokens each, the embedded model's geometry (30
layers, 9 query / 3 KV heads, head dim 64, 16-token blocks), random K/V in a real `KVPool`
whose blocks are handed out in a shuffled order (as a pool that has served a while does).
Per repeat, in turn: all layers' gather + one padded SDPA call (`PagedAttention._attend`,
the path every decode took before `engine/paged_decode.py`) and all layers of the paged
kernel (`paged_decode.decode_attention`, no gather). Prints min and median ms per token
(all layers) over `--repeats`, and the largest difference between the two outputs:

    flock /tmp/kvtier-measure.lock env PYTHONPATH=$PWD/src .venv/bin/python \\
        benchmarks/decode_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvtier.engine import paged_decode
from kvtier.engine.attention import PagedAttention
from kvtier.engine.kv_pool import KVPool

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=8065)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    per_seq = -(-args.context // BLOCK)
    num_blocks = per_seq * args.batch
    block_bytes = LAYERS * 2 * KV_HEADS * BLOCK * HEAD_DIM * dtype.itemsize
    pool = KVPool(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, dtype, "cpu", (num_blocks + 8) * block_bytes)
    pool.kv.copy_(torch.randn(pool.kv.shape))
    attention = PagedAttention(pool, HEADS, KV_HEADS, HEAD_DIM)
    tables = torch.randperm(pool.num_blocks)[:num_blocks].view(args.batch, per_seq)
    visible = torch.arange(per_seq * BLOCK) < args.context
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, -torch.inf)
    mask = mask[None, None, None, :]
    q = torch.randn(args.batch, HEADS, HEAD_DIM, dtype=dtype)
    lens = torch.full((args.batch,), args.context)
    outputs: dict[str, list[torch.Tensor]] = {}

    def gather_sdpa() -> None:
        outputs["gather + SDPA"] = [
            attention._attend(layer, ["r"], q[:, None], *pool.gather(layer, tables), mask, lens)
            for layer in range(LAYERS)
        ]

    def kernel() -> None:
        outputs["paged kernel"] = [
            paged_decode.decode_attention(
                pool.kv, layer, q, tables, lens, attention.scale, args.threads
            ).to(dtype)
            for layer in range(LAYERS)
        ]

    cases: dict[str, Callable[[], None]] = {"gather + SDPA": gather_sdpa, "paged kernel": kernel}
    times: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, run in cases.items():
                started = time.perf_counter()
                run()
                times[name].append(1e3 * (time.perf_counter() - started))
    print(
        f"context {args.context}, batch {args.batch}, {args.dtype}, {args.threads} threads,"
        f" ms per token (all {LAYERS} layers)"
    )
    for name, values in times.items():
        print(f"  {name:15s} min {min(values):6.1f}  median {statistics.median(values):6.1f}")
    diff = max(
        (a[:, 0].float() - b.float()).abs().max().item()
        for a, b in zip(outputs["gather + SDPA"], outputs["paged kernel"], strict=True)
    )
    print(f"  largest |difference| of the outputs: {diff:.3g}")


if __name__ == "__main__":
    main()
