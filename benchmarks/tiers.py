"""Tier bandwidth next to the raw operation each tier wraps, per chunk size.

    .venv/bin/python benchmarks/tiers.py --out out/tiers_bench.json [--quick]

For chunks of 16..1024 tokens of the embedded model (23,040 B/token in bf16 = 2 x 30 layers x
3 KV heads x 64 x 2 B) it measures, as medians of repeats:

- host save/load (HostTier put / get into a caller buffer) vs `torch` copies of the same bytes
  between the same buffers;
- disk write/read (DiskTier) vs plain sequential pwrite/pread of the same bytes, buffered
  (page cache: hot reads, and cold reads after dropping the page cache when allowed) and with
  O_DIRECT (the device itself), the latter twice: the tier's payload and output in page-aligned
  memory (the raw side's best case, which the tier then moves without a bounce copy) and in
  torch's own tensors (64 bytes into a page: the tier copies through its bounce buffer);
- Redis put/get (RedisTier) vs plain SET/GET of values of the same size with the redis client;
- write amplification of the disk tier (bytes written to files / payload bytes) under a
  sequential overflow and under churn, and the cost of rewriting records in place vs appending.

It starts its own redis-server (without persistence) unless given --redis-url.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import redis
import torch
from local_redis import start_redis
from redis.connection import Encoder, PythonRespSerializer

from kvtier.tiers import DiskTier, HostTier, Payload, RedisTier
from kvtier.tiers.payload import aligned_bytes

BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # the embedded SmolLM2-135M in bf16
BLOCK_TOKENS = 16
TARGETS = {"host": 0.80, "disk": 0.70, "redis": 0.70}  # ours / raw, at chunks >= 256 tokens


def clock(op: Callable[[Any], object], items: Iterable[Any]) -> float:
    """Seconds to apply `op` to every item, dropping each result at once (a result kept alive,
    such as a GET's bytes, would make the allocator hand out fresh pages to the next call)."""
    start = time.perf_counter()
    for item in items:
        op(item)
    return time.perf_counter() - start


def rates(
    ours: Callable[[], float], raw: Callable[[], float], nbytes: int, repeats: int
) -> tuple[float, float, float]:
    """Median GB/s of ours and of raw, and the median of their paired ratios.

    Each run returns the seconds it measured. One warm-up run each, then the two alternate
    (and swap order every repeat), so load from other processes on this shared machine falls
    on both sides alike.
    """
    ours()
    raw()
    ours_rates: list[float] = []
    raw_rates: list[float] = []
    for i in range(repeats):
        pair = [(ours, ours_rates), (raw, raw_rates)]
        for run, collected in pair if i % 2 == 0 else pair[::-1]:
            collected.append(nbytes / run() / 1e9)
    ratios = [o / r for o, r in zip(ours_rates, raw_rates, strict=True)]
    return (
        statistics.median(ours_rates),
        statistics.median(raw_rates),
        statistics.median(ratios),
    )


def drop_page_cache() -> bool:
    """Flush and drop the page cache (root only; some containers refuse even root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def aligned(nbytes: int) -> memoryview:
    """Page-aligned memory, as O_DIRECT wants."""
    return memoryview(mmap.mmap(-1, nbytes))


# -- host -------------------------------------------------------------------------------------


def bench_host(chunk_bytes: int, count: int, repeats: int) -> list[dict]:
    source = torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8)
    out = torch.empty(chunk_bytes, dtype=torch.uint8)
    tier = HostTier(count * chunk_bytes, slot_bytes=BLOCK_TOKENS * BYTES_PER_TOKEN)
    raw_pool = torch.empty(count * chunk_bytes, dtype=torch.uint8).zero_()
    raw_slices = [raw_pool[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(count)]
    payload = Payload.of(source)
    keys = [i.to_bytes(8, "big") for i in range(count)]
    total = count * chunk_bytes

    def save() -> float:
        return clock(lambda key: tier.put(key, payload), keys)

    def load() -> float:
        return clock(lambda key: tier.get(key, out=out), keys)

    def raw_save() -> float:
        return clock(lambda dest: dest.copy_(source), raw_slices)

    def raw_load() -> float:
        return clock(out.copy_, raw_slices)

    rows = [
        row("host", "save", chunk_bytes, *rates(save, raw_save, total, repeats)),
        row("host", "load", chunk_bytes, *rates(load, raw_load, total, repeats)),
    ]
    assert torch.equal(tier.get(keys[-1], out=out).data, source)
    tier.close()
    return rows


# -- disk -------------------------------------------------------------------------------------


def bench_disk(
    directory: Path,
    chunk_bytes: int,
    count: int,
    repeats: int,
    direct: bool,
    can_drop: bool,
    aligned_memory: bool = False,
) -> list[dict]:
    """aligned_memory: give the tier a page-aligned payload and output buffer (O_DIRECT)."""
    source = torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8)
    out = torch.empty(chunk_bytes, dtype=torch.uint8)
    if aligned_memory:
        source = aligned_bytes(chunk_bytes, mmap.PAGESIZE).copy_(source)
        out = aligned_bytes(chunk_bytes, mmap.PAGESIZE)
    payload = Payload.of(source)
    keys = [i.to_bytes(8, "big") for i in range(count)]
    total = count * chunk_bytes
    flags = os.O_DIRECT if direct else 0
    # The raw side gets the best case: O_DIRECT from and into aligned buffers made once, and
    # buffered I/O straight from the source and into the output tensor.
    raw_source = aligned(chunk_bytes) if direct else memoryview(source.numpy())
    if direct:
        raw_source[:] = memoryview(source.numpy())
    raw_dest = aligned(chunk_bytes) if direct else memoryview(out.numpy())
    raw_path = directory / "raw.bin"
    tier_dir = directory / "tier"
    tier: DiskTier | None = None

    def write() -> float:
        nonlocal tier
        if tier is not None:
            tier.close()  # removes its files: every repeat writes fresh files, like the raw side
        # A deployment-sized budget, so segments are their full 256 MiB as in service
        # (a small budget makes small segments; the budget is never reached here).
        tier = DiskTier(tier_dir, 64 << 30, direct=direct)
        return clock(lambda key: tier.put(key, payload), keys)

    def raw_write() -> float:
        raw_path.unlink(missing_ok=True)
        fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | flags, 0o600)
        try:
            return clock(lambda i: os.pwrite(fd, raw_source, i * chunk_bytes), range(count))
        finally:
            os.close(fd)

    def read(cold: bool) -> Callable[[], float]:
        def run() -> float:
            if cold:
                drop_page_cache()
            return clock(lambda key: tier.get(key, out=out), keys)

        return run

    def raw_read(cold: bool) -> Callable[[], float]:
        def run() -> float:
            if cold:
                drop_page_cache()
            fd = os.open(raw_path, os.O_RDONLY | flags)
            try:
                return clock(lambda i: os.preadv(fd, [raw_dest], i * chunk_bytes), range(count))
            finally:
                os.close(fd)

        return run

    memory = ", aligned memory" if aligned_memory else ", torch memory"
    if direct:
        reads = [("read O_DIRECT" + memory, False)]
    else:
        # Hot: what the writes left in the page cache. Cold: from the device.
        reads = [("read page cache (hot)", False)]
        if can_drop:
            reads.append(("read cold (cache dropped)", True))
    rows = [
        row(
            "disk",
            "write O_DIRECT" + memory if direct else "write page cache",
            chunk_bytes,
            *rates(write, raw_write, total, repeats),
        )
    ]
    for name, cold in reads:
        rows.append(
            row("disk", name, chunk_bytes, *rates(read(cold), raw_read(cold), total, repeats))
        )
    assert tier is not None
    assert torch.equal(tier.get(keys[-1], out=out).data, source)
    assert tier.stats.errors == 0
    tier.close()
    raw_path.unlink(missing_ok=True)
    return rows


def bench_write_amplification(directory: Path, chunk_bytes: int, direct: bool) -> dict:
    """Bytes written to files / payload bytes, with GC running (4x the budget is written)."""
    results = {}
    capacity = 64 * chunk_bytes
    # The last workload is the worst case for padding: a body one byte past a page multiple
    # costs a whole page more (and, under O_DIRECT, the page-sized head costs another).
    for workload, delete_share, nbytes in (
        ("sequential overflow", 0.0, chunk_bytes),
        ("churn 60% deleted", 0.6, chunk_bytes),
        ("sequential, chunk + 1 B", 0.0, chunk_bytes + 1),
    ):
        payload = Payload.of(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        tier_dir = directory / "wa"
        shutil.rmtree(tier_dir, ignore_errors=True)
        tier = DiskTier(tier_dir, capacity, segment_bytes=8 * chunk_bytes, direct=direct)
        rng = random.Random(0)
        for i in range(4 * 64):
            key = i.to_bytes(8, "big")
            tier.put(key, payload)
            if rng.random() < delete_share:
                tier.delete(key)
        results[workload] = {
            "write_amplification": round(tier.write_amplification, 4),
            "device_bytes": tier.device_bytes_written,
            "payload_bytes": tier.stats.bytes_written,
            "evicted": tier.stats.evicted,
        }
        tier.close()
    return results


def bench_rewrite_vs_append(directory: Path, chunk_bytes: int, count: int, direct: bool) -> dict:
    """Rewriting records in place (random slots of a full file) vs appending them, fsync'd."""
    buf = aligned(chunk_bytes)
    buf[:] = os.urandom(chunk_bytes)
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    path = directory / "slots.bin"
    fd = os.open(path, flags, 0o600)
    try:
        for i in range(count):
            os.pwrite(fd, buf, i * chunk_bytes)
        os.fsync(fd)
        order = list(range(count))
        random.Random(0).shuffle(order)
        start = time.perf_counter()
        for i in order:
            os.pwrite(fd, buf, i * chunk_bytes)
        os.fsync(fd)
        in_place = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()
    fd = os.open(path, flags, 0o600)
    try:
        start = time.perf_counter()
        for i in range(count):
            os.pwrite(fd, buf, i * chunk_bytes)
        os.fsync(fd)
        append = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()
    return {
        "chunk_bytes": chunk_bytes,
        "records": count,
        "o_direct": direct,
        "in_place_s": round(in_place, 4),
        "append_s": round(append, 4),
        "in_place_over_append": round(in_place / append, 3),
    }


# -- redis ------------------------------------------------------------------------------------


def bench_redis(url: str, chunk_bytes: int, count: int, repeats: int) -> list[dict]:
    """Against two plain clients: redis-py's default (hiredis packs every command into a fresh
    buffer) and one with its pure-Python packer (what RedisTier uses); the faster one is raw."""
    source = torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8)
    out = torch.empty(chunk_bytes, dtype=torch.uint8)
    payload = Payload.of(source)
    value = bytes(source.numpy())
    keys = [i.to_bytes(8, "big") for i in range(count)]
    raw_keys = [b"raw:" + key for key in keys]
    total = count * chunk_bytes
    clients = {
        "default client": redis.Redis.from_url(url),
        "python-packer client": redis.Redis.from_url(
            url, command_packer=PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
        ),
    }
    clients["default client"].flushall()
    tier = RedisTier(url, 4 * count * (chunk_bytes + 4096), ttl_s=None, timeout_s=5.0)

    def put() -> float:
        return clock(lambda key: tier.put(key, payload), keys)

    def get() -> float:
        return clock(lambda key: tier.get(key, out=out), keys)

    def raw_op(op: str, client: redis.Redis) -> Callable[[], float]:
        if op == "put":
            return lambda: clock(lambda key: client.set(key, value), raw_keys)
        return lambda: clock(client.get, raw_keys)

    rows = []
    for op, ours in (("put", put), ("get", get)):
        best: tuple[float, float, float] | None = None
        for name, client in clients.items():
            measured = rates(ours, raw_op(op, client), total, repeats)
            print(f"      redis {op} vs {name}: {measured[1]:.2f} GB/s", file=sys.stderr)
            if best is None or measured[1] > best[1]:
                best = measured
        assert best is not None
        rows.append(row("redis", op, chunk_bytes, *best))
    assert torch.equal(tier.get(keys[-1], out=out).data, source)
    assert tier.stats.errors == 0
    tier.close()
    for client in clients.values():
        client.flushall()
        client.close()
    return rows


