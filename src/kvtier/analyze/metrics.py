"""What a workload implies for a KV cache.

Definitions (docs/workloads.md has the long form):

- A turn's *gap* is the user's idle time before it: its arrival minus the previous turn's
  estimated end, `end = arrival + output_tokens / decode_tok_s` (prefill time is not counted;
  with `decode_tok_s = inf` gaps run arrival to arrival). A turn that arrives before that
  estimate has gap 0.
- Turn kinds: *new* = a session's first turn; *continuing* = gap <= `resume_after_s` (the KV is
  still hot); *resumed* = a longer gap (the KV may have been moved down or dropped).
- Prefix reuse assumes an unbounded cache in arrival order: a request reuses its leading
  blocks that any earlier request produced; *cross-session* reuse is of blocks another session
  produced first (system prompts, shared documents). A *shared prefix* is a leading run of
  blocks used by two or more sessions.
- KV bytes come from the model geometry (`kvtier.plan`). A session is *idle* from a turn's end
  to its next turn's arrival and holds that turn's prompt + answer; sessions that never return
  are not counted as idle (a policy cannot know that, so this is what retention could at best
  turn into hits). *Keep everything* is every session's largest context held at once. Prefix
  sharing is not deducted from per-session sizes.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from kvtier.plan.geometry import ModelGeometry
from kvtier.workload.model import Request, Workload, flatten

# gaps at which the report gives the share of returns that came back in time
RETURN_WITHIN_S = (10.0, 30.0, 60.0, 300.0, 600.0, 1800.0)


@dataclass(frozen=True)
class Summary:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: np.ndarray) -> Summary:
        if len(values) == 0:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        p50, p90, p99 = (float(p) for p in np.percentile(values, [50, 90, 99]))
        return cls(len(values), float(np.mean(values)), p50, p90, p99, float(np.max(values)))


@dataclass(frozen=True)
class TurnKinds:
    new: int
    continuing: int
    resumed: int

    @property
    def total(self) -> int:
        return self.new + self.continuing + self.resumed

    def share(self, count: int) -> float:
        return count / self.total if self.total else 0.0


@dataclass(frozen=True)
class GrowthRow:
    turn: int  # 1-based turn index within the session
    requests: int
    mean_prompt_tokens: float
    mean_added_tokens: float  # prompt growth since the session's previous turn (0 on turn 1)


@dataclass(frozen=True)
class PrefixSharing:
    prompt_tokens: int  # all requests' prompts
    reused_tokens: int  # leading blocks an unbounded cache already held
    reused_within_session_tokens: int
    reused_cross_session_tokens: int
    shared_prefix_tokens: int  # leading blocks used by 2+ sessions, summed over requests
    distinct_shared_prefixes: int  # distinct longest shared prefixes of first turns
    top_shared_prefixes: list[tuple[int, int]]  # (tokens, sessions), most sessions first
    reused_block_tokens: int  # distinct blocks hit at least once (what a cache must hold)
    shared_block_tokens: int  # distinct blocks used by 2+ sessions


@dataclass(frozen=True)
class KvFootprint:
    model: str
    kv_dtype: str
    bytes_per_token: float
    longest_context_tokens: int
    longest_context_bytes: int
    idle_peak_bytes: float
    idle_mean_bytes: float
    idle_peak_sessions: int
    active_peak_bytes: float
    keep_all_bytes: float
    reused_prefix_bytes: float
    shared_prefix_bytes: float


@dataclass(frozen=True)
class Analysis:
    source: str
    notes: list[str]
    errors: list[str]
    length_scale: float
    resume_after_s: float
    decode_tok_s: float
    requests: int
    sessions: int
    start_s: float  # first arrival
    duration_s: float  # to the last turn's estimated end
    kinds: TurnKinds
    gaps_s: np.ndarray  # sorted idle gaps of all non-first turns
    turns_per_session: np.ndarray
    prompt_tokens: Summary
    output_tokens: Summary
    growth: list[GrowthRow]
    prefix: PrefixSharing
    kv: KvFootprint
    idle_times_s: np.ndarray  # step function: idle KV bytes from each time on
    idle_bytes: np.ndarray

    @property
    def at_zero_gaps(self) -> int:
        """Returning turns that arrived before the previous answer's estimated end."""
        return int(np.searchsorted(self.gaps_s, 0.0, side="right"))

    def returned_within(self, seconds: float) -> float:
        """Share of returning turns whose gap is at most `seconds`."""
        if len(self.gaps_s) == 0:
            return 0.0
        return float(np.searchsorted(self.gaps_s, seconds, side="right") / len(self.gaps_s))


