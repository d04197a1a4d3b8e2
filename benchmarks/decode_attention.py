"""Decode attention alone at long context: the pool gather + SDPA against the paged kernel.

`--batch` sequences decoding at `--context` tokens each, the embedded model's geometry (30
layers, 9 query / 3 KV heads, head dim 64, 16-token blocks), random K/V in a real `KVPool`
whose blocks are handed out in a shuffled order (as a pool that has served a while does).
Per repeat, in turn: all layers' gather + one padded SDPA call (`PagedAttention._attend`,
the path decodes take with `EngineConfig.paged_decode` off) and all layers of the paged
kernel (`paged_decode.decode_attention`, no gather) on one thread and on `--threads` (torch's
OpenMP threads, as the engine calls it). With `--between-matmuls` each layer's attention
sits between two torch matmuls of a decode row by a [576, 1536] weight, as in the model,
so that torch's OpenMP workers are awake (and spinning) when attention starts; the matmuls
alone are timed too. Prints min and median ms per token (all layers) over `--repeats`, and
the largest difference between the outputs of the old path and the kernel:

    env PYTHONPATH=$PWD/src .venv/bin/python \\
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
    parser.add_argument("--between-matmuls", action="store_true")
    parser.add_argument(
        "--only", choices=("gather", "kernel"), default=None, help="one path, in its own process"
    )
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
    weight = torch.randn(576, 1536, dtype=dtype)
    row = torch.randn(1, 576, dtype=dtype)

    def per_layer(name: str, attend: Callable[[int], torch.Tensor] | None) -> Callable[[], None]:
        def run() -> None:
            results = []
            for layer in range(LAYERS):
                if args.between_matmuls:
                    row @ weight
                if attend is not None:
                    results.append(attend(layer))
                if args.between_matmuls:
                    row @ weight
            outputs[name] = results

        return run

    def kernel(threads: int) -> Callable[[int], torch.Tensor]:
        return lambda layer: paged_decode.decode_attention(
            pool.kv, layer, q, tables, lens, attention.scale, threads
        ).to(dtype)

    def gathered(layer: int) -> torch.Tensor:
        key, value = pool.gather(layer, tables)
        return attention._attend(layer, ["r"], q[:, None], key, value, mask, lens)[:, 0]

    cases = {
        "gather + SDPA": per_layer("gather + SDPA", gathered),
        "kernel, 1 thread": per_layer("kernel, 1 thread", kernel(1)),
        f"kernel, {args.threads} threads": per_layer("kernel", kernel(args.threads)),
    }
    if args.only == "gather":
        cases = {"gather + SDPA": cases["gather + SDPA"]}
    elif args.only == "kernel":
        del cases["gather + SDPA"]
    if args.between_matmuls:
        cases["matmuls alone"] = per_layer("matmuls", None)
    times: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, run in cases.items():
                started = time.perf_counter()
                run()
                times[name].append(1e3 * (time.perf_counter() - started))
    print(
        f"context {args.context}, batch {args.batch}, {args.dtype}, {args.threads} threads"
        f"{', between matmuls' if args.between_matmuls else ''}, ms per token (all {LAYERS} layers)"
    )
    for name, values in times.items():
        print(f"  {name:18s} min {min(values):6.1f}  median {statistics.median(values):6.1f}")
    if args.only:
        return
    diff = max(
        (a.float() - b.float()).abs().max().item()
        for a, b in zip(outputs["gather + SDPA"], outputs["kernel"], strict=True)
    )
    print(f"  largest |difference| of the outputs: {diff:.3g}")


if __name__ == "__main__":
    main()
