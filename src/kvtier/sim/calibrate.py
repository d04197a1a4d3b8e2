"""Time the real engine on this machine: what `kvtier calibrate` fits a hardware profile to.

Every timed step is a real `Engine.step()` (scheduler, runner, paged attention, sampler,
detokenizer), so the fitted overheads hold what the engine really spends around the model:

- **prefill (t, p)**: a request whose first `p` tokens are in the prefix cache and `t` more
  are new; the step that admits it prefills those `t` tokens at positions `[p, p + t)` in one
  chunk and samples its one output token.
- **decode (B, L)**: `B` running requests with `L` tokens of context each; every step gives
  each one token.

Getting a request to its context is not timed and does not run the model: a stand-in runner
returns zero logits for those set-up steps, so the scheduler allocates and registers the
blocks as usual but their KV is whatever the pool holds (a step's time does not depend on the
values it reads). So a batch of 32 sequences of 1,024 tokens costs no 32K-token prefill, and
each sequence still reads its own blocks (sharing a prefix instead would let the caches
serve the reads and understate the memory term).

Each point is timed `repeats` times after one untimed warm-up; the median is kept. Links: a
chunk-sized and a block-sized payload are put into and read back from the engine's own host
tier and a disk tier in a temporary folder (`kvtier.tiers`), and `latency + bytes / bandwidth`
is solved from the two sizes' medians.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.errors import KvtierError
from kvtier.sim.fit import Measurements

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine
    from kvtier.tiers.base import TierBackend

_LOW_TOKEN = 256  # random prompt tokens avoid the special tokens at the start of the vocabulary


@dataclass(frozen=True)
class CalibrationPlan:
    prefill: Sequence[tuple[int, int]]  # (new tokens, cached tokens before them)
    decode: Sequence[tuple[int, int]]  # (batch, context tokens per sequence)
    repeats: int = 3
    link_repeats: int = 5

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.link_repeats < 1:
            raise KvtierError("a calibration needs at least one repeat per point")
        for tokens, position in self.prefill:
            if tokens < 1 or position < 0 or position % 16:
                raise KvtierError(
                    f"prefill point ({tokens}, {position}): tokens >= 1 and a cached prefix "
                    "of whole 16-token blocks"
                )
        if any(batch < 1 or context < 1 for batch, context in self.decode):
            raise KvtierError("decode points need a batch and a context of at least 1")


# Shapes the demo and quick workloads run (prompts under 1K tokens, chunks of at most 512,
# a few sequences at once) and the batch sizes the issue asks for.
QUICK = CalibrationPlan(
    prefill=((32, 0), (128, 0), (512, 0), (128, 512), (256, 1024)),
    decode=((1, 128), (4, 128), (16, 128), (32, 128), (1, 1024), (8, 1024)),
    repeats=3,
)
FULL = CalibrationPlan(
    prefill=(
        *((t, 0) for t in (16, 64, 128, 256, 512, 1024)),
        *((64, 512), (256, 512), (128, 1024), (512, 1024), (256, 2048)),
    ),
    decode=tuple((b, c) for c in (128, 512, 2048) for b in (1, 2, 4, 8, 16, 32)),
    repeats=5,
)


@dataclass(frozen=True)
class LinkTiming:
    """Median seconds to put (write) and get (read) a payload of `nbytes` into a tier."""

    nbytes: int
    write_s: float
    read_s: float


@dataclass
class Calibration:
    measurements: Measurements
    links: dict[str, list[LinkTiming]] = field(default_factory=dict)  # tier -> sizes
    wall_s: float = 0.0


def measure_engine(
    engine: Engine, plan: CalibrationPlan, progress: Callable[[str], None] = lambda _: None
) -> Measurements:
    """Median step times of the plan's prefill and decode points on `engine`, which must have
    a pool and a token budget big enough for them (`engine_settings`) and no tiers."""
    if engine.connector is not None:
        raise KvtierError("calibrate an engine without tiers: their copies are timed apart")
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(_LOW_TOKEN, vocab) for _ in range(n)]

    prefill = []
    for new, cached in plan.prefill:
        times = [
            _time_prefill(engine, tokens(cached), tokens(new)) for _ in range(plan.repeats + 1)
        ]
        prefill.append((new, cached, statistics.median(times[1:])))  # the first: a warm-up
        progress(f"prefill {new:>5} tokens after {cached:>5}: {prefill[-1][2] * 1e3:8.1f} ms")
    decode = []
    for batch, context in plan.decode:
        seconds, mean_context = _time_decode(engine, batch, context, plan.repeats, tokens)
        decode.append((batch, mean_context, seconds))
        progress(f"decode  batch {batch:>3} at {context:>5} tokens: {seconds * 1e3:8.1f} ms")
    return Measurements(prefill=prefill, decode=decode)


def _time_prefill(engine: Engine, prefix: list[int], new: list[int]) -> float:
    from kvtier.engine.sampling import SamplingParams

    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    if prefix:  # put the prefix's blocks in the prefix cache without running the model
        with _skipped_forward(engine):
            engine.generate([prefix], once)
    engine.add_request(prefix + new, once)
    started = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - started
    if not (outputs and outputs[0].finished) or (outputs[0].num_cached_tokens or 0) < len(prefix):
        raise KvtierError(
            f"calibration step did not prefill {len(new)} tokens after {len(prefix)} cached in "
            "one step; raise the token budget or the pool"
        )
    engine.reset_prefix_cache()
    return seconds


def _time_decode(
    engine: Engine, batch: int, context: int, repeats: int, tokens: Callable[[int], list[int]]
) -> tuple[float, int]:
    """Median seconds of a decode step of `batch` sequences, and their mean context then."""
    from kvtier.engine.sampling import SamplingParams

    budget = engine.config.max_num_batched_tokens
    params = SamplingParams(
        temperature=0, max_tokens=_decode_tokens(batch, context, repeats, budget), ignore_eos=True
    )
    ids = [engine.add_request(tokens(context), params) for _ in range(batch)]
    running = engine.scheduler.running
    with _skipped_forward(engine):  # admit and "prefill" them: the KV's values do not matter
        while len(running) < batch or any(_prefilling(r) for r in running):
            engine.step()
    times, contexts = [], []
    for _ in range(repeats + 1):  # the first step is the warm-up
        contexts.append(sum(r.num_computed_tokens for r in running) / batch)
        started = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - started)
        if len(outputs) != batch or any(len(o.new_token_ids) != 1 for o in outputs):
            raise KvtierError(f"calibration decode step did not run all {batch} sequences")
    for request_id in ids:
        engine.abort(request_id)
    engine.reset_prefix_cache()
    return statistics.median(times[1:]), round(statistics.median(contexts[1:]))


class _skipped_forward:
    """Replace the engine's runner for the set-up steps: zero logits for every request that
    samples, no model forward (the scheduler, pool and sampler still run as usual)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.runner = engine.runner

    def execute(self, batch):
        import torch

        from kvtier.engine.runner import StepResult

        sampled = [r for r, n in batch if r.num_computed_tokens + n == r.num_tokens]
        vocab = self.engine.model_config.vocab_size
        return StepResult(sampled=sampled, logits=torch.zeros(len(sampled), vocab))

    def __enter__(self) -> None:
        self.engine.runner = self  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        self.engine.runner = self.runner


