"""Replay a multi-turn workload through a real, in-process Engine, in trace time.

- Every turn of the workload is one request, sent at its trace arrival time. When the
  workload knows the user's think time (`think_s`), a session's next turn is sent that long
  after the previous answer really finished (closed loop: a slow policy delays the user);
  otherwise at its trace time.
- The driver steps the engine itself. When nothing is in flight, the `ReplayClock` jumps to
  the next arrival, so idle stretches (minutes between turns, hours between sessions) take
  no wall time while everything that runs is timed for real. The engine, its session
  tracker and its retention policy see this trace time through the clock.
- A turn's session hints go with its request; a turn the workload says ended in a tool call
  is marked so in the engine when it finishes (`Engine.mark_turn_end`), as a server marks a
  reply its parser read as a call. The next turn follows after the tool's run time (`think_s`).
- Per request it records, on that clock, the send time, first-scheduled time, every token's
  time, the turn kind the engine's `SessionTracker` gave it, and where the prompt's history
  came from (`restored_tokens`) into `kvtier.results` records. A request the engine refuses
  or ends with an error is counted as failed; the replay goes on.

Prompts: text workloads are rendered with the model's chat template (history included, as
chat apps resend it). Length-only traces (mooncake, bailian) get synthetic token ids derived
from their prefix block ids, so equal block ids are equal tokens and prefix sharing in the
trace is prefix sharing in the engine.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.cache.chunks import common_prefix
from kvtier.clock import ReplayClock
from kvtier.errors import KvtierError
from kvtier.results.records import (
    STORE_TIERS,
    OccupancySample,
    RequestRecord,
    RunRecords,
    TierTraffic,
)

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine, RequestOutput
    from kvtier.policy.metrics import Calibration
    from kvtier.workload.model import Request

STORED_SOURCES = ("device", *STORE_TIERS)
_SYNTHETIC_LOW_ID = 256  # synthetic prompt tokens avoid the special tokens at the start


class BenchClock(ReplayClock):
    """The replay clock, restartable: the engine is built on it (its session tracker and
    policy read it), warmed up, then the clock restarts at trace time 0."""

    def restart(self) -> None:
        ReplayClock.__init__(self, 0.0, self._timer, self._sleep)


def warm_up(engine: Engine, prompt_tokens: int = 64) -> None:
    """Run the model once outside the replay (first calls pay one-off costs: thread pools,
    allocator, kernels) and drop what it cached, so the replay starts cold but warmed."""
    from kvtier.engine.sampling import SamplingParams

    n = max(2, min(prompt_tokens, engine.max_model_len - 4))
    prompt = [_SYNTHETIC_LOW_ID + i % 1000 for i in range(n)]
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.reset_prefix_cache()


@dataclass
class ReplayResult:
    run: RunRecords
    wall_s: float  # real seconds the replay took
    trace_s: float  # trace seconds it covered (= wall_s + skipped_s)
    skipped_s: float  # idle trace time the replay clock jumped over
    engine_stats: dict[str, Any] = field(default_factory=dict)
    calibration: Calibration | None = None  # the policy's reuse predictions, scored


@dataclass
class _InFlight:
    request: Request
    record: RequestRecord
    token_ids: list[int]
    history_tokens: int  # prompt tokens this session had computed before (its history)
    token_times: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)


def prompt_token_ids(
    engine: Engine, request: Request, answers: Mapping[int, str] | None = None
) -> list[int]:
    """The prompt's token ids: the chat template over `chat_messages`, or `synthetic_token_ids`
    for length-only traces."""
    if request.messages:
        from kvtier.models.tokenizer import chat_token_ids

        return chat_token_ids(engine.tokenizer, chat_messages(request, answers))
    return synthetic_token_ids(request, engine.model_config.vocab_size)


def chat_messages(
    request: Request, answers: Mapping[int, str] | None = None
) -> list[dict[str, str]]:
    """The request's chat messages, with `answers` (turn index -> text the model generated)
    replacing the workload's expected answers in the resent history, as a chat client resends
    the answers it got."""
    messages = [dict(m) for m in request.messages]
    if answers:
        positions = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        first_turn = request.turn_index - len(positions)
        for offset, i in enumerate(positions):
            text = answers.get(first_turn + offset)
            if text:
                messages[i]["content"] = text
    return messages


def synthetic_token_ids(request: Request, vocab_size: int) -> list[int]:
    """Token ids of a length-only trace's prompt, built block by block from its prefix block
    ids (deterministic per block id: equal ids, equal tokens, so the trace's prefix sharing is
    the engine's)."""
    per_block = max(1, round(request.block_tokens))
    ids: list[int] = []
    for block_id in request.hash_ids:
        rng = random.Random(f"kvtier-block-{block_id}")
        ids.extend(rng.randrange(_SYNTHETIC_LOW_ID, vocab_size) for _ in range(per_block))
    rng = random.Random(f"kvtier-tail-{request.request_id}")
    while len(ids) < request.prompt_tokens:
        ids.append(rng.randrange(_SYNTHETIC_LOW_ID, vocab_size))
    return ids[: max(1, request.prompt_tokens)]


def replay(
    engine: Engine,
    requests: Sequence[Request],
    clock: ReplayClock,
    policy: str,
    *,
    arrivals: MutableMapping[str, list[float]] | None = None,
    on_finish: Callable[[RequestRecord], None] | None = None,
    max_output_tokens: int | None = None,
    sample_every_s: float = 5.0,
) -> ReplayResult:
    """Replay `requests` (e.g. `workload.flatten(...)`) through `engine`, whose clock must be
    `clock` (a fresh ReplayClock at 0). Returns the run's records and timing."""
    import time

    from kvtier.engine.sampling import SamplingParams

    origin = min((r.arrival_s for r in requests), default=0.0)
    by_session: dict[str, list[Request]] = {}
    for request in sorted(requests, key=lambda r: (r.session_id, r.turn_index)):
        by_session.setdefault(request.session_id, []).append(request)
    order = itertools.count()
    due: list[tuple[float, int, Request]] = []  # (send time, tie-break, request)
    for turns in by_session.values():
        for k, request in enumerate(turns):
            if k == 0 or request.think_s is None:
                heapq.heappush(due, (request.arrival_s - origin, next(order), request))
    next_turn = {
        r.request_id: turns[k + 1]
        for turns in by_session.values()
        for k, r in enumerate(turns[:-1])
        if turns[k + 1].think_s is not None
    }
    session_tokens: dict[str, list[int]] = {}  # the session's last prompt + answer
    answers: dict[str, dict[int, str]] = {}  # session -> turn index -> generated answer
    block_size = engine.config.block_size
    in_flight: dict[str, _InFlight] = {}
    records: list[RequestRecord] = []

    def done(flight: _InFlight, finish_s: float) -> None:
        records.append(flight.record)
        if on_finish is not None:
            on_finish(flight.record)
        follower = next_turn.get(flight.request.request_id)
        if follower is not None:
            send_at = finish_s + (follower.think_s or 0.0)
            heapq.heappush(due, (send_at, next(order), follower))
            if arrivals is not None:
                times = arrivals.setdefault(follower.session_id, [])
                times[:] = sorted([*times[: follower.turn_index], send_at])
                # later turns keep their trace gaps after this one
                tail = [r.arrival_s - follower.arrival_s + send_at for r in _after(follower)]
                times.extend(tail)

    def _after(request: Request) -> list[Request]:
        return by_session[request.session_id][request.turn_index + 1 :]

    def submit(send_at: float, request: Request) -> None:
        record = RequestRecord(
            request_id=request.request_id,
            session_id=request.session_id,
            tenant=request.tenant,
            turn_index=request.turn_index,
            turn_kind="new",
            arrival_s=send_at,
            prompt_tokens=request.prompt_tokens,
            output_tokens=0,
        )
        flight = _InFlight(request, record, [], 0)
        try:
            flight.token_ids = prompt_token_ids(engine, request, answers.get(request.session_id))
            record.prompt_tokens = len(flight.token_ids)
            # history = full blocks this session computed before (a partial tail block is
            # never cached, so it is plain prefill, not a miss)
            common = common_prefix(flight.token_ids, session_tokens.get(request.session_id, []))
            flight.history_tokens = common // block_size * block_size
            max_tokens = request.output_tokens
            if max_output_tokens is not None:
                max_tokens = min(max_tokens, max_output_tokens)
            params = SamplingParams(temperature=0, max_tokens=max(1, max_tokens), ignore_eos=True)
            engine.add_request(
                flight.token_ids,
                params,
                request_id=request.request_id,
                session_id=request.session_id,
                tenant=request.tenant,
                hints=request.hints,
            )
        except KvtierError as exc:
            record.turn_kind = _kind_without_engine(engine, request, send_at)
            record.failed, record.error = True, str(exc)
            done(flight, clock.now())
            return
        turns = engine.sessions.turns(request.session_id)
        if turns and turns[-1].request_id == request.request_id:
            record.turn_kind = turns[-1].kind.value
        in_flight[request.request_id] = flight

    occupancy: list[OccupancySample] = []
    next_sample = 0.0
    started = time.perf_counter()
    while due or in_flight:
        now = clock.now()
        if now >= next_sample:
            occupancy.append(OccupancySample(now, _used_bytes(engine)))
            next_sample = now + sample_every_s
        while due and due[0][0] <= now:
            send_at, _, request = heapq.heappop(due)
            submit(send_at, request)
        if not engine.has_unfinished_requests():
            if in_flight:  # should not happen; never hang on bookkeeping
                for flight in list(in_flight.values()):
                    flight.record.failed, flight.record.error = True, "lost by the engine"
                    done(in_flight.pop(flight.request.request_id), now)
                continue
            if due:
                clock.advance_to(due[0][0])  # idle: jump, don't wait
            continue
        try:
            outputs = engine.step()
        except Exception as exc:  # a failing step fails its requests, not the benchmark
            engine.fail_all(f"step failed: {exc}")
            outputs = []
            for flight in list(in_flight.values()):
                flight.record.failed, flight.record.error = True, f"step failed: {exc}"
                done(in_flight.pop(flight.request.request_id), clock.now())
        t = clock.now()
        for out in outputs:
            flight = in_flight.get(out.request_id)
            if flight is None:
                continue
            if out.new_token_ids:
                flight.token_times.append(t)
                flight.output_ids.extend(out.new_token_ids)
            if out.delta_text:
                flight.text.append(out.delta_text)
            if out.finished:
                del in_flight[out.request_id]
                _finish(flight, out, t)
                if not flight.record.failed:
                    session_tokens[flight.request.session_id] = flight.token_ids + flight.output_ids
                    _mark_tool_call(engine, flight.request)
                done(flight, t)
    wall_s = time.perf_counter() - started
    records.sort(key=lambda r: (r.arrival_s, r.request_id))
    end = max((r.finish_s or r.arrival_s for r in records), default=0.0)
    occupancy.append(OccupancySample(clock.now(), _used_bytes(engine)))
    tiers, decisions = _tier_records(engine)
    run = RunRecords(
        policy=policy,
        duration_s=end,
        requests=records,
        tiers=tiers,
        decisions=decisions,
        occupancy=occupancy,
    )
    stats = engine.stats()
    return ReplayResult(
        run=run,
        wall_s=wall_s,
        trace_s=clock.now(),
        skipped_s=clock.skipped_s,
        engine_stats=dict(vars(stats)) if hasattr(stats, "__dict__") else {},
    )


def _mark_tool_call(engine: Engine, request: Request) -> None:
    """Tell the engine a turn ended in a tool call, as `kvtier serve` does once its parser reads
    the call: the model here writes no real calls, but the workload knows how the agent's turn
    ended, so the retention policy sees the tool loop a server would show it."""
    if request.end == "tool_call":
        engine.mark_turn_end(request.session_id, request.request_id, "tool_call", request.tool)


def _finish(flight: _InFlight, out: RequestOutput, t: float) -> None:
    record = flight.record
    times = flight.token_times
    record.output_tokens = len(times)
    record.finish_s = t
    if times:
        record.first_token_s = times[0]
        record.itl_s = [b - a for a, b in itertools.pairwise(times)]
        record.max_itl_s = max(record.itl_s) if record.itl_s else None
    metrics = out.metrics
    if metrics is not None and metrics.first_scheduled_time is not None and metrics.token_times:
        # the engine's wall-clock offsets, placed on the replay clock (no skip happens while
        # a request is in flight, so wall-clock differences are trace-clock differences)
        record.scheduled_s = times[0] - (metrics.token_times[0] - metrics.first_scheduled_time)
    if out.finish_reason in ("error", "abort"):
        record.failed = True
        record.error = out.error or f"finished with {out.finish_reason}"
    record.restored_tokens = restored_tokens(out, flight.history_tokens)


def restored_tokens(out: RequestOutput, history_tokens: int) -> dict[str, int]:
    """Where the prompt's history came from, as the engine reports it for `out`
    (`metrics.prompt_token_sources`; without it, the prefix-cache hit): see `history_sources`."""
    sources = getattr(out.metrics, "prompt_token_sources", None) or {}
    if not sources:
        sources = {"device": out.num_cached_tokens or 0}
    return history_sources(sources, history_tokens)


def history_sources(sources: Mapping[str, int], history_tokens: int) -> dict[str, int]:
    """Tokens found on the device or loaded from a tier (the stored sources of `sources`), and
    `recomputed` = what this session had computed before (its history, in full blocks) but no
    tier supplied. The new message is plain prefill, in neither."""
    result = {s: int(sources[s]) for s in STORED_SOURCES if sources.get(s)}
    missed = max(0, history_tokens - sum(result.values()))
    if missed:
        result["recomputed"] = missed
    return result


def _kind_without_engine(engine: Engine, request: Request, now: float) -> str:
    """The turn kind of a request the engine refused (the tracker never saw it)."""
    turns = engine.sessions.turns(request.session_id)
    if not turns:
        return "new"
    ended = turns[-1].ended_at if turns[-1].ended_at is not None else now
    return "continuing" if now - ended <= engine.sessions.resume_after_s else "resumed"


def _used_bytes(engine: Engine) -> dict[str, int]:
    """Bytes held per tier now: the device pool's blocks in use or cached, and each tier's."""
    pool = engine.block_pool
    used = {"device": (pool.num_used + pool.num_cached_idle) * engine.kv_pool.bytes_per_block}
    connector = getattr(engine, "connector", None)
    if connector is not None:
        for name, tier in connector.store.snapshot()["tiers"].items():
            used[name] = int(tier.get("used_bytes", 0))
    return used


def _tier_records(engine: Engine) -> tuple[dict[str, TierTraffic], dict[str, dict[str, int]]]:
    """Tier traffic and policy decisions from the engine's tiered connector (none without)."""
    connector = getattr(engine, "connector", None)
    if connector is None:
        return {}, {}
    stats = connector.stats()
    tiers = {
        name: TierTraffic(
            capacity_bytes=int(t.get("capacity_bytes", 0)),
            bytes_written=int(t.get("bytes_written", 0)),
            bytes_read=int(t.get("bytes_read", 0)),
            bytes_dropped=max(
                0,
                int(t.get("bytes_written", 0))
                - int(t.get("bytes_read", 0))
                - int(t.get("used_bytes", 0)),
            ),
            resident_bytes=int(t.get("used_bytes", 0)),
            writes=int(t.get("chunks_written", 0)),
            reads=int(t.get("hits", 0)),
        )
        for name, t in stats.get("tiers", {}).items()
    }
    decisions = {kind: {"all": int(n)} for kind, n in stats.get("decisions", {}).items()}
    return tiers, decisions
