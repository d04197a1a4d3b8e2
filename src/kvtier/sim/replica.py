"""One serving replica in simulated time: what the engine does, with step times from the step
model instead of a model forward, and the engine's policy, restore planner and store index.

- **Arrival.** A turn is new, continuing or resumed by its gap (as the engine's session
  tracker says). Its history's KV is what the conversation holds of the new prompt's prefix (a
  history budget that dropped old turns cuts it where the prefix block ids part). The restore
  planner (`policy.restore.plan_restore`) splits it into chunks to load and chunks to
  recompute, and the loads start at once if the device has room for them beyond what the
  requests ahead need (prefetch), else at admission. Loads run on the tier's link, shared with
  every other transfer on it. A queued request that is not prefetching pins nothing: its KV
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
- **Policy**: on a timer (every `interval_s`, driven by the simulator) and under pressure, on
  views built from cached per-session views. A decision's moves off the device are copied in
  the order it issued them, as on one copy stream, and each frees its device memory when its
  own copy lands; moves and drops below it are immediate in the store index, and the copies
  occupy the target's link. One copy per chunk: a loaded chunk leaves its tier.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np

from kvtier.oldest_first import OldestFirst
from kvtier.policy.base import RetentionPolicy
from kvtier.policy.cost_model import CostModel
from kvtier.policy.executor import ActionExecutor
from kvtier.policy.ledger import form_bytes
from kvtier.policy.metrics import PolicyMetrics
from kvtier.policy.restore import plan_restore
from kvtier.policy.view import (
    ChunkView,
    PolicyView,
    QueueView,
    Reason,
    TierView,
    TurnView,
    ViewDelta,
)
from kvtier.results.records import RequestRecord, TurnKind
from kvtier.sim.channel import Channel
from kvtier.sim.deployment import Deployment
from kvtier.sim.events import EventLoop
from kvtier.sim.holding import HoldingIndex
from kvtier.sim.session import SimSession
from kvtier.sim.step_model import StepModel
from kvtier.tiers.payload import Payload
from kvtier.tiers.sized import SizeOnlyTier
from kvtier.tiers.store import TieredStore
from kvtier.vocab import FULL, lossiest
from kvtier.workload.model import Request

# How far a request's prefill may go: recomputed chunks with no load before them, then those
# behind the planner's early loads, then the new prompt after every load.
GATE_NONE, GATE_EARLY, GATE_ALL = 0, 1, 2


SHARED_BLOCKS = 64  # leading blocks of a new conversation recorded for sharing
SHARED = ""  # block owner once two conversations computed it (no session id is empty)


class SimRequest:
    __slots__ = (
        "allocated",
        "committed",
        "cursor",
        "device_base",
        "first_run",
        "join_context",
        "join_count",
        "load_bytes",
        "loads_started",
        "open_gate",
        "output",
        "pending",
        "phases",
        "prompt",
        "record",
        "reserve",
        "segment",
        "segments",
        "session",
        "shared",
        "valid",
    )

    def __init__(self, request: Request, session: SimSession, record: RequestRecord) -> None:
        self.record = record
        self.session = session
        self.prompt = request.prompt_tokens
        self.output = max(1, request.output_tokens)
        self.valid = 0  # history tokens whose KV the session holds
        self.shared = 0  # of those, leading tokens other sessions computed (shared prefixes)
        self.committed = False  # restore planned, session KV pinned
        self.segments: list[tuple[int, int, int]] = []  # (start, end, gate) to prefill, in order
        self.segment = 0
        self.cursor = 0
        # load phases in order: (gate they open, tier -> chunk indices)
        self.phases: list[tuple[int, dict[str, list[int]]]] = []
        self.pending = 0  # transfers of the current phase still running
        self.open_gate = GATE_ALL
        self.loads_started = False
        self.load_bytes = 0
        self.reserve = 0  # device bytes of the whole context
        self.device_base = 0  # of those, already on the device at arrival
        self.allocated = 0  # allocated since (loads, admission)
        self.join_count = 0
        self.join_context = 0
        self.first_run = 0

    def next_chunk(self, budget: int) -> int:
        """Tokens this request can prefill in the next step, within `budget`."""
        if self.segment >= len(self.segments):
            return 0
        _, end, gate = self.segments[self.segment]
        return min(budget, end - self.cursor) if gate <= self.open_gate else 0

    def advance(self, tokens: int) -> None:
        self.cursor += tokens
        if self.cursor == self.segments[self.segment][1]:
            self.segment += 1
            if self.segment < len(self.segments):
                self.cursor = self.segments[self.segment][0]

    @property
    def prefill_done(self) -> bool:
        return self.segment >= len(self.segments)


class ReplicaChunks:
    """The action executor's target over a replica (`kvtier.policy.executor`): chunks move
    in the size-only store and take time on the target tier's link. As the engine's store
    would, with budgets the policy's obligation: a move that would not fit is dropped instead
    of overfilling a tier. Spills off the device are batched into one transfer per tier,
    issued when the decision's actions are all done, whose chunks land in the order they were
    moved; the device frees each chunk's bytes when it lands."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        # tier -> (bytes written, device bytes freed, session, chunk) of the chunks spilled there
        self.spills: dict[str, list[tuple[int, int, SimSession, int]]] = {}

    @property
    def tiers(self) -> Sequence[str]:
        store = self.replica.store
        return list(store.tiers) if store is not None else []

    def chunks(self, session_id: str) -> Sequence[str | None] | None:
        session = self.replica.sessions.get(session_id)
        return session.tiers if session is not None else None

    def move(self, session_id: str, index: int, tier: str, form: str) -> str | None:
        replica = self.replica
        session = replica.sessions[session_id]
        size, source, chunk = session.sizes[index], session.tiers[index], session.chunk(index)
        target = replica.store.tiers[tier]
        session.changed()
        if source == "device" and session.copied[index]:
            # the copy becomes the chunk: the device frees its bytes now, with no transfer
            replica._forget_copy(session, index)
            session.tiers[index] = source = replica.top_tier
            replica.used -= size
            replica._keep_moved(session, index, size)
            replica.epoch += 1
            if tier == source:
                return None
        # precision only goes down (cache/forms.py): the chunk is stored at the lossier of
        # its own form and the asked one, in that form's bytes, encoded on the mover's worker
        form = lossiest(session.forms[index], form)
        stored = size
        if form != session.forms[index] or (source == "device" and form != FULL):
            full = session.device_bytes(index)
            stored = form_bytes(full, FULL, form)
            replica.codec_s["encode"] += replica.cost_model.encode_s(full, form)
        if tier == replica.top_tier:
            replica._reclaim(target, stored)
        if not target.fits(stored):
            replica._drop_chunk(session, index)
        elif source == "device":
            if replica.store.put(chunk, Payload.sized(stored), tier=tier):
                self._stored(session, index, tier, form, stored)
                replica.pending_free += size
                self.spills.setdefault(tier, []).append((stored, size, session, index))
            else:
                replica._drop_chunk(session, index)
        elif stored == size:
            moved = replica.store.demote(chunk.id, to=tier)
            session.tiers[index] = tier if moved else None
            if moved:
                replica._write(tier, [size])
        else:  # re-encoded on the way down: the size-only store holds the new size
            replica.store.delete(chunk.id)
            if replica.store.put(chunk, Payload.sized(stored), tier=tier):
                self._stored(session, index, tier, form, stored)
                replica._write(tier, [stored])
            else:
                replica._drop_chunk(session, index)
        return None

    @staticmethod
    def _stored(session: SimSession, index: int, tier: str, form: str, stored: int) -> None:
        if stored != session.sizes[index]:
            session.full.setdefault(index, session.sizes[index])
        session.tiers[index], session.forms[index], session.sizes[index] = tier, form, stored

    def drop(self, session_id: str, index: int) -> None:
        self.replica._drop_chunk(self.replica.sessions[session_id], index)

    def flush(self) -> None:
        for tier, spills in self.spills.items():
            self.replica._spill(tier, spills)
        self.spills = {}


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
        self.policy, self.cost_model, self.on_done = policy, cost_model, on_done
        self.track_s = track_s  # idle sessions without KV stay in views this long
        self.histories = histories or {}  # request id -> measured history tokens (a cap)
        tiers = [SizeOnlyTier(name, size) for name, size in deployment.tiers.items()]
        self.store = (
            TieredStore(
                tiers, block_tokens=deployment.block_tokens, chunk_tokens=deployment.chunk_tokens
            )
            if tiers
            else None
        )
        self.read: dict[str, Channel] = {}
        self.write: dict[str, Channel] = {}
        for name in deployment.tiers:
            path = model.paths[name]
            self.read[name] = Channel(loop, path.read.bandwidth)
            self.write[name] = (
                Channel(loop, path.write.bandwidth) if path.duplex else self.read[name]
            )
        self.bytes_per_token = deployment.bytes_per_token
        # write-through copies, oldest first: (session id, chunk) -> session; dropped first
        # when their tier needs the room, so policies see the space they fill as free
        self.copies: dict[tuple[str, int], SimSession] = {}
        self.copy_bytes = 0
        self.top_tier = next(iter(deployment.tiers), None)
        # as the engine's connector: policies that never demote (retain, recompute) drop what
        # leaves the device, so copying it would only cost writes
        self.write_through = (
            deployment.write_through
            and self.top_tier is not None
            and policy.name not in ("retain", "recompute")
        )
        self.full_chunk_bytes = deployment.kv_bytes(deployment.chunk_tokens)
        # keep_moved: device pages of chunks moved down, kept until the pool needs them:
        # (session id, chunk) -> device bytes. Not in `used`: they are free. The pool takes
        # them back least recently used first, a session's tail before its head, as a prefix
        # cache's LRU does (`_kept_order`).
        self.kept: dict[tuple[str, int], int] = {}
        self._kept_order: OldestFirst[tuple[str, int]] = OldestFirst()
        self.kept_bytes = 0
        self.capacity = deployment.device_kv_bytes
        self.used = 0  # device bytes held: idle KV, running requests, loads, spills in flight
        self.pending_free = 0  # of those, bytes being spilled (a chunk frees as its copy lands)
        self.epoch = 0  # changes whenever device memory frees up or new idle KV appears
        self._futile_epoch = -1  # memory epoch of the last pressure call that freed too little
        self.sessions: dict[str, SimSession] = {}
        self.tracked: dict[str, SimSession] = {}  # what policy views show
        self.holding = HoldingIndex()  # of the tracked sessions, who holds KV in which tier
        # what the next view tells the policy changed (`PolicyView.delta`): the sessions no
        # longer tracked since the last view, and that view's token
        self._untracked: list[str] = []
        self._last_view: object = None
        # leading block id of a new conversation's prompt -> the session that computed it, or
        # SHARED once a second one did (shared prefixes)
        self.block_owner: dict[int, str] = {}
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: list[tuple[int, int, SimRequest]] = []  # (finish count, order, request)
        self._order = itertools.count()
        self.running = 0
        self.decode_count = 0  # decode steps so far
        self.decode_context = 0  # keys the running decodes attend to at the next step
        self.busy = False
        self._timer_due = False  # a timer tick came while idle: run it after the next step
        self.in_flight = 0  # transfers running
        self.steps = 0
        self.itl_us: Counter[int] = Counter()  # gap (microseconds) -> count
        self.run_max: list[float] = []  # longest step of each decode run
        self._stall_ranges: list[tuple[RequestRecord, int, int]] = []
        self.dropped: Counter[str] = Counter()  # bytes dropped per lower tier
        self.metrics = PolicyMetrics()
        # the engine's interpreter of actions, over this replica's size-only store
        self.executor = ActionExecutor(ReplicaChunks(self))
        self.policy_s = 0.0  # wall time spent in the policy's decide(): what the loop waits on
        # seconds spent encoding (the mover's worker) and decoding (restores) stored forms
        self.codec_s: Counter[str] = Counter()
        self.form_tokens: Counter[str] = Counter()  # tokens restored from lower tiers, per form

    @property
    def load(self) -> int:
        return len(self.waiting) + self.running

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
        self.tracked[session.session_id] = session
        if self.kept:
            self._revive_kept(session)
        r.valid = self._valid_tokens(session, request)
        keep = math.ceil(r.valid / self.deployment.chunk_tokens)
        for index in range(keep, len(session.tiers)):
            self._drop_chunk(session, index)
        session.truncate(keep)
        self._trim_last_chunk(session, r.valid)
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
        plan = self._plan(r)
        # Prefetch: start the loads now if the device has room for them. Until then (or
        # without loads) the queued turn pins nothing: like a prefix cache, its KV stays
        # evictable until the scheduler takes it.
        if plan[1]:
            load_bytes = sum(session.device_bytes(i) for i in plan[1])
            ahead = sum(w.reserve - w.device_base - w.allocated for w in self.waiting)
            ahead -= r.reserve - r.device_base  # itself (just queued, nothing allocated)
            # only memory no earlier request needs: prefetching must not block the queue
            if self.capacity - self.used - ahead >= load_bytes:
                self._commit(r, plan)
                self.used += r.load_bytes
                self._reuse_kept()
                r.allocated += r.load_bytes
                self._start_loads(r)
        self._kick()

    def _kind(self, session: SimSession, now: float) -> TurnKind:
        if not session.turns:
            return "new"
        gap = now - session.last_end
        return "continuing" if gap <= self.deployment.resume_after_s else "resumed"

    def _too_large(self, r: SimRequest) -> str | None:
        context = r.prompt + r.output
        limit = self.deployment.geometry.max_position_embeddings
        if limit and context > limit:
            return (
                f"too long for the model: prompt + output = {context:,} tokens exceeds the "
                f"model's context of {limit:,}"
            )
        r.reserve = self.deployment.kv_bytes(context)
        if r.reserve > self.capacity:
            return (
                f"too large for the device pool: {context:,} tokens of KV ({r.reserve:,} B) "
                f"exceed the {self.capacity:,} B pool"
            )
        return None

    def _valid_tokens(self, session: SimSession, request: Request) -> int:
        """How much of the session's KV the new prompt still starts with: all of it when the
        prompt extends the previous one, else the common prefix (a history budget dropped old
        turns), at most the measured history where one is given; cut at a whole block, or at
        a chunk's start if that chunk is not on the device. Never the last prompt token: a
        step must compute one."""
        if not session.tokens:
            return 0
        old, new = session.hash_ids, request.hash_ids
        whole = min(int(session.prompt_tokens // session.block_tokens), len(old))
        if old[:whole] == new[:whole]:
            valid = session.tokens
        else:
            low, high = 0, whole  # longest common prefix, by bisection on slices
            while low < high:
                middle = (low + high + 1) // 2
                low, high = (middle, high) if old[:middle] == new[:middle] else (low, middle - 1)
            valid = int(low * request.block_tokens)
        measured = self.histories.get(request.request_id)
        if measured is not None and measured < valid:
            valid = measured
        if valid < session.tokens:
            # The device's prefix cache reuses whole blocks; a lower tier holds whole chunks
            # (its key names all of a chunk's blocks), so a prefix ending in a stored chunk
            # stops at that chunk's start.
            chunk, block = self.deployment.chunk_tokens, self.deployment.block_tokens
            valid = valid // block * block
            index = valid // chunk
            if index < len(session.tiers) and session.tiers[index] != "device":
                valid = index * chunk
        return min(valid, request.prompt_tokens - 1)

    def _trim_last_chunk(self, session: SimSession, valid: int) -> None:
        """A device chunk the new prompt reuses only part of keeps that part's pages; the
        rest is freed (its blocks hold the old turn's tail, which the prompt does not)."""
        index = len(session.tiers) - 1
        if index < 0 or session.tiers[index] != "device":
            return
        size = self.deployment.kv_bytes(valid - index * self.deployment.chunk_tokens)
        if size < session.sizes[index]:
            if session.copied[index]:
                self._uncopy(session, index)  # the copy holds the old, longer chunk
            self.used -= session.sizes[index] - size
            self.epoch += 1
            session.sizes[index] = size
            session.changed()

    def _plan(self, r: SimRequest) -> tuple[set[int], Sequence[int]]:
        """(chunks to recompute, chunks to load in issue order): the restore planner's split
        when some chunk is in a lower tier; otherwise only missing chunks are recomputed,
        which is what the planner would say too."""
        tiers = r.session.tiers
        if all(tier is None or tier == "device" for tier in tiers):
            return {i for i, tier in enumerate(tiers) if tier is None}, ()
        chunks = [
            ChunkView(i, *r.session.chunk_range(i), tier, r.session.sizes[i], r.session.forms[i])
            for i, tier in enumerate(tiers)
        ]
        plan = plan_restore(chunks, self.cost_model)
        return set(plan.recompute), plan.loads

    def _commit(self, r: SimRequest, plan: tuple[set[int], Sequence[int]]) -> None:
        """Take the plan: the session's KV is in use from here (no policy moves it), and the
        prefill segments and load phases are laid out."""
        session = r.session
        session.active, session.idle_since = True, None
        session.changed()
        r.committed = True
        if self.deployment.shared_prefixes and not session.tokens:
            # looked up when the scheduler takes the request, as the engine's prefix cache
            # is: blocks other conversations computed while this one waited count
            r.valid = r.shared = session.tokens = self._shared_prefix(r)
        count = len(session.tiers)
        recompute, loads = plan
        restored: Counter[str] = Counter()
        r.device_base = 0
        for i in range(count):
            start, end = session.chunk_range(i)
            tier = session.tiers[i]
            if i in recompute:
                restored["recomputed"] += end - start
                if tier is not None:  # stored, but recomputing it is faster: one copy only
                    self._drop_chunk(session, i)
            else:
                restored[tier] += end - start
                if tier == "device":
                    r.device_base += session.sizes[i]
                else:
                    self.form_tokens[session.forms[i]] += end - start
        if r.shared:
            restored["device"] += r.shared
        r.record.restored_tokens = dict(restored)
        last_recompute = max(recompute, default=-1)
        early = [i for i in loads if i < last_recompute]
        late = [i for i in loads if i > last_recompute]
        first_early = min(early, default=count)
        for i in sorted(recompute):
            start, end = session.chunk_range(i)
            gate = GATE_EARLY if first_early < i else GATE_NONE
            if r.segments and r.segments[-1][1] == start and r.segments[-1][2] == gate:
                r.segments[-1] = (r.segments[-1][0], end, gate)
            else:
                r.segments.append((start, end, gate))
        r.segments.append((r.valid, r.prompt, GATE_ALL))
        r.cursor = r.segments[0][0]
        for indices in (early, late):
            if indices:
                by_tier: dict[str, list[int]] = {}
                for i in indices:
                    by_tier.setdefault(session.tiers[i], []).append(i)
                r.phases.append((GATE_EARLY, by_tier))
        if r.phases:  # the last phase to arrive lets the new prompt in
            r.phases[-1] = (GATE_ALL, r.phases[-1][1])
        r.open_gate = GATE_NONE if early else GATE_EARLY if late else GATE_ALL
        r.load_bytes = sum(session.device_bytes(i) for i in loads)

    # -- loads and spills --------------------------------------------------------------

    def _start_loads(self, r: SimRequest) -> None:
        r.loads_started = True
        for _, by_tier in r.phases:
            for indices in by_tier.values():
                for i in indices:  # the store reads each chunk for the device
                    self.store.promote(r.session.chunk(i).id)
        self._start_phase(r, 0)

    def _start_phase(self, r: SimRequest, phase: int) -> None:
        for tier, indices in r.phases[phase][1].items():
            link, session = self.model.paths[tier].read, r.session
            work = sum(session.sizes[i] for i in indices)
            work += len(indices) * link.latency_s * link.bandwidth
            # a quantized chunk is decoded as it arrives, on the restore's path: counted as
            # link time, the one pipeline a chunk's load and decode run through here
            decode = sum(
                self.cost_model.decode_s(session.device_bytes(i), session.forms[i]) for i in indices
            )
            if decode:
                self.codec_s["decode"] += decode
                work += decode * link.bandwidth
            self.in_flight += 1
            r.pending += 1
            self.read[tier].submit(work, self._loaded, r, phase)

    def _loaded(self, r: SimRequest, phase: int) -> None:
        self.in_flight -= 1
        r.pending -= 1
        if r.pending:
            return
        gate, by_tier = r.phases[phase]
        session, now = r.session, self.loop.now
        for indices in by_tier.values():
            for i in indices:
                self.store.delete(session.chunk(i).id)
                session.tiers[i], session.access[i] = "device", now
                session.sizes[i] = session.full.pop(i, session.sizes[i])
        session.changed()
        r.open_gate = gate
        if phase + 1 < len(r.phases):
            self._start_phase(r, phase + 1)
        self._kick()

    def _write(self, tier: str, sizes: Sequence[int]) -> None:
        """Copy chunks into a tier in the background: nothing waits for them."""
        link = self.model.paths[tier].write
        work = sum(sizes) + len(sizes) * link.latency_s * link.bandwidth
        self.in_flight += 1
        self.write[tier].submit(work, self._written)

    def _written(self) -> None:
        self.in_flight -= 1

    def _spill(self, tier: str, spills: Sequence[tuple[int, int]]) -> None:
        """Copy one decision's chunks off the device, `(bytes written, device bytes freed)`
        each, as an engine does: issued in order on one copy stream, they land in that order,
        and each chunk's device memory is free once its own copy has landed. So a request
        waiting under pressure starts once the first `bytes_needed` are out, while the rest
        of the spill (the headroom) still copies."""
        link = self.model.paths[tier].write
        per_op = link.latency_s * link.bandwidth
        self.in_flight += 1
        freed = [(size, session, index) for _, size, session, index in spills]
        self.write[tier].submit_in_order(
            [written + per_op for written, *_ in spills], partial(self._spilled, freed)
        )

    def _spilled(self, freed: Sequence[tuple[int, SimSession, int]], part: int) -> None:
        """Chunk `part` of a spill landed: the device frees what it took there, which is more
        than was written for a chunk stored in a smaller form."""
        if part == len(freed) - 1:
            self.in_flight -= 1
        size, session, index = freed[part]
        self.pending_free -= size
        self.used -= size
        if index < len(session.tiers) and session.tiers[index] not in (None, "device"):
            self._keep_moved(session, index, size)
        self.epoch += 1
        self._kick()

    # -- scheduling ----------------------------------------------------------------------

    def _kick(self) -> None:
        if not self.busy:
            self._step()

    def _step(self) -> None:
        while True:
            self._admit()
            decodes = len(self.decoding)
            budget = self.deployment.max_batched_tokens - decodes
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
            and not self.in_flight
            and self._futile_epoch == self.epoch
        )

    def _unstick(self) -> None:
        """Prefetched requests behind the head hold the memory the head needs, and nothing
        runs that would free any: let the first one that fits go ahead (it frees its memory
        when it ends); if none fits, the head fails."""
        free = self.capacity - self.used
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
                self._commit(r, self._plan(r))
            need = r.reserve - r.device_base - r.allocated
            if need > self.capacity - self.used and not self._make_room(need):
                return
            self._take(self.waiting.popleft())

    def _take(self, r: SimRequest) -> None:
        """Admit `r`: reserve the rest of its context and start running it."""
        need = r.reserve - r.device_base - r.allocated
        self.used += need
        self._reuse_kept()
        r.allocated += need
        r.record.scheduled_s = self.loop.now
        self.prefilling.append(r)
        self.running += 1
        if r.phases and not r.loads_started:
            self._start_loads(r)

    def _make_room(self, need: int) -> bool:
        if self.capacity - self.used + self.pending_free >= need:
            return False  # spills in flight will free enough
        if self._futile_epoch == self.epoch:
            return False  # the policy could not help, and nothing changed since
        headroom = int(self.deployment.pressure_headroom * self.capacity)
        self._decide("pressure", min(need + headroom, self.capacity))
        if self.capacity - self.used >= need:
            return True
        self._futile_epoch = self.epoch
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
            self._share(r.session)
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
        self.used += sum(sizes) - (r.device_base + r.allocated)
        self._reuse_kept()
        session.reset(total, sizes, now)
        if self.write_through:
            self._write_through(session)
        self.running -= 1
        self._end_turn(r)

    def _fail(self, r: SimRequest, error: str) -> None:
        r.record.failed, r.record.error = True, error
        if r.committed:  # give back what admission took; loaded chunks stay on the device
            self.used -= r.allocated - r.load_bytes * r.loads_started
        self._end_turn(r)

    def _end_turn(self, r: SimRequest) -> None:
        session, now = r.session, self.loop.now
        if session.busy:
            session.turns[-1] = replace(session.turns[-1], finished=now)
            session.busy = session.active = False
            session.idle_since = now
            session.changed()
            self.epoch += 1
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
        self._decide("timer", 0)
        now = self.loop.now
        for session_id, s in list(self.tracked.items()):
            if not s.busy and not s.view().chunks and now - s.idle_since > self.track_s:
                del self.tracked[session_id]
                self.holding.forget(session_id)
                self._untracked.append(session_id)
        self._kick()

    def view(self, reason: Reason = "timer", bytes_needed: int = 0) -> PolicyView:
        tiers = [TierView("device", self.used - self.pending_free, self.capacity)]
        if self.store is not None:
            tiers += [
                TierView(
                    name,
                    tier.used_bytes - (self.copy_bytes if name == self.top_tier else 0),
                    tier.capacity_bytes,
                )
                for name, tier in self.store.tiers.items()
            ]
        waiting_bytes = sum(r.reserve - r.device_base - r.allocated for r in self.waiting)
        sessions = tuple(s.view() for s in self.tracked.values())
        # the index compares each session's view object with the last one it saw, which is
        # what the policy would do again: hand it the result
        changed = tuple(itertools.compress(sessions, map(self.holding.update, sessions)))
        left = tuple(sid for sid in self._untracked if sid not in self.tracked)
        self._untracked = []
        view = PolicyView(
            sessions,
            tuple(tiers),
            QueueView(len(self.waiting), math.ceil(waiting_bytes / self.bytes_per_token)),
            bytes_per_token=self.bytes_per_token,
            reason=reason,
            bytes_needed=bytes_needed,
            holding=self.holding.snapshot(),
            delta=ViewDelta(self._last_view, changed, left),
        )
        self._last_view = view.token
        return view

    def _decide(self, reason: Reason, bytes_needed: int) -> None:
        view = self.view(reason, bytes_needed)
        started = time.perf_counter()
        actions = self.policy.decide(view, self.loop.now)
        self.policy_s += time.perf_counter() - started
        self.metrics.record(view, actions)
        self.executor.run(actions)

    def _drop_chunk(self, session: SimSession, i: int) -> None:
        tier = session.tiers[i]
        if tier == "device":
            if session.copied[i]:
                self._uncopy(session, i)  # a drop frees the KV everywhere
            self.used -= session.sizes[i]
            self.epoch += 1
        elif tier is not None:
            self._forget_kept(session, i)
            self.store.delete(session.chunk(i).id)
            self.dropped[tier] += session.sizes[i]
            session.sizes[i] = session.full.pop(i, session.sizes[i])
        session.tiers[i], session.forms[i] = None, FULL  # recomputed, it is exact again
        session.changed()

    # -- shared prefixes ---------------------------------------------------------------

    def _share(self, session: SimSession) -> None:
        """Record the leading blocks a new conversation computed, for later conversations
        whose prompts start the same way. Only the first SHARED_BLOCKS: shared prefixes are
        system prompts and the like, and recording every block of 100,000 requests would
        not fit in memory."""
        for block in session.hash_ids[:SHARED_BLOCKS]:
            owner = self.block_owner.setdefault(block, session.session_id)
            if owner != session.session_id:
                self.block_owner[block] = SHARED

    def _shared_prefix(self, r: SimRequest) -> int:
        """Leading tokens of the prompt that other conversations computed: the engine's prefix
        cache finds them on the device (hot shared blocks are assumed to stay there). A block
        only this session computed is its own history, which the policy may have dropped."""
        session, count = r.session, 0
        for block in session.hash_ids[:SHARED_BLOCKS]:
            owner = self.block_owner.get(block)
            if owner is None or owner == session.session_id:
                break
            count += 1
        tokens = int(count * session.block_tokens)
        measured = self.histories.get(r.record.request_id)
        if measured is not None:
            tokens = min(tokens, measured)
        tokens = tokens // self.deployment.block_tokens * self.deployment.block_tokens
        return max(0, min(tokens, r.prompt - 1))

    # -- write-through copies ----------------------------------------------------------

    def _write_through(self, session: SimSession) -> None:
        """Copy the full chunks that have no copy yet to the top tier, in one background
        write (the partial last chunk changes with the next turn, so it is not copied)."""
        top = self.store.tiers[self.top_tier]
        written = []
        for i, size in enumerate(session.sizes):
            if session.copied[i] or size != self.full_chunk_bytes:
                continue
            self._reclaim(top, size)
            if not top.fits(size):
                break  # the tier is full of chunks the policies placed there
            self.store.put(session.chunk(i), Payload.sized(size), tier=self.top_tier)
            self._add_copy(session, i)
            written.append(size)
        if written:
            self._write(self.top_tier, written)

    def _add_copy(self, session: SimSession, i: int) -> None:
        session.copied[i] = True
        self.copies[(session.session_id, i)] = session
        self.copy_bytes += session.sizes[i]

    def _forget_copy(self, session: SimSession, i: int) -> None:
        session.copied[i] = False
        del self.copies[(session.session_id, i)]
        self.copy_bytes -= session.sizes[i]

    def _uncopy(self, session: SimSession, i: int) -> None:
        self._forget_copy(session, i)
        self.store.delete(session.chunk(i).id)
        self.dropped[self.top_tier] += session.sizes[i]

    def _reclaim(self, tier: SizeOnlyTier, size: int) -> None:
        """Drop the oldest copies until `size` bytes fit: they only save a future transfer."""
        while not tier.fits(size) and self.copies:
            session_id, i = next(iter(self.copies))
            self._uncopy(self.copies[(session_id, i)], i)

    # -- pages kept on the device after a move (keep_moved) ------------------------------

    def _keep_moved(self, session: SimSession, i: int, size: int) -> None:
        if self.deployment.keep_moved:
            key = (session.session_id, i)
            self.kept[key] = size
            self.kept_bytes += size
            self._kept_order.add(key, (session.access[i], -i))
            self._reuse_kept()

    def _forget_kept(self, session: SimSession, i: int) -> None:
        key = (session.session_id, i)
        if key in self.kept:
            self.kept_bytes -= self.kept.pop(key)
            self._kept_order.discard(key)

    def _reuse_kept(self) -> None:
        """The pool takes kept pages back, least recently used first, as memory is allocated."""
        while self.kept and self.used + self.kept_bytes > self.capacity:
            self.kept_bytes -= self.kept.pop(self._kept_order.pop_oldest())

    def _revive_kept(self, session: SimSession) -> None:
        """A turn arrives: its chunks whose device pages are still kept are on the device
        again, with no load. A full-precision copy in the top tier stays as a clean copy
        (moving the chunk down again then costs no transfer); any other stored copy goes."""
        for i, tier in enumerate(session.tiers):
            key = (session.session_id, i)
            if key not in self.kept:
                continue
            size = self.kept.pop(key)
            self.kept_bytes -= size
            self._kept_order.discard(key)
            if tier is None or tier == "device":
                continue
            stored_full = session.forms[i] == FULL and i not in session.full
            if tier == self.top_tier and stored_full and size == self.full_chunk_bytes:
                self._add_copy(session, i)
            else:  # the device holds it again: the stored copy is freed unread
                self.store.delete(session.chunk(i).id)
                self.dropped[tier] += session.sizes[i]
            session.tiers[i], session.forms[i] = "device", FULL
            session.sizes[i] = session.full.pop(i, session.sizes[i])
            self.used += size
        session.changed()

    # -- results -------------------------------------------------------------------------

    def occupancy(self) -> dict[str, int]:
        used = {"device": self.used}
        if self.store is not None:
            used |= {name: tier.used_bytes for name, tier in self.store.tiers.items()}
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
        if self.store is None:
            return {}
        out = {}
        for name, tier in self.store.tiers.items():
            stats = tier.stats
            out[name] = {
                "capacity_bytes": tier.capacity_bytes,
                "bytes_written": stats.bytes_written,
                "bytes_read": stats.bytes_read,
                "bytes_dropped": self.dropped[name],
                "resident_bytes": tier.used_bytes,
                "writes": stats.writes,
                "reads": stats.reads,
            }
        return out
