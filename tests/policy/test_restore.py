"""The restore planner: never slower than pure load or pure recompute, missing chunks always
recomputed, and its times agree with an independent step-by-step simulation."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy.cost_model import CostModel, CostProfile, TierLink
from kvtier.policy.restore import plan_restore, pure_load, pure_recompute
from kvtier.policy.view import ChunkView

CHUNK = 256
BPT = 131_072


def layout(tiers, chunk_tokens=CHUNK, bytes_per_token=BPT):
    return [
        ChunkView(i, i * chunk_tokens, (i + 1) * chunk_tokens, tier, chunk_tokens * bytes_per_token)
        for i, tier in enumerate(tiers)
    ]


def model(token_s=5e-4, pair_s=5e-8, host_bw=25e9, disk_bw=5e9):
    links = {
        "host": TierLink(host_bw, 1e-5),
        "disk": TierLink(disk_bw, 1e-4),
        "remote": TierLink(1e9, 1e-3),
    }
    return CostModel(CostProfile(0.01, token_s, pair_s, links))


def simulate(chunks, m, recompute, loads):
    """Reference schedule: one link issues `loads` in order; the GPU recomputes `recompute` in
    order, each only once every earlier chunk is on the device. Returns the makespan."""
    on_device_at = {c.index: 0.0 for c in chunks if c.tier == "device"}
    link = 0.0
    for i in loads:
        c = next(c for c in chunks if c.index == i)
        link += m.load_s(c.size_bytes, c.tier)
        on_device_at[i] = link
    gpu = 0.0
    for i in recompute:
        c = next(c for c in chunks if c.index == i)
        before = [on_device_at[j] for j in on_device_at if j < i]
        gpu = max([gpu, *before]) + m.chunk_recompute_s(c.tokens, c.token_start)
        on_device_at[i] = gpu
    assert sorted(on_device_at) == [c.index for c in chunks], "some chunk never restored"
    return max(gpu, link)


tier_lists = st.lists(st.sampled_from(["device", "host", "disk", "remote", None]), max_size=40)
speeds = st.floats(1e-5, 5e-3)


@settings(max_examples=300, deadline=None)
@given(tiers=tier_lists, token_s=speeds, bw=st.floats(1e8, 1e11))
def test_plan_is_never_slower_than_pure_load_or_pure_recompute(tiers, token_s, bw):
    chunks, m = layout(tiers), model(token_s=token_s, host_bw=bw, disk_bw=bw / 5)
    best = plan_restore(chunks, m)
    assert best.seconds <= min(pure_load(chunks, m).seconds, pure_recompute(chunks, m).seconds)


@settings(max_examples=300, deadline=None)
@given(tiers=tier_lists, token_s=speeds, bw=st.floats(1e8, 1e11))
def test_plan_is_valid_and_its_time_matches_a_reference_schedule(tiers, token_s, bw):
    chunks, m = layout(tiers), model(token_s=token_s, host_bw=bw)
    for plan in (plan_restore(chunks, m), pure_load(chunks, m), pure_recompute(chunks, m)):
        missing = {c.index for c in chunks if c.tier is None}
        on_device = {c.index for c in chunks if c.tier == "device"}
        assert missing <= set(plan.recompute)
        assert not on_device & (set(plan.recompute) | set(plan.loads))
        assert set(plan.recompute) | set(plan.loads) | on_device == {c.index for c in chunks}
        assert list(plan.recompute) == sorted(plan.recompute)
        assert math.isclose(
            plan.seconds,
            simulate(chunks, m, plan.recompute, plan.loads),
            rel_tol=1e-9,
            abs_tol=1e-12,
        )


@settings(max_examples=100, deadline=None)
@given(
    tiers=st.lists(st.sampled_from(["device", "host", "disk", None]), max_size=12), token_s=speeds
)
def test_plan_is_the_best_split(tiers, token_s):
    # brute force: every split s (recompute [0, s) plus anything missing) through the reference
    chunks, m = layout(tiers), model(token_s=token_s)
    best = math.inf
    for s in range(len(chunks) + 1):
        recompute = [
            c.index for c in chunks if (c.index < s and c.tier != "device") or c.tier is None
        ]
        last = max(recompute, default=-1)
        loaded = [c.index for c in chunks if c.index >= s and c.tier not in ("device", None)]
        order = [i for i in loaded if i < last] + [i for i in reversed(loaded) if i > last]
        best = min(best, simulate(chunks, m, recompute, order))
    assert math.isclose(plan_restore(chunks, m).seconds, best, rel_tol=1e-9, abs_tol=1e-12)


def test_balanced_costs_give_a_bidirectional_plan_faster_than_either():
    # host loads ~ as slow as recompute: each side does about half
    m = model(token_s=1e-4, pair_s=0.0, host_bw=256 * BPT / 0.0256)
    chunks = layout(["host"] * 16)
    plan = plan_restore(chunks, m)
    assert plan.kind == "bidirectional"
    assert 0 < plan.split < 16
    assert plan.recompute == tuple(range(plan.split))
    assert plan.loads == tuple(reversed(range(plan.split, 16)))  # from the back
    assert plan.seconds < 0.6 * min(pure_load(chunks, m).seconds, pure_recompute(chunks, m).seconds)


def test_fast_link_loads_everything_and_slow_link_recomputes_everything():
    chunks = layout(["disk"] * 8)
    assert plan_restore(chunks, model(disk_bw=1e12)).kind == "load"
    assert plan_restore(chunks, model(token_s=1e-6, pair_s=0.0, disk_bw=1e6)).kind == "recompute"


def test_missing_chunks_are_recomputed_after_what_they_depend_on():
    chunks = layout(["host", "host", None, "host", "host"])
    plan = plan_restore(chunks, model(disk_bw=1e12, host_bw=1e12))
    assert 2 in plan.recompute
    # with a near-free link the chunks before the hole are loaded, first, in order
    assert plan.loads[:2] == (0, 1)


def test_chunks_already_on_the_device_cost_nothing():
    m = model()
    plan = plan_restore(layout(["device"] * 4), m)
    assert plan.seconds == 0.0 and plan.recompute == () and plan.loads == ()
    assert plan_restore([], m).seconds == 0.0


def test_later_chunks_cost_more_to_recompute():
    m = model()
    first, last = layout(["host"] * 32)[0], layout(["host"] * 32)[-1]
    assert m.chunk_recompute_s(last.tokens, last.token_start) > m.chunk_recompute_s(first.tokens, 0)
