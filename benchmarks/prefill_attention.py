"""The bf16 prefill attention kernel (engine/prefill_attention.py) against `attention._flash`
(torch's CPU flash attention) on the calls `_prefill_split` makes for one layer of a prompt
prefilled in 512-token chunks (SmolLM2's 9 query heads on 3 KV heads, head_dim 64): per chunk
the causal square (the chunk over its own keys) and, from the second chunk on, the unmasked
past (the chunk's queries folded on the KV heads against every earlier key). Prints the
median time of each part summed over a 2K and an 8K prompt's chunks, and the error of both
against float64 attention of the same bf16 inputs:

    env PYTHONPATH=$PWD/src .venv/bin/python \\
        benchmarks/prefill_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvtier.engine import prefill_attention as pa
from kvtier.engine.attention import _flash

HEADS, KV_HEADS, DIM, CHUNK = 9, 3, 64, 512
GROUP = HEADS // KV_HEADS
SCALE = DIM**-0.5


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calls(past: int):
    """The chunk at position `past`: (square by _flash, by the kernel, past by _flash, by the
    kernel), each a zero-argument callable; the past ones None for the first chunk."""
    g = torch.Generator().manual_seed(past)
    q = torch.randn(HEADS, CHUNK, DIM, generator=g).to(torch.bfloat16)  # [heads, m, D]
    k = torch.randn(KV_HEADS, past + CHUNK, DIM, generator=g).to(torch.bfloat16)
    v = torch.randn(KV_HEADS, past + CHUNK, DIM, generator=g).to(torch.bfloat16)
    own_k, own_v = k[:, past:], v[:, past:]
    rk, rv = own_k.repeat_interleave(GROUP, 0)[None], own_v.repeat_interleave(GROUP, 0)[None]
    folded = q.reshape(KV_HEADS, GROUP * CHUNK, DIM)
    square_flash = lambda: _flash(q[None], rk, rv, is_causal=True)  # noqa: E731
    square_kernel = lambda: pa.prefill_attention(folded, own_k, own_v, SCALE, CHUNK)  # noqa: E731
    if not past:
        return square_flash, square_kernel, None, None
    pk, pv = k[:, :past].contiguous(), v[:, :past].contiguous()
    past_flash = lambda: _flash(folded[None], pk[None], pv[None])  # noqa: E731
    past_kernel = lambda: pa.prefill_attention(folded, pk, pv, SCALE)  # noqa: E731
    return square_flash, square_kernel, past_flash, past_kernel


def accuracy() -> None:
    """max / mean |error| against float64, a causal square and an unmasked past of 1536."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(HEADS, CHUNK, DIM, generator=g).to(torch.bfloat16)
    k = torch.randn(KV_HEADS, 2048, DIM, generator=g).to(torch.bfloat16)
    v = torch.randn(KV_HEADS, 2048, DIM, generator=g).to(torch.bfloat16)
    folded = q.reshape(KV_HEADS, GROUP * CHUNK, DIM)

    def reference(qq, kk, vv, causal):
        s = (qq.double() @ kk.double().transpose(-1, -2)) * SCALE
        if causal:
            s = s + torch.full(s.shape[-2:], float("-inf"), dtype=s.dtype).triu(1)
        return s.softmax(-1) @ vv.double(), s.logsumexp(-1)

    own_k, own_v = k[:, :CHUNK], v[:, :CHUNK]
    rk, rv = own_k.repeat_interleave(GROUP, 0), own_v.repeat_interleave(GROUP, 0)
    want, want_lse = reference(q, rk, rv, True)
    fo, fl = _flash(q[None], rk[None], rv[None], is_causal=True)
    ko, kl = pa.prefill_attention(folded, own_k, own_v, SCALE, CHUNK)
    show("square 512", want, want_lse, fo[0], fl[0], ko.view(q.shape), kl.view(q.shape[:2]))
    pk, pv = k[:, CHUNK:], v[:, CHUNK:]
    want, want_lse = reference(folded, pk, pv, False)
    fo, fl = _flash(folded[None], pk[None], pv[None])
    ko, kl = pa.prefill_attention(folded, pk, pv, SCALE)
    show("past 1536", want, want_lse, fo[0], fl[0], ko, kl)


def show(name, want, want_lse, fo, fl, ko, kl) -> None:
    def err(x, ref):
        d = (x.double() - ref).abs()
        return f"max {d.max():.2e} mean {d.mean():.2e}"

    print(f"{name}: output  _flash (bf16) {err(fo, want)} | kernel (f32) {err(ko, want)}")
    print(f"{name}: lse     _flash        {err(fl, want_lse)} | kernel       {err(kl, want_lse)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert pa.available(), "the kernel is not built here (compiler or AVX512_BF16 missing)"
    accuracy()
    per_chunk = []  # (square flash, square kernel, past flash, past kernel) seconds
    for c in range(8192 // CHUNK):
        fns = calls(c * CHUNK)
        per_chunk.append([0.0 if f is None else median_time(f, args.repeats) for f in fns])
    print(f"threads {args.threads}, medians of {args.repeats}, one layer, ms summed over chunks")
    for total in (2048, 8192):
        rows = per_chunk[: total // CHUNK]
        sf, sk, pf, pk = (sum(r[i] for r in rows) * 1e3 for i in range(4))
        print(
            f"{total // 1024}K prompt: square _flash {sf:7.2f} kernel {sk:7.2f} ({sf / sk:.2f}x) | "
            f"past _flash {pf:7.2f} kernel {pk:7.2f} ({pf / pk:.2f}x) | "
            f"both {sf + pf:7.2f} -> {sk + pk:7.2f} ({(sf + pf) / (sk + pk):.2f}x)"
        )


if __name__ == "__main__":
    main()
