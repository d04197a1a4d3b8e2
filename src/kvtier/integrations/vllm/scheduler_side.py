"""SchedulerSide: the connector's bookkeeping in vLLM's scheduler, with no tiers in reach.

kvtier's store lives with the worker (which holds the KV tensors). The scheduler side turns
vLLM's scheduler calls into the worker's messages (`messages.py`) and answers vLLM from the
worker's replies:

- a new request is sent as a `Lookup`; while its answer is not back, vLLM is told "ask again"
  (`None`), so vLLM schedules it one step later (that step costs no forward when nothing
  else runs). When the worker says nothing could hit (an empty store), the answer is 0 at once.
- `allocated`: the block ids vLLM gave the promised tokens (`Allocation`).
- every step, each scheduled request whose computed tokens reach the end of a chunk sends a
  `Save` of those chunks with its block ids: the worker copies them out after the forward.
  Saving while the request runs means `request_finished` never delays vLLM's freeing.
  With vLLM's KV events on (`send_block_hashes`), a save carries vLLM's hashes of those
  chunks' blocks: the worker announces what its tiers hold by them (`tier_events.py`).
- `finished`: a `Finish` (sessions, prefix chains, the policy's view), with the blocks vLLM
  keeps cached after it (`idle_blocks.py`).
- `waiting_tokens`: the requests vLLM has not admitted yet, for the policy's pressure trigger.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvtier.integrations.vllm.messages import (
    Allocation,
    Finish,
    Lookup,
    Save,
    StepMessages,
    WorkerReply,
)
from kvtier.integrations.vllm.requests import RequestRecord, VllmRequest


@dataclass
class _Tracked:
    request: VllmRequest
    tokens_sent: int  # how many of its tokens the worker has
    hashes_sent: int = 0  # how many of vLLM's block hashes the worker has
    chunks_saved: int = 0
    asked_at: int | None = None  # the vLLM hit of the lookup in flight
    answer: tuple[int, int] | None = None
    sources: dict[str, int] | None = None  # the answer's tokens per tier
    admitted: bool = False


class SchedulerSide:
    def __init__(self, block_size: int, chunk_tokens: int, send_block_hashes: bool = False) -> None:
        self.block_size = block_size
        self.send_block_hashes = send_block_hashes
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = chunk_tokens // block_size
        self.may_hit = True  # until the worker's first reply says otherwise
        self._requests: dict[str, _Tracked] = {}
        self._messages = StepMessages()

    def on_new_request(self, request: VllmRequest) -> None:
        record = RequestRecord.of(request)
        self._requests[request.request_id] = _Tracked(request, len(record.all_token_ids))
        self._messages.lookups.append(Lookup(record, 0, ask=False))

    def matched_tokens(self, request: VllmRequest, num_computed_tokens: int) -> int | None:
        tracked = self._requests.get(request.request_id)
        if tracked is None:  # a vLLM that skipped on_new_request
            self.on_new_request(request)
            tracked = self._requests[request.request_id]
        readmitted = tracked.admitted
        if readmitted:  # preempted and asked again from scratch
            tracked.admitted, tracked.answer, tracked.asked_at = False, None, None
        if tracked.answer is not None and tracked.answer[0] == num_computed_tokens:
            return tracked.answer[1]
        if not self.may_hit and not readmitted:
            return 0
        if tracked.asked_at != num_computed_tokens:
            tracked.asked_at = num_computed_tokens
            record = RequestRecord.of(request)
            tracked.tokens_sent = len(record.all_token_ids)
            tracked.hashes_sent = 0  # the worker's record is replaced: hashes sent again
            self._messages.lookups.append(
                Lookup(record, num_computed_tokens, ask=True, readmitted=readmitted)
            )
        return None

    def allocated(
        self, request: VllmRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            return
        tracked.admitted = True
        hit = tracked.answer[0] if tracked.answer is not None else request.num_computed_tokens
        first = hit // self.block_size
        ids = block_ids[first : first + num_external_tokens // self.block_size]
        self._messages.allocations.append(
            Allocation(request.request_id, hit, num_external_tokens, ids)
        )
        tracked.answer = None

    def step(
        self, num_scheduled_tokens: Mapping[str, int], block_ids_of: Callable[[str], list[int]]
    ) -> StepMessages:
        """This step's messages: what was queued, and the chunks this step's forward fills."""
        for request_id, scheduled in num_scheduled_tokens.items():
            tracked = self._requests.get(request_id)
            if tracked is None:
                continue
            request = tracked.request
            done = (request.num_computed_tokens + scheduled) // self.chunk_tokens
            if done <= tracked.chunks_saved:
                continue
            tokens = list(request.all_token_ids[tracked.tokens_sent : done * self.chunk_tokens])
            hashes: list[bytes] = []
            # vLLM hashes every full block of its block size (one hash per block id here);
            # hashes of another granularity would name other blocks: none are sent then
            full_blocks = len(request.all_token_ids) // self.block_size
            if self.send_block_hashes and len(request.block_hashes) == full_blocks:
                end = done * self.blocks_per_chunk
                hashes = list(request.block_hashes[tracked.hashes_sent : end])
            self._messages.saves.append(
                Save(
                    request_id,
                    tracked.chunks_saved,
                    done,
                    block_ids_of(request_id)[: done * self.blocks_per_chunk],
                    tracked.tokens_sent,
                    tokens,
                    tracked.hashes_sent,
                    hashes,
                )
            )
            tracked.tokens_sent += len(tokens)
            tracked.hashes_sent += len(hashes)
            tracked.chunks_saved = done
        messages, self._messages = self._messages, StepMessages()
        return messages

    def finished(self, request: VllmRequest, cached_block_ids: list[int] | None = None) -> None:
        tracked = self._requests.pop(request.request_id, None)
        if tracked is None:
            return
        computed = request.num_computed_tokens
        tokens = list(request.all_token_ids[tracked.tokens_sent : computed])
        cached = cached_block_ids or []
        self._messages.finishes.append(
            Finish(request.request_id, computed, tracked.tokens_sent, tokens, cached)
        )

    def waiting_tokens(self) -> tuple[int, ...]:
        """The tokens of each request vLLM has not admitted yet, in arrival order (vLLM's
        first-come-first-served queue)."""
        return tuple(
            len(t.request.all_token_ids) for t in self._requests.values() if not t.admitted
        )

    def hit_sources(self, request: VllmRequest, num_external_tokens: int) -> dict[str, int]:
        """The tiers the request's promised tokens load from (asked once, after its
        allocation); empty when unknown or when they do not add up to what vLLM took."""
        tracked = self._requests.get(request.request_id)
        if tracked is None or tracked.sources is None:
            return {}
        sources, tracked.sources = tracked.sources, None
        return sources if sum(sources.values()) == num_external_tokens else {}

    def reset(self) -> None:
        """vLLM asked to reset the connector's cache: the worker drops every stored chunk
        before the next step's lookups; answers given before it may name chunks gone by then
        (their loads fail and are recomputed)."""
        self._messages.reset = True

    def on_reply(self, reply: WorkerReply) -> None:
        self.may_hit = reply.may_hit
        for request_id, answer in reply.answers.items():
            tracked = self._requests.get(request_id)
            if tracked is not None and tracked.asked_at == answer[0]:
                tracked.answer = answer
                tracked.sources = reply.sources.get(request_id)
