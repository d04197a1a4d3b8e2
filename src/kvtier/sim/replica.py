"""Replica: one serving replica in simulated time, the engine's scheduler with step times from
the step model instead of a model forward. This file keeps arrival, admission and steps, and
wires the parts, which mirror the engine's cache connector (`kvtier.cache`) file for file:
where chunks are (`chunks.py`), loads of a resumed prefix (`restore.py`), spills and
write-through (`spill.py`), the policy and its actions (`policy_runner.py`,
`chunk_actions.py`); besides them, the device pool and its kept pages (`pool.py`), the tiers'
links (`links.py`), shared prefixes (`prefixes.py`) and one turn's state (`requests.py`).

- **Arrival.** A turn is new, continuing or resumed by its gap (as the engine's session
  tracker says). Its history's KV is what the conversation holds of the new prompt's prefix
  (`Restorer.valid_tokens`); the rest is dropped (`Chunks.cut`). The restore is planned, and
  the loads start at once if the device has room for them beyond what the requests ahead need
  (prefetch), else at admission. A queued request that is not prefetching pins nothing: its KV
  stays movable, as a prefix cache's blocks do until the scheduler takes the request.
- **Admission**, FCFS up to `max_num_seqs` running: the request reserves device memory for its
  whole context (prompt + output), so nothing is ever preempted. Short of memory, the policy is
  asked under pressure (`reason="pressure"`, `bytes_needed`); the queue waits while spills
  that will free enough are in flight. When nothing runs or moves and the policy cannot help,
  the first queued request that fits goes ahead, or else the head fails.
- **Steps**: every running decode gets a token, then prefill chunks fill the token budget in
  FCFS order (vLLM's decode-first chunked prefill). A request's prefill runs its recomputed
  chunks front to back, then the new prompt once every load has arrived; a recomputed chunk
  behind a missing one waits for the loads before it (the planner's early loads). A run of
  decode-only steps with nothing to change it (no arrival, finish, transfer or tick before
  its end) is one event: its length is summed in closed form.
- **Finish**: the whole context stays on the device, idle, for the policy to place.
- **Policy**: on a timer (every `interval_s`, driven by the simulator) and under pressure.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from kvtier.policy.base import RetentionPolicy
from kvtier.policy.cost_model import CostModel
from kvtier.policy.view import TurnView
from kvtier.results.records import RequestRecord, TurnKind
from kvtier.sim.chunk_actions import ReplicaChunks
from kvtier.sim.chunks import Chunks
from kvtier.sim.deployment import Deployment
from kvtier.sim.events import EventLoop
from kvtier.sim.links import Links
from kvtier.sim.policy_runner import PolicyRunner
from kvtier.sim.pool import DevicePool
from kvtier.sim.prefixes import SharedPrefixes
from kvtier.sim.requests import SimRequest
from kvtier.sim.restore import Restorer
from kvtier.sim.session import SimSession
from kvtier.sim.spill import Spiller
from kvtier.sim.step_model import StepModel
from kvtier.workload.model import Request


class Replica:
    def __init__(
        self,
        loop: EventLoop,
        deployment: Deployment,
        model: StepModel,
        policy: RetentionPolicy,
        cost_model: CostModel,
        on_done: Callable[[RequestRecord], None],
        track_s: float,
        histories: Mapping[str, int] | None = None,
    ) -> None:
        self.loop, self.deployment, self.model = loop, deployment, model
        self.on_done = on_done
        histories = histories or {}  # request id -> measured history tokens (a cap)
        self.bytes_per_token = deployment.bytes_per_token
        self.sessions: dict[str, SimSession] = {}
        self.waiting: deque[SimRequest] = deque()
        # seconds spent encoding (the mover's worker) and decoding (restores) stored forms
        self.codec_s: Counter[str] = Counter()
        self.form_tokens: Counter[str] = Counter()  # tokens restored from lower tiers, per form
        self.pool = DevicePool(deployment.device_kv_bytes, deployment.keep_moved)
        self.chunks = Chunks(deployment, self.pool)
        self.links = Links(loop, deployment.tiers, model.paths)
        # the engine connector's rule: a policy that never reads a tier drops what leaves the
        # device, so copying it would only cost writes
        write_through = (
            deployment.write_through and self.chunks.top_tier is not None and policy.spills_on_evict
        )
        self.spiller = Spiller(self.chunks, self.pool, self.links, write_through, self._kick)
        self.prefixes = SharedPrefixes(deployment.block_size, histories)
        self.restorer = Restorer(
            loop,
            deployment,
            self.chunks,
            self.links,
            cost_model,
            self.prefixes,
            histories,
            self.form_tokens,
            self.codec_s,
            self._kick,
        )
        target = ReplicaChunks(
            self.sessions, self.chunks, self.pool, self.spiller, cost_model, self.codec_s
        )
        self.runner = PolicyRunner(
            loop,
            policy,
            target,
            self.pool,
            self.chunks,
            self.waiting,
            self.bytes_per_token,
            track_s,
        )
        self.metrics = self.runner.metrics
        self._futile_epoch = -1  # memory epoch of the last pressure call that freed too little
        self.prefilling: list[SimRequest] = []
        self.decoding: list[tuple[int, int, SimRequest]] = []  # (finish count, order, request)
        self._order = itertools.count()
        self.running = 0
        self.decode_count = 0  # decode steps so far
        self.decode_context = 0  # keys the running decodes attend to at the next step
        self.busy = False
        self._timer_due = False  # a timer tick came while idle: run it after the next step
        self.steps = 0
        self.itl_us: Counter[int] = Counter()  # gap (microseconds) -> count
        self.run_max: list[float] = []  # longest step of each decode run
        self._stall_ranges: list[tuple[RequestRecord, int, int]] = []

    @property
    def load(self) -> int:
        return len(self.waiting) + self.running

    @property
    def policy_s(self) -> float:
        """Wall time spent in the policy's decide(): what the loop waits on."""
        return self.runner.policy_s

    # -- arrivals ------------------------------------------------------------------------

    def arrive(self, request: Request) -> None:
        now = self.loop.now
        session = self.sessions.get(request.session_id)
        if session is None:
            session = self.sessions[request.session_id] = SimSession(
                request, self.deployment.chunk_tokens
            )
        if session.busy:  # a user cannot send the next turn before the answer ended
            session.pending.append(request)
            return
        record = RequestRecord(
            request.request_id,
            request.session_id,
            request.tenant,
            request.turn_index,
            self._kind(session, now),
            now,
            request.prompt_tokens,
            0,
        )
        r = SimRequest(request, session, record)
        error = self._too_large(r)
        if error:
            self._fail(r, error)
            return
        session.busy = True
        self.runner.track(session)
        if self.pool.kept:
            self.chunks.revive_kept(session)
        r.valid = self.restorer.valid_tokens(session, request)
        self.chunks.cut(session, r.valid)
        session.tokens = r.valid
        session.turns.append(TurnView(now, r.prompt - r.valid + r.output))
        session.hash_ids, session.block_tokens = request.hash_ids, request.block_tokens
        session.prompt_tokens = r.prompt
        session.changed()
        r.device_base = sum(
            size
            for tier, size in zip(session.tiers, session.sizes, strict=True)
            if tier == "device"
        )
        self.waiting.append(r)
        plan = self.restorer.plan(r)
        # Prefetch: start the loads now if the device has room for them. Until then (or
        # without loads) the queued turn pins nothing: like a prefix cache, its KV stays
        # evictable until the scheduler takes it.
        if plan[1]:
            load_bytes = sum(session.device_bytes(i) for i in plan[1])
            ahead = sum(w.reserve - w.device_base - w.allocated for w in self.waiting)
            ahead -= r.reserve - r.device_base  # itself (just queued, nothing allocated)
            # only memory no earlier request needs: prefetching must not block the queue
            if self.pool.capacity - self.pool.used - ahead >= load_bytes:
                self.restorer.commit(r, plan)
                self.pool.allocate(r.load_bytes)
                r.allocated += r.load_bytes
                self.restorer.start_loads(r)
        self._kick()

    def _kind(self, session: SimSession, now: float) -> TurnKind:
        if not session.turns:
            return "new"
        gap = now - session.last_end
        return "continuing" if gap <= self.deployment.session_resume_after_s else "resumed"

    def _too_large(self, r: SimRequest) -> str | None:
        context = r.prompt + r.output
        limit = self.deployment.geometry.max_position_embeddings
        if limit and context > limit:
            return (
                f"too long for the model: prompt + output = {context:,} tokens exceeds the "
                f"model's context of {limit:,}"
            )
        r.reserve = self.deployment.kv_bytes(context)
        capacity = self.pool.capacity
        if r.reserve > capacity:
            return (
                f"too large for the device pool: {context:,} tokens of KV ({r.reserve:,} B) "
                f"exceed the {capacity:,} B pool"
            )
        return None

    # -- scheduling ----------------------------------------------------------------------

    def _kick(self) -> None:
        if not self.busy:
            self._step()

    def _step(self) -> None:
        while True:
            self._admit()
            decodes = len(self.decoding)
            budget = self.deployment.max_num_batched_tokens - decodes
            chunks: list[tuple[SimRequest, int, int]] = []
            for r in self.prefilling:
                if budget <= 0:
                    break
                tokens = r.next_chunk(budget)
                if tokens:
                    chunks.append((r, tokens, r.cursor))
                    budget -= tokens
            if decodes or chunks:
                break
            self.busy = False
            if not (self.waiting and self._stuck()):
                return
            self._unstick()
        self.busy = True
        now = self.loop.now
        if chunks:
            steps = 1
            duration = last = self.model.step_s(
                decodes, self.decode_context, [(t, p) for _, t, p in chunks]
            )
        else:
            limit = self.decoding[0][0] - self.decode_count
            horizon = self.loop.next_time() - now
            steps = limit
            if math.isfinite(horizon):
                steps = self.model.decode_steps_within(decodes, self.decode_context, horizon, limit)
            duration, last = self.model.decode_run_s(decodes, self.decode_context, steps)
        self.loop.at(now + duration, self._step_end, chunks, steps, duration, last)

    def _stuck(self) -> bool:
        """Nothing runs or moves, and the policy could not free room for the queue's head."""
        return (
            not self.prefilling
            and not self.decoding
            and not self.links.in_flight
            and self._futile_epoch == self.pool.epoch
        )

    def _unstick(self) -> None:
        """Prefetched requests behind the head hold the memory the head needs, and nothing
        runs that would free any: let the first one that fits go ahead (it frees its memory
        when it ends); if none fits, the head fails."""
        free = self.pool.capacity - self.pool.used
        for r in self.waiting:
            if r.committed and r.reserve - r.device_base - r.allocated <= free:
                self.waiting.remove(r)
                self._take(r)
                return
        self._fail(
            self.waiting.popleft(),
            "no device memory: the KV of the sessions waiting in the queue fills the pool",
        )

    def _admit(self) -> None:
        while self.waiting and self.running < self.deployment.max_num_seqs:
            r = self.waiting[0]
            if not r.committed:
                self.restorer.commit(r, self.restorer.plan(r))
            need = r.reserve - r.device_base - r.allocated
            if need > self.pool.capacity - self.pool.used and not self._make_room(need):
                return
            self._take(self.waiting.popleft())

    def _take(self, r: SimRequest) -> None:
        """Admit `r`: reserve the rest of its context and start running it."""
        need = r.reserve - r.device_base - r.allocated
        self.pool.allocate(need)
        r.allocated += need
        r.record.scheduled_s = self.loop.now
        self.prefilling.append(r)
        self.running += 1
        if r.phases and not r.loads_started:
            self.restorer.start_loads(r)

    def _make_room(self, need: int) -> bool:
        pool = self.pool
        if pool.capacity - pool.used + pool.pending_free >= need:
            return False  # spills in flight will free enough
        if self._futile_epoch == pool.epoch:
            return False  # the policy could not help, and nothing changed since
        headroom = int(self.deployment.pressure_headroom * pool.capacity)
        self.runner.run("pressure", min(need + headroom, pool.capacity))
        if pool.capacity - pool.used >= need:
            return True
        self._futile_epoch = pool.epoch
        return False

    def _step_end(
        self, chunks: list[tuple[SimRequest, int, int]], steps: int, duration: float, last: float
    ) -> None:
        self.steps += steps
        decodes = len(self.decoding)
        if decodes:
            # every running decode got one token per step: `decodes` gaps of the step's length
            self.itl_us[round(duration / steps * 1e6)] += decodes * steps
            self.run_max.append(last)
            self.decode_count += steps
            self.decode_context += decodes * steps
        for r, tokens, _ in chunks:
            r.advance(tokens)
            if r.prefill_done:
                self.prefilling.remove(r)
                self._first_token(r)
        while self.decoding and self.decoding[0][0] <= self.decode_count:
            _, _, r = heapq.heappop(self.decoding)
            self.decode_context -= r.join_context + self.decode_count - r.join_count
            self._finish(r)
        if self._timer_due:
            self.tick()  # runs the policy: the replica is still busy at this step's end
        self._step()

    def _first_token(self, r: SimRequest) -> None:
        r.record.first_token_s = self.loop.now
        if self.deployment.shared_prefixes and r.record.turn_kind == "new":
            self.prefixes.share(r.session)
        if r.output == 1:
            self._finish(r)
            return
        r.join_count = self.decode_count
        r.join_context = r.prompt + 1  # the first decode attends to the prompt and itself
        r.first_run = len(self.run_max)
        self.decode_context += r.join_context
        finish = self.decode_count + r.output - 1
        heapq.heappush(self.decoding, (finish, next(self._order), r))

    def _finish(self, r: SimRequest) -> None:
        now, session, record = self.loop.now, r.session, r.record
        record.finish_s, record.output_tokens = now, r.output
        if r.output > 1:
            self._stall_ranges.append((record, r.first_run, len(self.run_max)))
        total = r.prompt + r.output
        chunk = self.deployment.chunk_tokens
        sizes = [
            self.deployment.kv_bytes(min(chunk, total - start)) for start in range(0, total, chunk)
        ]
        self.pool.allocate(sum(sizes) - (r.device_base + r.allocated))
        session.reset(total, sizes, now)
        if self.spiller.write_through:
            self.spiller.write_through_chunks(session)
        self.running -= 1
        self._end_turn(r)

    def _fail(self, r: SimRequest, error: str) -> None:
        r.record.failed, r.record.error = True, error
        if r.committed:  # give back what admission took; loaded chunks stay on the device
            self.pool.used -= r.allocated - r.load_bytes * r.loads_started
        self._end_turn(r)

    def _end_turn(self, r: SimRequest) -> None:
        session, now = r.session, self.loop.now
        if session.busy:
            turn = r.request  # how its reply ended is known now, and the client's hints
            session.turns[-1] = replace(
                session.turns[-1], finished=now, end=turn.end, tool=turn.tool
            )
            session.hints = turn.hints
            session.busy = session.active = False
            session.idle_since = now
            session.changed()
            self.pool.epoch += 1
        self.on_done(r.record)
        if session.pending:
            self.loop.at(now, self.arrive, session.pending.popleft())

    # -- the retention policy ----------------------------------------------------------

    def tick(self) -> None:
        """The policy's timer: decide on the idle KV, then forget long-gone sessions. With
        `timer_after_steps` (as kvtier's engine, whose policy runner is called after each
        step), a tick that finds the replica idle waits for the end of its next step."""
        if self.deployment.timer_after_steps and not self.busy:
            self._timer_due = True
            return
        self._timer_due = False
        self.runner.run("timer", 0)
        self.runner.forget_untracked()
        self._kick()

    # -- results -------------------------------------------------------------------------

    def occupancy(self) -> dict[str, int]:
        used = {"device": self.pool.used}
        if self.chunks.store is not None:
            used |= {name: tier.used_bytes for name, tier in self.chunks.store.tiers.items()}
        return used

    def record_stalls(self) -> None:
        """Each request's longest inter-token gap: the longest step of the decode runs it was
        in (a request spans whole runs: runs end where a request joins or finishes)."""
        if not self._stall_ranges:
            return
        longest = np.array([*self.run_max, 0.0])
        bounds = np.array([b for _, first, end in self._stall_ranges for b in (first, end)])
        for (record, _, _), value in zip(
            self._stall_ranges, np.maximum.reduceat(longest, bounds)[::2], strict=True
        ):
            record.max_itl_s = float(value)

    def tier_counters(self) -> dict[str, dict[str, Any]]:
        """Per lower tier: budget, bytes/ops in and out, bytes dropped, bytes still held."""
        return self.chunks.tier_counters()
