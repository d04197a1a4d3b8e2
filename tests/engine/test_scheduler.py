"""Scheduling policy: chunked prefill never stalls decodes; preemption is recompute style."""

from __future__ import annotations

from kvtier.engine import SamplingParams
from kvtier.engine.block_pool import BlockPool
from kvtier.engine.kv_cache_manager import KVCacheManager
from kvtier.engine.request import FinishReason, Request, RequestStatus
from kvtier.engine.scheduler import Scheduler

from .conftest import random_prompt


def _request(request_id: str, prompt: list[int], max_tokens: int = 100) -> Request:
    return Request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), b"ns")


def _complete(out) -> None:
    """Mark the step's work computed and give finished prompts a next token."""
    for request, n in out.scheduled:
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(7)


def _decoding_pair_and_long_prompt(priority: str) -> tuple[Scheduler, Request]:
    scheduler = Scheduler(KVCacheManager(BlockPool(200), 16), 32, 8, priority)
    decodes = [_request("a", list(range(1, 11))), _request("b", list(range(11, 21)))]
    for r in decodes:
        scheduler.add(r)
    _complete(scheduler.schedule())  # both prompts in one step; each now has a token
    long_prompt = _request("long", list(range(100, 400)))
    scheduler.add(long_prompt)
    return scheduler, long_prompt


def test_decode_first_schedules_running_decodes_every_step():
    scheduler, long_prompt = _decoding_pair_and_long_prompt("decode_first")
    steps = 0
    while long_prompt.num_output_tokens == 0:
        out = scheduler.schedule()
        batch = dict((r.request_id, n) for r, n in out.scheduled)
        assert batch["a"] == 1 and batch["b"] == 1, batch
        assert out.num_batched_tokens <= 32
        _complete(out)
        steps += 1
    assert steps == 10  # 300 prompt tokens in chunks of the 30 tokens decodes leave


def test_prefill_first_lets_the_prefill_take_the_budget():
    scheduler, _ = _decoding_pair_and_long_prompt("prefill_first")
    out = scheduler.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("long", 32)]


def test_long_prefill_does_not_stall_decodes_in_the_engine(chunked_engine):
    """Real model, 32-token budget: two decoding requests each get a token on every step
    while a 300-token prompt is prefilled in chunks."""
    engine = chunked_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a = engine.add_request(random_prompt(12, 1), params)
    b = engine.add_request(random_prompt(14, 2), params)
    engine.step()  # both prompts fit one step
    long_id = engine.add_request(random_prompt(300, 3), SamplingParams(temperature=0, max_tokens=1))
    steps = 0
    while True:
        outs = {o.request_id: o for o in engine.step()}
        steps += 1
        assert len(outs[a].new_token_ids) == 1 and len(outs[b].new_token_ids) == 1
        if long_id in outs:
            break
    assert steps == 10
    for request_id in (a, b):
        engine.abort(request_id)


def test_preemption_requeues_the_newest_at_the_front_and_it_reuses_its_blocks():
    pool = BlockPool(6)  # 24 tokens of 4
    scheduler = Scheduler(KVCacheManager(pool, 4), 64, 8)
    old, new = _request("old", list(range(1, 10))), _request("new", list(range(20, 29)))
    waiting = _request("waiting", [5])
    for r in (old, new):
        scheduler.add(r)
    _complete(scheduler.schedule())  # 9 + 9 tokens: 3 blocks each, pool full
    for r in (old, new):
        scheduler.kv.register_full_blocks(r)
    scheduler.add(waiting)
    preempted = []
    while not preempted:
        out = scheduler.schedule()
        preempted = out.preempted
        _complete(out)
        for r, _ in out.scheduled:
            scheduler.kv.register_full_blocks(r)
    assert [r.request_id for r in preempted] == ["new"]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert scheduler.waiting[0] is new  # ahead of the request that was already waiting
    while new.status is not RequestStatus.RUNNING:
        _complete(scheduler.schedule())
    # Re-admission found its full blocks still cached: only the tail is recomputed.
    assert new.num_computed_tokens >= 8


def test_max_num_seqs_caps_the_running_set():
    scheduler = Scheduler(KVCacheManager(BlockPool(100), 16), 512, max_num_seqs=3)
    for i in range(5):
        scheduler.add(_request(str(i), [1, 2, 3]))
    out = scheduler.schedule()
    assert len(out.scheduled) == 3 and len(scheduler.waiting) == 2


# ----- tenants share the engine ---------------------------------------------------------


def _tenant_request(request_id: str, tenant: str | None, length: int = 3) -> Request:
    return Request(
        request_id,
        list(range(1, length + 1)),
        SamplingParams(temperature=0, max_tokens=100),
        b"ns",
        tenant=tenant,
    )


def _admission_order(scheduler: Scheduler, steps: int) -> list[str]:
    admitted = []
    for _ in range(steps):
        out = scheduler.schedule()
        admitted += [r.request_id for r in out.admitted]
        _complete(out)
        for request in list(scheduler.running):
            if request.num_output_tokens >= 2:  # short answers: slots come free
                scheduler.finish(request, FinishReason.LENGTH)
    return admitted


def test_one_tenant_is_admitted_first_come_first_served():
    scheduler = Scheduler(KVCacheManager(BlockPool(100), 16), 512, max_num_seqs=2)
    for i in range(6):
        scheduler.add(_tenant_request(f"a{i}", "a"))
    assert _admission_order(scheduler, 12) == [f"a{i}" for i in range(6)]


def test_a_tenant_queued_behind_a_flood_is_admitted_at_the_next_free_slot():
    scheduler = Scheduler(KVCacheManager(BlockPool(100), 16), 512, max_num_seqs=2)
    for i in range(6):
        scheduler.add(_tenant_request(f"a{i}", "a"))
    scheduler.add(_tenant_request("b0", "b"))
    # a0 arrived first; then b has been served less than a, whatever a's queue
    assert _admission_order(scheduler, 12)[:3] == ["a0", "b0", "a1"]


def test_a_long_prefill_yields_the_step_budget_to_another_tenant():
    scheduler = Scheduler(KVCacheManager(BlockPool(100), 16), 32, max_num_seqs=8)
    long_prompt = _tenant_request("long", "a", 300)
    scheduler.add(long_prompt)
    _complete(scheduler.schedule())  # its first 32-token chunk
    short = _tenant_request("short", "b", 10)
    scheduler.add(short)  # counted as served as much as a so far: no credit, no debt
    steps = 0
    while short.num_output_tokens == 0:
        out = scheduler.schedule()
        _complete(out)
        steps += 1
    # one more chunk of a's, then b's prompt and the rest of the budget to a; not the eight
    # steps a's prefill has left
    assert steps == 2
    assert dict((r.request_id, n) for r, n in out.scheduled) == {"short": 10, "long": 22}


def test_a_tenant_flooding_the_engine_does_not_hold_another_in_the_queue(chunked_engine):
    """Real model, two sequences at a time: tenant b's request, sent after eight of tenant
    a's, starts at the first free slot and finishes long before a's queue drains."""
    engine = chunked_engine
    engine.scheduler.max_num_seqs = 2
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    try:
        flood = [engine.add_request(random_prompt(40, i), params, tenant="a") for i in range(8)]
        other = engine.add_request(random_prompt(40, 99), params, tenant="b")
        finished: list[str] = []
        while engine.has_unfinished_requests():
            finished += [o.request_id for o in engine.step() if o.finished]
    finally:
        engine.scheduler.max_num_seqs = engine.config.max_num_seqs
    assert finished.index(other) <= 2  # FCFS: last, after all eight
    assert set(finished) == {*flood, other}