def _decode_tokens(batch: int, context: int, repeats: int, budget: int) -> int:
    """Output tokens a decode point's requests may need: the first admitted decode while the
    others are set up (one token a step), then the timed steps."""
    return -(-batch * context // budget) + batch + repeats + 4


def engine_settings(plan: CalibrationPlan, bytes_per_token: int) -> dict[str, int]:
    """Pool, token budget and concurrency that hold every point of the plan at once."""
    budget = max(512, max((t for t, _ in plan.prefill), default=0))
    prefill_tokens = max((t + p for t, p in plan.prefill), default=0)
    decode_tokens = max(
        (b * (c + _decode_tokens(b, c, plan.repeats, budget) + 16) for b, c in plan.decode),
        default=0,
    )
    # a prefix being cached and its request share blocks; 2x covers both and the warm-up
    tokens = 2 * max(prefill_tokens, decode_tokens) + 1024
    return {
        "kv_cache_bytes": tokens * bytes_per_token,
        "max_num_batched_tokens": budget,
        "max_num_seqs": max(8, max((b for b, _ in plan.decode), default=0)),
    }


# -- links --------------------------------------------------------------------------------


def measure_links(
    sizes: Sequence[int], repeats: int, block_bytes: int
) -> dict[str, list[LinkTiming]]:
    """Put and get timings of payloads of `sizes` bytes on the host tier (as the engine builds
    it: one slot per device block) and on a disk tier in a temporary folder."""
    from kvtier.tiers.disk import DiskTier
    from kvtier.tiers.host import HostTier

    capacity = (repeats + 2) * sum(sizes) * 2 + 16 * block_bytes
    result = {}
    result["host"] = _time_tier(HostTier(capacity, slot_bytes=block_bytes), sizes, repeats)
    with tempfile.TemporaryDirectory(prefix="kvtier-calibrate-") as folder:
        disk = DiskTier(folder, max(capacity, 64 << 20))
        try:
            result["disk"] = _time_tier(disk, sizes, repeats)
        finally:
            disk.close()
    return result


def _time_tier(tier: TierBackend, sizes: Sequence[int], repeats: int) -> list[LinkTiming]:
    import torch

    from kvtier.tiers.payload import Payload

    timings = []
    for size in sizes:
        data = torch.randint(0, 256, (size,), dtype=torch.uint8)
        out = torch.empty(size, dtype=torch.uint8)
        writes, reads = [], []
        for i in range(repeats + 1):  # the first is the warm-up
            key = f"calibrate-{size}-{i}".encode()
            started = time.perf_counter()
            if not tier.put(key, Payload.of(data)):
                raise KvtierError(f"the {tier.name} tier refused a {size}-byte calibration put")
            writes.append(time.perf_counter() - started)
            started = time.perf_counter()
            if tier.get(key, out=out) is None:
                raise KvtierError(f"the {tier.name} tier lost a {size}-byte calibration payload")
            reads.append(time.perf_counter() - started)
            tier.delete(key)
        write_s, read_s = statistics.median(writes[1:]), statistics.median(reads[1:])
        timings.append(LinkTiming(size, write_s, read_s))
    return timings


def fit_link(timings: Sequence[LinkTiming], write: bool) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of `seconds = latency + bytes / bandwidth` through the
    smallest and the largest size's medians (latency floored at 0)."""
    small, large = min(timings, key=lambda t: t.nbytes), max(timings, key=lambda t: t.nbytes)
    pick = (lambda t: t.write_s) if write else (lambda t: t.read_s)
    if large.nbytes == small.nbytes:
        return large.nbytes / pick(large), 0.0
    per_byte = (pick(large) - pick(small)) / (large.nbytes - small.nbytes)
    if per_byte <= 0:  # noise swamped the size: all latency; bandwidth from the large copy
        return large.nbytes / pick(large), 0.0
    latency = max(0.0, pick(small) - small.nbytes * per_byte)
    return 1 / per_byte, latency


def _prefilling(request) -> bool:
    return request.num_tokens - request.num_computed_tokens > 1