# -- report -----------------------------------------------------------------------------------


def row(tier: str, op: str, chunk_bytes: int, ours: float, raw: float, ratio: float) -> dict:
    tokens = chunk_bytes // BYTES_PER_TOKEN
    target = TARGETS[tier] if tokens >= 256 else None
    return {
        "tier": tier,
        "op": op,
        "chunk_tokens": tokens,
        "chunk_bytes": chunk_bytes,
        "ours_gbps": round(ours, 3),
        "raw_gbps": round(raw, 3),
        "ratio": round(ratio, 3),
        "target": target,
        "meets_target": None if target is None else ratio >= target,
    }


def print_table(rows: list[dict]) -> None:
    header = f"{'tier':6} {'operation':32} {'tokens':>6} {'MiB':>6} {'ours GB/s':>10} "
    header += f"{'raw GB/s':>9} {'ours/raw':>8}  target"
    print(header)
    print("-" * len(header))
    for r in rows:
        target = (
            ""
            if r["target"] is None
            else f">={r['target']:.0%} {'ok' if r['meets_target'] else 'MISS'}"
        )
        print(
            f"{r['tier']:6} {r['op']:32} {r['chunk_tokens']:>6} {r['chunk_bytes'] / 2**20:>6.2f} "
            f"{r['ours_gbps']:>10.2f} {r['raw_gbps']:>9.2f} {r['ratio']:>8.0%}  {target}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/tiers_bench.json"))
    parser.add_argument("--quick", action="store_true", help="fewer sizes, less data, 3 repeats")
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=None, help="chunk sizes in tokens to measure"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where disk files go (a real disk)")
    parser.add_argument("--redis-url", default=None, help="use this server instead of starting one")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads for all copies (default: torch's); 1 avoids multi-ms "
        "stalls of parallel copies when other processes hold the CPUs",
    )
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    chunk_tokens = [16, 64, 256, 1024] if args.quick else [16, 32, 64, 128, 256, 512, 1024]
    chunk_tokens = args.tokens or chunk_tokens
    volume = (128 if args.quick else 256) << 20  # bytes moved per measurement
    repeats = 3 if args.quick else 7
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.dir))
    load_before = os.getloadavg()
    can_drop = drop_page_cache()
    probe = DiskTier(work / "probe", 1 << 20, direct=True)
    direct_ok = probe.direct
    probe.close()
    server = None
    redis_url = args.redis_url
    if redis_url is None and shutil.which("redis-server"):
        server, redis_url = start_redis(work)

    rows: list[dict] = []
    try:
        for tokens in chunk_tokens:
            chunk_bytes = tokens * BYTES_PER_TOKEN
            count = max(8, volume // chunk_bytes)
            print(f"... {tokens} tokens x {count} chunks", file=sys.stderr, flush=True)
            rows += bench_host(chunk_bytes, count, repeats)
            rows += bench_disk(work, chunk_bytes, count, repeats, direct=False, can_drop=can_drop)
            if direct_ok:
                for aligned_memory in (True, False):
                    rows += bench_disk(
                        work, chunk_bytes, count, repeats, True, False, aligned_memory
                    )
            if redis_url:
                redis_count = max(8, count // 4)  # the slowest tier: a quarter of the data
                rows += bench_redis(redis_url, chunk_bytes, redis_count, repeats)
        wa_bytes = 256 * BYTES_PER_TOKEN
        write_amplification = {
            "chunk_tokens": 256,
            "buffered": bench_write_amplification(work, wa_bytes, direct=False),
        }
        if direct_ok:
            write_amplification["o_direct"] = bench_write_amplification(work, wa_bytes, True)
        rewrite = bench_rewrite_vs_append(work, 256 * BYTES_PER_TOKEN, 64, direct=direct_ok)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        shutil.rmtree(work, ignore_errors=True)

    rows.sort(key=lambda r: (r["tier"], r["op"], r["chunk_tokens"]))
    print_table(rows)
    print("\nwrite amplification (bytes written to files / payload bytes), 256-token chunks:")
    for mode, workloads in write_amplification.items():
        if mode == "chunk_tokens":
            continue
        for name, result in workloads.items():
            print(f"  {mode:9} {name:24} {result['write_amplification']:.4f}")
    print(
        f"\nin-place rewrite vs append ({rewrite['records']} x {rewrite['chunk_bytes']} B, "
        f"fsync, o_direct={rewrite['o_direct']}): {rewrite['in_place_over_append']:.2f}x"
    )
    report = {
        "command": [Path(sys.executable).name, *sys.argv],
        "bytes_per_token": BYTES_PER_TOKEN,
        "repeats": repeats,
        "bytes_per_measurement": volume,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            # Other processes' load: ratios are paired runs, absolute GB/s are not comparable
            # across runs on a shared machine.
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "disk": {
            "directory_parent": str(work.parent),
            "o_direct_available": direct_ok,
            "page_cache_dropped_for_cold_reads": can_drop,
            "buffered_writes": "to the page cache, not fsync'd (the tier does not fsync)",
        },
        "redis": {"url": redis_url, "started_here": server is not None},
        "results": rows,
        "write_amplification": write_amplification,
        "rewrite_vs_append": rewrite,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
