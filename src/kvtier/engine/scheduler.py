"""Continuous batching with chunked prefill under a per-step token budget.

Each step the scheduler hands out at most `max_num_batched_tokens` tokens of work:
- a running decode needs 1 token; a prompt (or a preempted request being recomputed) needs
  the rest of its uncomputed tokens and gets a chunk of whatever budget is left, so a long
  prefill spreads over several steps instead of stalling everyone's decode;
- `decode_first` (default) serves running decodes before any prefill chunk; `prefill_first`
  serves prefill chunks and new admissions first and gives decodes what is left.
When the pool cannot hold a request's next tokens, the most recently admitted request that
is not yet scheduled this step is preempted, recompute style: its blocks are released (its
full blocks stay in the prefix cache, so re-admission usually hits them) and it goes back to
the front of the waiting queue. A connector (`kvtier.engine.connector`) hears of it first, and
may copy the blocks out so that re-admission loads them instead of recomputing them.
With a connector, admission asks it how many prompt tokens after the device hits it can load;
the scheduler allocates their blocks with the prefill's and hands them over. A prompt whose
stored history resumes after a recomputed run (a chunk dropped from the tiers, or the front of
a bidirectional restore plan) has each prefill chunk stopped where the connector's next load
starts; there the device prefix lookup goes on, then the connector's loads, the same way.
Across tenants (`Request.tenant`) the prefill work of a step (running prefills' next chunks
and admissions) goes to the tenant the engine has served the fewest tokens first
(`fair_share.py`), so one tenant's flood or long prompt does not hold another's requests in
the queue. With one tenant that is the order above: running prefills, then the waiting
queue first come, first served.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvtier.engine.connector import KVConnector
from kvtier.engine.fair_share import FairShare
from kvtier.engine.kv_cache_manager import KVCacheManager, cdiv
from kvtier.engine.request import FinishReason, Request, RequestStatus


@dataclass
class SchedulerOutput:
    """The work of one step, in scheduling order."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    admitted: list[Request] = field(default_factory=list)  # first admission this step
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler itself

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        priority: str = "decode_first",
    ) -> None:
        self.kv = kv_manager
        self.block_size = kv_manager.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.priority = priority
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.connector: KVConnector | None = None  # set by Engine.set_connector
        self.shares = FairShare()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.shares.added(request.tenant)
        self.waiting.append(request)
        self.shares.queued(request.tenant)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = [self.max_num_batched_tokens]
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        if self.priority == "decode_first":
            self._schedule_running(decodes, budget, out)
            self._schedule_prefills(prefills, budget, out)
        else:
            self._schedule_prefills(prefills, budget, out)
            self._schedule_running(decodes, budget, out)
        return out

    def _schedule_prefills(
        self, prefills: list[Request], budget: list[int], out: SchedulerOutput
    ) -> None:
        """Running prefills' next chunks and admissions from the waiting queue, one piece of
        work at a time for the tenant served the fewest tokens (ties: a running prefill
        before an admission, then the queue's order). Admission stops for the step once a
        request was preempted or one does not fit while others run."""
        pending: dict[str | None, deque[Request]] = {}
        for request in prefills:
            pending.setdefault(request.tenant, deque()).append(request)
        admitting = True
        heads: dict[str | None, Request] | None = None  # read again only after an admission
        while budget[0] > 0:
            admitting = admitting and not out.preempted and len(self.running) < self.max_num_seqs
            if not admitting:
                heads = {}
            elif heads is None:
                heads = self._waiting_heads()
            order = {t: (self.shares.served[t], 0, 0) for t, queue in pending.items() if queue}
            for position, tenant in enumerate(heads):
                order.setdefault(tenant, (self.shares.served[tenant], 1, position))
            if not order:
                return
            tenant = min(order, key=order.__getitem__)
            if pending.get(tenant):
                self._schedule_running([pending[tenant].popleft()], budget, out)
            else:
                admitting, heads = self._admit(heads[tenant], budget, out), None

    def _waiting_heads(self) -> dict[str | None, Request]:
        """Each waiting tenant's first request, in queue order."""
        heads: dict[str | None, Request] = {}
        for request in self.waiting:
            if request.tenant not in heads:
                heads[request.tenant] = request
                if len(heads) == len(self.shares.num_waiting):
                    break
        return heads

    def _schedule_running(
        self, order: list[Request], budget: list[int], out: SchedulerOutput
    ) -> None:
        scheduled = {r.request_id for r, _ in out.scheduled}
        for request in order:
            if budget[0] == 0:
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self.connector is not None and request.num_tokens - request.num_computed_tokens > 1:
                self._resume_history(request)
            n = self._prefill_limit(request, budget[0], request.num_computed_tokens)
            while not self.kv.allocate(request, n):
                victim = self._pick_victim(exclude=scheduled)
                if victim is None or victim is request:
                    self._out_of_memory(request, out)
                    break
                self._preempt(victim, out)
            else:
                self._scheduled(request, n, budget, out)
                scheduled.add(request.request_id)

    def _scheduled(self, request: Request, n: int, budget: list[int], out: SchedulerOutput) -> None:
        out.scheduled.append((request, n))
        budget[0] -= n
        self.shares.charge(request.tenant, n)

    def _prefill_limit(self, request: Request, budget: int, computed: int) -> int:
        """Tokens to compute this step: the rest, within the budget, and never past the point
        where the connector will load the KV that follows (a restore after a recomputed run)."""
        n = min(request.num_tokens - computed, budget)
        boundary = (
            None if self.connector is None else self.connector.next_load_position(request, computed)
        )
        if boundary is not None:
            n = min(n, boundary - computed)
        return n

    def _pick_victim(self, exclude: set[str]) -> Request | None:
        """The most recently admitted running request not already scheduled this step."""
        for request in reversed(self.running):
            if request.request_id not in exclude:
                return request
        return None

    def _out_of_memory(self, request: Request, out: SchedulerOutput) -> None:
        # Nothing left to preempt but this request. If others still hold blocks it waits
        # for them (preempt itself); if it is alone, the pool can never fit it: end it.
        if len(self.running) > 1:
            self._preempt(request, out)
        else:
            self._end_oversized(request, out)

    def _end_oversized(self, request: Request, out: SchedulerOutput) -> None:
        request.error = (
            f"KV pool exhausted: {request.num_tokens} tokens need "
            f"{cdiv(request.num_tokens, self.block_size)} blocks, the pool has "
            f"{self.kv.block_pool.num_blocks}"
        )
        self.finish(request, FinishReason.LENGTH)
        out.finished.append(request)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        if self.connector is not None:
            self.connector.on_preempted(request)
        self.kv.free(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.shares.queued(request.tenant)
        out.preempted.append(request)
        self.num_preemptions += 1

    def _admit(self, request: Request, budget: list[int], out: SchedulerOutput) -> bool:
        """Start a waiting request with the first chunk of its prefill. False when the pool
        has no room for it while others run: it waits for them to release blocks, and
        nothing is admitted before it (no starving a large request)."""
        cached = self.kv.find_cached_prefix(request)
        num_cached_tokens = len(cached) * self.block_size
        promised = loaded = self._loadable(request, num_cached_tokens)
        n = self._prefill_limit(request, budget[0], num_cached_tokens + loaded)
        if not self.kv.allocate(request, n, cached, loaded):
            loaded = 0
            n = self._prefill_limit(request, budget[0], num_cached_tokens)
            if not self.kv.allocate(request, n, cached):
                if self.running:
                    return False
                # Nobody else holds blocks, so the pool can never fit it (a preempted
                # request whose output grew past the pool): end it rather than spin.
                self._end_oversized(request, out)
                return True
        self._dequeue(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached_tokens
        self._hand_over(request, promised, loaded)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = request.num_computed_tokens
            request.metrics.first_scheduled_time = time.perf_counter()
            self.kv.record_prefix_lookup(request.num_prompt_tokens, request.num_cached_tokens)
            out.admitted.append(request)
        self._scheduled(request, n, budget, out)
        return True

    def _dequeue(self, request: Request) -> None:
        self.waiting.remove(request)  # the head but for another tenant's turn: O(1) mostly
        self.shares.dequeued(request.tenant)

    def _loadable(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens the connector can load from `num_computed_tokens` on (0 without one)."""
        if self.connector is None:
            return 0
        return self.connector.num_loadable_tokens(request, num_computed_tokens)

    def _hand_over(self, request: Request, promised: int, loaded: int) -> None:
        """Give the connector the blocks allocated for the `promised` tokens it will load
        (none when there was no room for them, `loaded` = 0: it forgets those loads) and
        count them as computed; the engine loads them before the forward pass, or rolls the
        request back if a load fails."""
        if not promised:
            return
        block_ids = self.kv.loaded_blocks(request, loaded) if loaded else []
        self.connector.on_blocks_allocated(request, block_ids)
        request.num_computed_tokens += loaded

    def _resume_history(self, request: Request) -> None:
        """At the position where the connector's next load starts (the prefill has just
        recomputed the run before it): the blocks there still cached on the device are
        taken, then the connector's loads after them, if the pool has room for them."""
        position = request.num_computed_tokens
        if self.connector.next_load_position(request, position - 1) != position:
            return
        cached = self.kv.find_cached_prefix(request, position // self.block_size)
        promised = loaded = self._loadable(request, position + len(cached) * self.block_size)
        if not self.kv.allocate(request, 0, cached, loaded):
            loaded = 0
            if not self.kv.allocate(request, 0, cached):
                cached = []
        request.num_computed_tokens += len(cached) * self.block_size
        self._hand_over(request, promised, loaded)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request wherever it is and release its blocks."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self._dequeue(request)
        if self.connector is not None:
            self.connector.on_request_finished(request)  # may copy its blocks out first
        self.kv.free(request)
        if self.requests.pop(request.request_id, None) is not None:
            self.shares.finished(request.tenant)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.metrics.finished_time = time.perf_counter()