def analyze(
    workload: Workload,
    geometry: ModelGeometry,
    *,
    kv_dtype: str = "bf16",
    resume_after_s: float = 30.0,
    decode_tok_s: float = 50.0,
) -> Analysis:
    if resume_after_s < 0:
        raise ValueError(f"resume_after_s must be >= 0, not {resume_after_s}")
    if not decode_tok_s > 0:
        raise ValueError(f"decode_tok_s must be > 0, not {decode_tok_s}")
    requests = flatten(workload)
    if not requests:
        raise ValueError(f"{workload.source} holds no request")
    sessions: defaultdict[str, list[Request]] = defaultdict(list)
    for request in requests:
        sessions[request.session_id].append(request)
    for turns in sessions.values():
        turns.sort(key=lambda r: r.turn_index)

    def end(request: Request) -> float:
        return request.arrival_s + request.output_tokens / decode_tok_s

    gaps, idle, active = [], [], []
    for turns in sessions.values():
        for before, after in pairwise(turns):
            gaps.append(max(0.0, after.arrival_s - end(before)))
            held = geometry.kv_bytes(before.prompt_tokens + before.output_tokens, kv_dtype)
            idle.append((end(before), after.arrival_s, held))
        for request in turns:
            held = geometry.kv_bytes(request.prompt_tokens + request.output_tokens, kv_dtype)
            active.append((request.arrival_s, end(request), held))
    gaps_s = np.sort(np.array(gaps, dtype=float))
    continuing = int(np.searchsorted(gaps_s, resume_after_s, side="right"))
    start = min(r.arrival_s for r in requests)
    finish = max(end(r) for r in requests)
    idle_times, idle_bytes, idle_peak, idle_mean = _timeline(idle, start, finish)
    _, _, idle_peak_sessions, _ = _timeline([(a, b, 1) for a, b, _ in idle], start, finish)
    _, _, active_peak, _ = _timeline(active, start, finish)

    longest = max(r.prompt_tokens + r.output_tokens for r in requests)
    bytes_per_token = geometry.bytes_per_token(kv_dtype)
    prefix = prefix_sharing(requests)
    kv = KvFootprint(
        model=geometry.name,
        kv_dtype=kv_dtype,
        bytes_per_token=bytes_per_token,
        longest_context_tokens=longest,
        longest_context_bytes=geometry.kv_bytes(longest, kv_dtype),
        idle_peak_bytes=idle_peak,
        idle_mean_bytes=idle_mean,
        idle_peak_sessions=int(idle_peak_sessions),
        active_peak_bytes=active_peak,
        keep_all_bytes=float(
            sum(
                geometry.kv_bytes(max(r.prompt_tokens + r.output_tokens for r in turns), kv_dtype)
                for turns in sessions.values()
            )
        ),
        reused_prefix_bytes=prefix.reused_block_tokens * bytes_per_token,
        shared_prefix_bytes=prefix.shared_block_tokens * bytes_per_token,
    )
    return Analysis(
        source=workload.source,
        notes=list(workload.notes),
        errors=list(workload.errors),
        length_scale=workload.length_scale,
        resume_after_s=resume_after_s,
        decode_tok_s=decode_tok_s,
        requests=len(requests),
        sessions=len(sessions),
        start_s=start,
        duration_s=finish - start,
        kinds=TurnKinds(len(sessions), continuing, len(gaps_s) - continuing),
        gaps_s=gaps_s,
        turns_per_session=np.array([len(turns) for turns in sessions.values()]),
        prompt_tokens=Summary.of(np.array([r.prompt_tokens for r in requests], dtype=float)),
        output_tokens=Summary.of(np.array([r.output_tokens for r in requests], dtype=float)),
        growth=_growth(sessions),
        prefix=prefix,
        kv=kv,
        idle_times_s=idle_times,
        idle_bytes=idle_bytes,
    )


