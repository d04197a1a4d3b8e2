"""What one stored chunk costs to bring back from disk, per form: the read and the decode.

    .venv/bin/python benchmarks/form_restore.py \
        [--forms full,int8,int4] [--chunks 16] [--repeats 5]

`--chunks` chunks of 256 tokens of the embedded SmolLM2's KV geometry (random bfloat16
values: neither the read nor the decode depends on them) are stored in a `DiskTier` in each
form (`ChunkForms.recode`, as the mover does), then read back one after the other on one
thread (torch threads: 1), as a prefetch worker does: the tier's `get` (read and checksum),
then `ChunkForms.restore` (nothing for full precision; the decode for a quantized form).
Each pass reads every chunk either from the page cache ("hot", the segments read once
before) or from the device ("cold": each segment file fsynced and dropped from the page
cache first, `resume.evict_from_page_cache`). Per form and source: the median per chunk over
all chunks of all passes.

This is the part of a resumed turn (`resume.py`) that a form changes, without the engine,
the forward and the second prefetch worker, whose timings on a shared machine are noisier
than the differences a form makes.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from resume import evict_from_page_cache

from kvtier.cache.forms import ChunkForms
from kvtier.tiers import Payload
from kvtier.tiers.disk import DiskTier

# one block of the embedded SmolLM2: [layers, K|V, kv_heads, block_size, head_dim]
BLOCK_SHAPE = torch.Size((30, 2, 3, 16, 64))
BLOCKS_PER_CHUNK = 16  # 256 tokens


def read_pass(tier: DiskTier, forms: ChunkForms, keys: list[bytes]) -> list[tuple[float, float]]:
    """(read s, decode s) of each chunk, read in turn."""
    times = []
    for key in keys:
        start = time.perf_counter()
        payload = tier.get(key)
        read = time.perf_counter()
        restored = forms.restore(payload)
        if restored is None:
            raise RuntimeError(f"chunk {key!r} did not come back")
        times.append((read - start, time.perf_counter() - read))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forms", default="full,int8,int4")
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    forms = ChunkForms(BLOCK_SHAPE, torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    chunks = [
        Payload.of(torch.randn(BLOCKS_PER_CHUNK, *BLOCK_SHAPE, generator=generator).bfloat16())
        for _ in range(args.chunks)
    ]
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-form-restore-"))
    rows = []
    try:
        for form in args.forms.split(","):
            directory = workdir / form
            tier = DiskTier(directory, 4 * args.chunks * chunks[0].nbytes)
            keys = [f"{form}-{i}".encode() for i in range(args.chunks)]
            for key, chunk in zip(keys, chunks, strict=True):
                if not tier.put(key, forms.recode(chunk, form)):
                    raise RuntimeError(f"the disk tier refused chunk {key!r}")
            stored = tier.used_bytes // args.chunks
            for source in ("hot", "cold"):
                times = []
                for _ in range(args.repeats):
                    if source == "cold":
                        evict_from_page_cache(directory)
                    else:
                        read_pass(tier, forms, keys)  # into the page cache
                    times += read_pass(tier, forms, keys)
                read = statistics.median(t[0] for t in times) * 1000
                decode = statistics.median(t[1] for t in times) * 1000
                total = statistics.median(sum(t) for t in times) * 1000
                rows.append((form, source, stored, read, decode, total))
            tier.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\none 256-token chunk of SmolLM2 KV from the disk tier, 1 thread, medians over "
        f"{args.chunks} chunks x {args.repeats} passes\n"
    )
    print("| form | disk | bytes per chunk | read ms | decode ms | read + decode ms |")
    print("|---|---|---:|---:|---:|---:|")
    for form, source, stored, read, decode, total in rows:
        print(f"| {form} | {source} | {stored:,} | {read:.2f} | {decode:.2f} | {total:.2f} |")


if __name__ == "__main__":
    main()
