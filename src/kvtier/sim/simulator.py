"""Run a workload's requests through simulated replicas under one retention policy and record
the run in the shared results schema (`kvtier.results`), exactly as `kvtier bench` does.

Turns are sent as `kvtier bench` sends them: a conversation's first turn at its trace time
(shifted so the first request is at 0); a later turn whose think time the workload knows
(`think_s`, the generator's) that long after the previous answer really ended, so a slow
policy delays the user; a later turn without one (traces) at its trace time, or when the
previous answer ends if that is later. The oracle is told these send times as they become
known. A conversation stays on the replica its first turn went to (the least loaded one then),
so its KV is where its next turn is. The policy runs on every replica every `interval_s`, and
tier occupancy is sampled then.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.policy.base import RetentionPolicy
from kvtier.policy.config import PolicyConfig
from kvtier.policy.cost_model import CostProfile
from kvtier.policy.metrics import Calibration
from kvtier.policy.oracle import OraclePolicy
from kvtier.policy.registry import build_policy
from kvtier.results.records import (
    OccupancySample,
    RequestRecord,
    RunRecords,
    TierTraffic,
)
from kvtier.sim.deployment import Deployment
from kvtier.sim.events import EventLoop
from kvtier.sim.quiet_gc import relaxed_during_run
from kvtier.sim.replica import Replica
from kvtier.sim.step_model import StepModel
from kvtier.workload.arrivals import next_arrivals
from kvtier.workload.model import Request

MAX_OCCUPANCY_SAMPLES = 1000  # thinned evenly beyond this, to keep result files small


@dataclass
class SimResult:
    run: RunRecords
    events: int  # heap events processed
    steps: int  # engine steps simulated (a run of identical decode steps is one event)
    wall_s: float
    policy_s: float  # of which in the policy's decide()
    calibration: Calibration | None = None  # the reuse predictions scored, where a policy makes any
    # stored forms: tokens restored from lower tiers per form, codec seconds (encode, decode)
    forms: dict[str, dict[str, float]] = field(default_factory=dict)


def simulate(
    requests: Sequence[Request],
    deployment: Deployment,
    config: PolicyConfig,
    histories: Mapping[str, int] | None = None,
) -> SimResult:
    """Simulate `requests` (time-ordered, e.g. `workload.flatten(...)`) under the policy
    `config` names; "oracle" is told the future arrivals of each conversation. `histories`
    (request id -> tokens) caps how much of a turn's prompt its session's KV covers, where a
    real run measured it (`kvtier simulate --lengths-from`)."""
    started = time.perf_counter()
    loop = EventLoop()
    model = StepModel(deployment.profile, deployment.geometry, deployment.tp)
    profile = model.cost_profile()
    cost_model = config.cost_model(profile)
    origin = min((r.arrival_s for r in requests), default=0.0)
    turns: dict[str, list[Request]] = {}
    for request in sorted(requests, key=lambda r: (r.session_id, r.turn_index)):
        turns.setdefault(request.session_id, []).append(request)
    follower = {  # request id -> the closed-loop turn sent after it ends
        t[k].request_id: t[k + 1]
        for t in turns.values()
        for k in range(len(t) - 1)
        if t[k + 1].think_s is not None
    }
    arrivals = next_arrivals(requests)  # what the oracle is told, updated as turns are sent
    records: list[RequestRecord] = []

    def done(record: RequestRecord) -> None:
        records.append(record)
        turn = follower.get(record.request_id)
        if turn is not None:
            send_at = loop.now + turn.think_s
            loop.at(send_at, arrive, turn)
            later = turns[turn.session_id][turn.turn_index :]
            arrivals[turn.session_id][turn.turn_index :] = [
                r.arrival_s - turn.arrival_s + send_at for r in later
            ]

    track_s = config.predictor.max_age_s + config.interval_s
    calibration = Calibration()  # shared: each conversation stays on one replica
    replicas = [
        Replica(
            loop,
            deployment,
            model,
            _policy(config, profile, arrivals, calibration),
            cost_model,
            done,
            track_s,
            histories or {},
        )
        for _ in range(deployment.replicas)
    ]
    home: dict[str, Replica] = {}

    def arrive(request: Request) -> None:
        replica = home.get(request.session_id)
        if replica is None:
            replica = home[request.session_id] = min(replicas, key=lambda r: r.load)
        replica.arrive(request)

    occupancy: list[OccupancySample] = []

    def tick() -> None:
        for replica in replicas:
            replica.tick()
        used: Counter[str] = Counter()
        for replica in replicas:
            used.update(replica.occupancy())
        occupancy.append(OccupancySample(loop.now, dict(used)))
        if len(records) < len(requests):
            loop.at(loop.now + config.interval_s, tick)

    for t in turns.values():
        for k, request in enumerate(t):
            if k == 0 or request.think_s is None:
                loop.at(request.arrival_s - origin, arrive, request)
    if requests:
        loop.at(config.interval_s, tick)
    with relaxed_during_run():  # the collector mostly out of the way (`quiet_gc`)
        loop.run()

    for replica in replicas:
        replica.record_stalls()
    records.sort(key=lambda r: (r.arrival_s, r.request_id))
    end = max((r.finish_s or r.arrival_s for r in records), default=0.0)
    run = RunRecords(
        policy=config.name,
        duration_s=end,
        requests=records,
        tiers=_traffic(replicas),
        decisions=_decisions(replicas),
        occupancy=occupancy[:: max(1, math.ceil(len(occupancy) / MAX_OCCUPANCY_SAMPLES))],
        itl_pooled=_pooled_itl(replicas),
    )
    steps = sum(replica.steps for replica in replicas)
    policy_s = sum(replica.policy_s for replica in replicas)
    wall_s = time.perf_counter() - started
    scored = calibration if calibration.resolved else None
    return SimResult(run, loop.processed, steps, wall_s, policy_s, scored, _forms(replicas))


def _policy(
    config: PolicyConfig,
    profile: CostProfile,
    arrivals: dict[str, list[float]],
    calibration: Calibration,
) -> RetentionPolicy:
    if config.name == "oracle":
        return OraclePolicy(arrivals)
    policy = build_policy(config, profile)
    calibration.score(policy)
    return policy


def _forms(replicas: Sequence[Replica]) -> dict[str, dict[str, float]]:
    restored: Counter[str] = Counter()
    codec: Counter[str] = Counter()
    for replica in replicas:
        restored.update(replica.form_tokens)
        codec.update(replica.codec_s)
    return {"restored_tokens": dict(restored), "codec_s": dict(codec)}


def _traffic(replicas: Sequence[Replica]) -> dict[str, TierTraffic]:
    totals: dict[str, Counter[str]] = {}
    for replica in replicas:
        for tier, counters in replica.tier_counters().items():
            totals.setdefault(tier, Counter()).update(counters)
    return {tier: TierTraffic(**counts) for tier, counts in totals.items()}


def _decisions(replicas: Sequence[Replica]) -> dict[str, dict[str, int]]:
    merged: Counter[tuple[str, str]] = Counter()
    for replica in replicas:
        merged.update(replica.metrics.decisions)
    out: dict[str, dict[str, int]] = {}
    for (kind, tier), count in sorted(merged.items()):
        out.setdefault(kind, {})[tier] = count
    return out


def _pooled_itl(replicas: Sequence[Replica]) -> list[tuple[float, int]]:
    merged: Counter[int] = Counter()
    for replica in replicas:
        merged.update(replica.itl_us)
    return [(gap_us / 1e6, count) for gap_us, count in sorted(merged.items())]