def prefix_sharing(requests: list[Request]) -> PrefixSharing:
    """Prefix reuse and cross-session sharing of requests in arrival order (see module doc)."""
    first_session: dict[int, str] = {}
    block_tokens: dict[int, float] = {}
    multi: set[int] = set()
    hit: set[int] = set()
    reused = within = 0.0
    for request in requests:
        leading = True
        for i, block in enumerate(request.hash_ids):
            owner = first_session.setdefault(block, request.session_id)
            tokens = _block_tokens(request, i)
            if owner != request.session_id:
                multi.add(block)
            if leading and block in block_tokens:
                hit.add(block)
                reused += tokens
                within += tokens if owner == request.session_id else 0
            else:
                leading = False
                block_tokens.setdefault(block, tokens)
    shared = 0.0
    longest_shared: dict[str, tuple[int, float]] = {}  # session -> (block, tokens) of 1st turn
    for request in requests:
        run = 0.0
        for i, block in enumerate(request.hash_ids):
            if block not in multi:
                break
            run += _block_tokens(request, i)
            if request.turn_index == 0:
                longest_shared[request.session_id] = (block, run)
        shared += run
    sessions_per_prefix = Counter(block for block, _ in longest_shared.values())
    run_tokens = {block: tokens for block, tokens in longest_shared.values()}
    top = [(round(run_tokens[block]), count) for block, count in sessions_per_prefix.most_common(5)]
    return PrefixSharing(
        prompt_tokens=sum(r.prompt_tokens for r in requests),
        reused_tokens=round(reused),
        reused_within_session_tokens=round(within),
        reused_cross_session_tokens=round(reused - within),
        shared_prefix_tokens=round(shared),
        distinct_shared_prefixes=len(sessions_per_prefix),
        top_shared_prefixes=top,
        reused_block_tokens=round(sum(block_tokens[block] for block in hit)),
        shared_block_tokens=round(sum(block_tokens[block] for block in multi)),
    )


def _block_tokens(request: Request, index: int) -> float:
    """Tokens of block `index` of a prompt (the last block may be partial)."""
    return min(max(request.prompt_tokens - index * request.block_tokens, 0.0), request.block_tokens)


def _timeline(
    intervals: list[tuple[float, float, float]], start: float, finish: float
) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Sum of interval values over time: (times, level from each time on, peak, time mean)."""
    events = sorted(
        [(a, value) for a, b, value in intervals if b > a]
        + [(b, -value) for a, b, value in intervals if b > a]
    )  # at equal times removals sort first, so a hand-over does not look like a peak
    if not events:
        return np.array([start]), np.array([0.0]), 0.0, 0.0
    times = np.array([t for t, _ in events])
    levels = np.cumsum([delta for _, delta in events])
    widths = np.diff(np.append(times, finish))
    span = finish - start
    mean = float(np.sum(levels * widths) / span) if span > 0 else 0.0
    return times, levels, float(levels.max()), mean


def _growth(sessions: dict[str, list[Request]]) -> list[GrowthRow]:
    prompts: defaultdict[int, list[int]] = defaultdict(list)
    added: defaultdict[int, list[int]] = defaultdict(list)
    for turns in sessions.values():
        previous = 0
        for request in turns:
            prompts[request.turn_index].append(request.prompt_tokens)
            added[request.turn_index].append(request.prompt_tokens - previous if previous else 0)
            previous = request.prompt_tokens
    return [
        GrowthRow(turn + 1, len(values), float(np.mean(values)), float(np.mean(added[turn])))
        for turn, values in sorted(prompts.items())
    ]
