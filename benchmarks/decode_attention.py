"""Where a decode step's attention goes at long context: the pool gather vs the SDPA call.

One sequence decoding at `--context` tokens, the embedded model's geometry (30 layers, 9 query
/ 3 KV heads, head dim 64, bf16, 16-token blocks), random K/V in a real `KVPool`. Per
repeat, in turn (so that a busy machine slows every case alike): all layers'
`KVPool.gather` alone; then SDPA alone over the gathered K/V and gather + SDPA, each three
ways: query heads folded with the padded length mask (`PagedAttention._attend`, main until
2026-12-01), unfolded with the mask (`PagedAttention._decode`), and unfolded over keys cut
to the context length, no mask (what a step whose decodes all see as many keys runs now).
Prints min and median ms per token (all layers) over `--repeats`:

    flock /tmp/kvtier-measure.lock env PYTHONPATH=$PWD/src .venv/bin/python \\
        benchmarks/decode_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvtier.engine.attention import PagedAttention
from kvtier.engine.kv_pool import KVPool

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=8065)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    num_blocks = -(-args.context // BLOCK)
    block_bytes = LAYERS * 2 * KV_HEADS * BLOCK * HEAD_DIM * 2
    pool = KVPool(
        LAYERS, KV_HEADS, HEAD_DIM, BLOCK, torch.bfloat16, "cpu", (num_blocks + 8) * block_bytes
    )
    pool.kv.copy_(torch.randn(pool.kv.shape))
    attention = PagedAttention(pool, HEADS, KV_HEADS, HEAD_DIM)
    # Scattered block ids, as a pool that has served other requests hands them out.
    table = torch.randperm(num_blocks + 8)[:num_blocks][None]
    visible = torch.arange(num_blocks * BLOCK) < args.context
    mask = torch.zeros(visible.shape, dtype=torch.bfloat16).masked_fill_(~visible, -torch.inf)
    mask = mask[None, None, None, :]
    q = torch.randn(1, 1, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    lens = torch.tensor([args.context])
    gathered = [pool.gather(layer, table) for layer in range(LAYERS)]

    def attend(method: Callable, gather: bool, cut: bool) -> Callable[[], None]:
        def run() -> None:
            for layer in range(LAYERS):
                k, v = pool.gather(layer, table) if gather else gathered[layer]
                if cut:
                    k, v = k[:, :, : args.context], v[:, :, : args.context]
                method(attention, layer, ["r"], q, k, v, None if cut else mask, lens)

        return run

    def gather_only() -> None:
        for layer in range(LAYERS):
            pool.gather(layer, table)

    cases = {"gather alone": gather_only}
    for gather in (False, True):
        what = "gather + SDPA" if gather else "SDPA"
        cases[f"{what} folded, mask"] = attend(PagedAttention._attend, gather, False)
        cases[f"{what} unfolded, mask"] = attend(PagedAttention._decode, gather, False)
        cases[f"{what} unfolded, cut"] = attend(PagedAttention._decode, gather, True)
    times: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, run in cases.items():
                started = time.perf_counter()
                run()
                times[name].append(1e3 * (time.perf_counter() - started))
    print(f"context {args.context}, {args.threads} threads, ms per token (all {LAYERS} layers)")
    for name, values in times.items():
        print(f"  {name:30s} min {min(values):6.1f}  median {statistics.median(values):6.1f}")


if __name__ == "__main__":
    main()
