"""The simulator against closed forms and its own bookkeeping: one request costs exactly what
the step model says, a resumed turn waits for its loads, runs are deterministic, every request
is accounted for and every byte written to a tier leaves it or is still there."""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass
from typing import ClassVar

import pytest

from kvtier.policy.actions import Action, Drop, Move
from kvtier.policy.base import RetentionPolicy
from kvtier.policy.config import PolicyConfig
from kvtier.policy.cost_model import CostModel
from kvtier.policy.ledger import form_bytes
from kvtier.policy.view import PolicyView, SessionView
from kvtier.policy.view_diff import diff
from kvtier.results.report import to_document
from kvtier.sim.quiet_gc import GC_YOUNG_THRESHOLD
from kvtier.sim.simulator import simulate
from kvtier.sim.step_model import StepModel
from kvtier.workload.generator import generate
from kvtier.workload.model import flatten
from kvtier.workload.presets import preset_config
from tests.sim.conftest import GB, deployment, request


@dataclass
class ToHost(RetentionPolicy):
    """Moves every idle chunk off the device to host at once (a test policy)."""

    name = "to-host"

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        return [Move(s.session_id, None, "host") for s in view.candidates(now)]


@dataclass
class ToHostInt8(RetentionPolicy):
    """As ToHost, quantized to INT8 on the way."""

    name = "to-host-int8"

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        return [Move(s.session_id, None, "host", "int8") for s in view.candidates(now)]


@dataclass
class SpillAllUnderPressure(RetentionPolicy):
    """Under pressure only, moves every idle chunk off the device to host (a test policy:
    it spills far more than the waiting request needs, as the engine's headroom does)."""

    name = "spill-all-under-pressure"

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        if view.reason != "pressure":
            return []
        return [Move(s.session_id, None, "host") for s in view.candidates(now)]


@dataclass
class SeesCollector(RetentionPolicy):
    """Records the garbage collector's settings while the run is on (a test policy)."""

    name = "sees-collector"
    seen: ClassVar[list[tuple[tuple[int, ...], int]]] = []

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        self.seen.append((gc.get_threshold(), gc.get_freeze_count()))
        return []


def policy(name: str, **fields) -> PolicyConfig:
    return PolicyConfig(name=name, **fields)


def moved_then_resumed(dep, mover: str):
    """A 4,096-token first turn (16 chunks of 256) that the test policy `mover` moves off the
    device on its 5 s timer, then a turn 600 s later whose prompt extends it by 104 tokens."""
    first = request("s", 0, 0.0, 4000, 96)
    second = request("s", 1, 600.0, 4200, 10, hash_ids=tuple(range(4200 // 16)))
    config = policy(f"tests.sim.test_simulator:{mover}", interval_s=5.0)
    return simulate([first, second], dep, config)


def test_one_request_costs_what_the_step_model_says(small):
    model = StepModel(small.profile, small.geometry, small.tp)
    result = simulate([request("s", 0, 0.0, 3000, 4)], small, policy("retain"))
    [record] = result.run.requests
    assert record.ttft_s == model.prefill_s(3000)  # one step: the whole prompt fits the budget
    decode = [model.step_s(1, 3001 + i) for i in range(3)]
    assert record.e2el_s == pytest.approx(record.ttft_s + sum(decode), rel=1e-12)
    assert record.max_itl_s == pytest.approx(max(decode), rel=1e-12)
    assert record.restored_tokens == {} and record.turn_kind == "new"


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget(small):
    model = StepModel(small.profile, small.geometry, small.tp)
    result = simulate([request("s", 0, 0.0, 20_000, 1)], small, policy("retain"))
    chunks = [(8192, 0), (8192, 8192), (3616, 16384)]
    expected = sum(model.prefill_s(tokens, start) for tokens, start in chunks)
    assert result.run.requests[0].ttft_s == pytest.approx(expected, rel=1e-12)


def test_a_resumed_turn_waits_for_its_loads_then_prefills_only_the_new_tokens(small):
    model = StepModel(small.profile, small.geometry, small.tp)
    result = moved_then_resumed(small, "ToHost")
    resumed = result.run.requests[1]
    assert resumed.turn_kind == "resumed"
    # the restore planner (Cake's bidirectional plan) recomputes chunk 0 while the link loads
    # chunks 15..1; the new 104 tokens follow once both are done
    assert resumed.restored_tokens == {"recomputed": 256, "host": 3840}
    chunk_bytes = 256 * small.bytes_per_token
    loads = 15 * model.transfer_s(chunk_bytes, "host")
    restore = max(model.prefill_s(256, 0), loads)
    assert resumed.ttft_s == pytest.approx(restore + model.prefill_s(104, 4096), rel=1e-9)
    host = result.run.tiers["host"]
    # the first turn's 16 chunks went to host; 15 came back, chunk 0 was dropped for its
    # recompute, and the second turn's KV went to host in turn
    assert (host.bytes_read, host.bytes_dropped) == (15 * chunk_bytes, chunk_bytes)
    assert host.resident_bytes == small.kv_bytes(4210)
    assert result.run.decisions["demote"]["device"] == 16 + 17


@pytest.mark.parametrize("keep_moved", [False, True])
def test_a_resumed_turn_finds_its_moved_kv_on_the_device_while_its_pages_are_kept(keep_moved):
    """The timer moves the first turn's 16 chunks to host. With kept pages (as vLLM's prefix
    cache keeps freed blocks) nothing reused them by the time the turn resumes, so it loads
    nothing; the host copies stay as clean copies, and moving those chunks down again after
    the second turn writes only its new, partial chunk."""
    dep = deployment(keep_moved=keep_moved)
    model = StepModel(dep.profile, dep.geometry, dep.tp)
    result = moved_then_resumed(dep, "ToHost")
    resumed = result.run.requests[1]
    host = result.run.tiers["host"]
    chunk_bytes = dep.kv_bytes(256)
    assert host.resident_bytes == dep.kv_bytes(4210)
    if keep_moved:
        assert resumed.restored_tokens == {"device": 4096}
        assert resumed.ttft_s == pytest.approx(model.prefill_s(104, 4096), rel=1e-9)
        assert (host.bytes_read, host.bytes_dropped) == (0, 0)
        assert host.bytes_written == dep.kv_bytes(4210)  # 16 chunks once, then the 17th
    else:
        assert resumed.restored_tokens == {"recomputed": 256, "host": 3840}
        assert resumed.ttft_s > model.prefill_s(104, 4096) + 0.01
        assert host.bytes_read == 15 * chunk_bytes


def test_kept_pages_are_reused_tail_first_when_the_pool_needs_them():
    """a's 16 chunks are moved to host and their pages kept; b then takes more of the pool
    than is left beside them, so the pool reuses a's kept pages, whole chunks from the tail
    (as a prefix cache's LRU frees a request's blocks), and no more. When a resumes, its
    head is on the device and the tail loads from host."""
    a_bytes = deployment().kv_bytes(4096)
    dep = deployment(device_kv_bytes=a_bytes * 3 // 2, keep_moved=True)
    requests = [
        request("a", 0, 0.0, 4000, 96),
        request("b", 0, 100.0, 4000, 1),
        request("a", 1, 600.0, 4200, 10, hash_ids=tuple(range(4200 // 16))),
    ]
    config = policy("tests.sim.test_simulator:ToHost", interval_s=5.0)
    resumed = simulate(requests, dep, config).run.requests[2]
    chunk_bytes = dep.kv_bytes(256)
    excess = dep.kv_bytes(4001) + a_bytes - dep.device_kv_bytes
    reused = -(-excess // chunk_bytes)
    assert 0 < reused < 16
    assert resumed.restored_tokens == {"device": (16 - reused) * 256, "host": reused * 256}


def test_a_chunk_moved_as_int8_holds_fewer_bytes_and_pays_its_decode_on_restore(small):
    model = StepModel(small.profile, small.geometry, small.tp)
    cost = small_cost_model(small)
    result = moved_then_resumed(small, "ToHostInt8")
    resumed = result.run.requests[1]
    chunk_bytes = 256 * small.bytes_per_token
    stored = form_bytes(chunk_bytes, "full", "int8")
    recomputed = resumed.restored_tokens.get("recomputed", 0)
    loaded = resumed.restored_tokens["host"]
    assert recomputed + loaded == 4096 and recomputed % 256 == 0
    per_chunk = model.transfer_s(stored, "host") + cost.decode_s(chunk_bytes, "int8")
    restore = loaded // 256 * per_chunk
    if recomputed:  # the planner's front chunks, recomputed while the rest loads
        restore = max(model.prefill_s(recomputed, 0), restore)
    assert resumed.ttft_s == pytest.approx(restore + model.prefill_s(104, 4096), rel=1e-9)
    host = result.run.tiers["host"]
    assert host.bytes_read == loaded // 256 * stored  # the smaller form moved, not the full one
    leaves = host.bytes_read + host.bytes_dropped + host.resident_bytes
    assert host.bytes_written == leaves
    assert host.resident_bytes < small.kv_bytes(4210) * 0.6
    assert result.forms["restored_tokens"] == {"int8": loaded}
    decode = result.forms["codec_s"]["decode"]
    assert decode == pytest.approx(loaded // 256 * cost.decode_s(chunk_bytes, "int8"))
    assert result.forms["codec_s"]["encode"] > 0


def small_cost_model(dep):
    return CostModel(StepModel(dep.profile, dep.geometry, dep.tp).cost_profile())


@pytest.mark.parametrize("write_through", [False, True])
def test_write_through_makes_a_demotion_under_pressure_free(write_through):
    """Session a's 4,096 tokens fill two thirds of the pool; b needs more than the rest, so
    offload demotes a's oldest chunks to host. Without write-through b waits for that copy;
    with it, a's full chunks were copied when its turn ended, and b starts at once."""
    a_bytes = deployment().kv_bytes(4096)
    dep = deployment(device_kv_bytes=a_bytes * 3 // 2, write_through=write_through)
    model = StepModel(dep.profile, dep.geometry, dep.tp)
    requests = [request("a", 0, 0.0, 4000, 96), request("b", 0, 100.0, 4000, 1)]
    result = simulate(requests, dep, policy("offload"))
    b = result.run.requests[1]
    host = result.run.tiers["host"]
    chunk_bytes = dep.kv_bytes(256)
    demoted = result.run.decisions["demote"]["device"]
    assert demoted > 0 and b.restored_tokens == {}
    if write_through:
        assert b.ttft_s == pytest.approx(model.prefill_s(4000), rel=1e-9)
        # every full chunk, once: a's 16, then b's 15 when its turn ended (4,001 tokens)
        assert host.bytes_written == host.resident_bytes == 31 * chunk_bytes
    else:
        spill = model.transfer_s(demoted * chunk_bytes, "host", write=True)
        assert b.ttft_s > model.prefill_s(4000) + 0.5 * spill
        assert host.bytes_written == demoted * chunk_bytes


def test_a_request_under_pressure_starts_once_its_need_is_spilled_not_the_whole_spill():
    """a's 16 chunks fill two thirds of the pool; b needs more than the rest, and the policy
    spills all 16 to host. The copies land one after another, each freeing its chunk's
    device memory, so b starts once the chunks it is short of are out, while the others
    still copy; it would wait for all 16 if the spill freed its memory only at its end."""
    a_bytes = deployment().kv_bytes(4096)
    dep = deployment(device_kv_bytes=a_bytes * 3 // 2)
    model = StepModel(dep.profile, dep.geometry, dep.tp)
    requests = [request("a", 0, 0.0, 4000, 96), request("b", 0, 100.0, 4000, 1)]
    config = policy("tests.sim.test_simulator:SpillAllUnderPressure", interval_s=5.0)
    result = simulate(requests, dep, config)
    b = result.run.requests[1]
    chunk_bytes = dep.kv_bytes(256)
    short = dep.kv_bytes(4001) - (dep.device_kv_bytes - a_bytes)
    needed = -(-short // chunk_bytes)  # whole chunks, in the order they were issued
    assert 0 < needed < 16 and result.run.decisions["demote"]["device"] == 16
    per_chunk = model.transfer_s(chunk_bytes, "host", write=True)
    assert b.ttft_s == pytest.approx(needed * per_chunk + model.prefill_s(4000), rel=1e-9)
    waiting_for_all = 16 * per_chunk + model.prefill_s(4000)
    assert waiting_for_all - b.ttft_s == pytest.approx((16 - needed) * per_chunk, rel=1e-6)
    host = result.run.tiers["host"]  # the rest of the spill landed in the background
    assert host.bytes_written == host.resident_bytes == 16 * chunk_bytes


@pytest.mark.parametrize("shared", [False, True])
def test_a_new_conversation_reuses_the_leading_blocks_another_one_computed(shared):
    """b's prompt starts with the same 100 blocks as a's (a shared system prompt and
    document); the engine's prefix cache finds them, and so does the simulator with
    shared prefixes, up to the 64 leading blocks it records."""
    dep = deployment(shared_prefixes=shared)
    model = StepModel(dep.profile, dep.geometry, dep.tp)
    a = request("a", 0, 0.0, 4000, 4)
    b = request("b", 0, 100.0, 4000, 4, hash_ids=tuple(range(100)) + tuple(range(-150, 0)))
    c = request("c", 0, 200.0, 4000, 4, hash_ids=tuple(range(-300, -50)))  # nothing in common
    records = simulate([a, b, c], dep, policy("retain")).run.requests
    assert records[0].restored_tokens == {} and records[2].restored_tokens == {}
    assert records[2].ttft_s == pytest.approx(model.prefill_s(4000), rel=1e-9)
    if shared:
        assert records[1].restored_tokens == {"device": 64 * 16}
        assert records[1].ttft_s == pytest.approx(model.prefill_s(4000 - 1024, 1024), rel=1e-9)
    else:
        assert records[1].restored_tokens == {}
        assert records[1].ttft_s == pytest.approx(model.prefill_s(4000), rel=1e-9)


def test_a_request_too_long_for_the_model_fails_and_is_counted(small):
    requests = [request("a", 0, 0.0, 200_000, 10), request("b", 0, 1.0, 1000, 10)]
    records = simulate(requests, small, policy("retain")).run.requests
    assert [r.failed for r in records] == [True, False]
    assert "exceeds the model's context of 131,072" in records[0].error


def test_a_turn_waits_for_the_previous_answer_of_its_conversation(small):
    requests = [request("s", 0, 0.0, 1000, 400), request("s", 1, 1.0, 1500, 10)]
    first, second = simulate(requests, small, policy("retain")).run.requests
    assert second.arrival_s == first.finish_s > 1.0
    assert second.turn_kind == "continuing" and second.restored_tokens == {"device": 1400}


@pytest.fixture(scope="module")
def workload():
    config = preset_config("default", sessions=40, session_rate=0.5)
    return flatten(generate(config, seed=3))


@pytest.mark.parametrize(
    ("write_through", "keep_moved"), [(False, False), (True, False), (False, True), (True, True)]
)
@pytest.mark.parametrize("name", ["retain", "recompute", "offload", "cost", "oracle"])
def test_every_request_is_accounted_for_and_tier_bytes_balance(
    workload, name, write_through, keep_moved
):
    dep = deployment(
        device_kv_bytes=8 * GB,
        tier_bytes={"host": 20 * GB, "disk": 200 * GB},
        write_through=write_through,
        keep_moved=keep_moved,
    )
    run = simulate(workload, dep, policy(name, interval_s=30.0)).run
    assert len(run.requests) == len(workload)
    assert all(r.failed or (r.finish_s >= r.first_token_s >= r.arrival_s) for r in run.requests)
    assert sum(r.failed for r in run.requests) == 0
    for tier, traffic in run.tiers.items():
        leaves = traffic.bytes_read + traffic.bytes_dropped + traffic.resident_bytes
        assert traffic.bytes_written == leaves, tier
    for sample in run.occupancy:
        assert sample.used_bytes["device"] <= dep.device_kv_bytes
        assert sample.used_bytes["host"] <= 20 * GB
    for r in run.requests:
        assert sum(r.restored_tokens.values()) < r.prompt_tokens


def test_the_collector_is_relaxed_during_a_run_and_set_back_after(small):
    seen = SeesCollector.seen
    seen.clear()
    before = gc.get_threshold()
    config = policy("tests.sim.test_simulator:SeesCollector", interval_s=0.5)
    simulate([request("s", 0, 0.0, 3000, 400)], small, config)
    assert seen, "the policy ran"
    assert all(t[0] == GC_YOUNG_THRESHOLD and t[1:] == before[1:] for t, _ in seen)
    assert all(frozen > 0 for _, frozen in seen)  # what existed before the run is frozen
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_runs_are_deterministic(workload):
    dep = deployment(device_kv_bytes=8 * GB, tier_bytes={"host": 20 * GB, "disk": 200 * GB})
    config = policy("cost", interval_s=30.0)
    documents = [
        json.dumps(to_document("simulate", {}, [simulate(workload, dep, config).run]))
        for _ in range(2)
    ]
    assert documents[0] == documents[1]


def test_a_scarce_device_makes_offloading_beat_recomputing(workload):
    dep = deployment(device_kv_bytes=8 * GB, tier_bytes={"host": 100 * GB})
    ttft = {}
    for name in ("recompute", "offload"):
        run = simulate(workload, dep, policy(name)).run
        resumed = [r.ttft_s for r in run.requests if r.turn_kind == "resumed"]
        ttft[name] = sum(resumed) / len(resumed)
    assert ttft["offload"] < ttft["recompute"]


def test_scale_smoke_a_few_hundred_sessions_on_replicas():
    config = preset_config("default", sessions=150, session_rate=1.0)
    requests = flatten(generate(config, seed=1))
    dep = deployment(gpus=2, tp=1, device_kv_bytes=10 * GB, tier_bytes={"host": 50 * GB})
    result = simulate(requests, dep, policy("offload"))
    assert result.events > len(requests) and result.steps > result.events
    assert {r.failed for r in result.run.requests} == {False}
    assert result.run.itl_pooled and result.run.duration_s > 0


@dataclass
class ChecksDelta(RetentionPolicy):
    """Compares the simulator's note of what changed (`PolicyView.delta`) with the policy's own
    comparison of the views (`view_diff.diff`), and drops every idle chunk so sessions leave
    the view (a test policy)."""

    name = "checks-delta"
    seen: ClassVar[list[tuple[bool, int, int]]] = []  # (note == diff, changed, left)

    def __post_init__(self) -> None:
        self._last: dict[str, tuple[SessionView]] = {}
        self._token: object = None

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        changes = diff(view.sessions, self._last)
        delta = view.delta
        assert delta is not None
        if self._token is not None:  # the first view has no previous one to be against
            agrees = (
                delta.since is self._token
                and delta.changed == changes.changed
                and all(a is b for a, b in zip(delta.changed, changes.changed, strict=True))
                and sorted(delta.left) == sorted(changes.left)
            )
            self.seen.append((agrees, len(changes.changed), len(changes.left)))
        self._token = view.token
        for session_id in changes.left:
            del self._last[session_id]
        for session in changes.changed:
            self._last[session.session_id] = (session,)
        return [Drop(s.session_id, None) for s in view.candidates(now)]


def test_the_simulator_tells_the_policy_what_changed_as_comparing_the_views_would():
    seen = ChecksDelta.seen
    seen.clear()
    requests = flatten(generate(preset_config("default", sessions=60, session_rate=2.0), seed=5))
    config = policy(
        "tests.sim.test_simulator:ChecksDelta",
        interval_s=2.0,
        predictor={"max_age_s": 10.0, "min_gap_s": 0.5},
    )
    simulate(requests, deployment(), config)
    assert len(seen) > 20
    assert all(agrees for agrees, _, _ in seen)
    assert sum(changed for _, changed, _ in seen) > 60  # sessions came and changed
    assert sum(left for _, _, left in seen) > 10  # and left once idle without KV
