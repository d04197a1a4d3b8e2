"""The prefix-only restore planner (engines that take loaded KV only right after their own
hits, as vLLM does): it loads a leading run and prefills the rest, never past a chunk stored
nowhere, and it is the fastest such plan, never slower than pure recompute."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy.restore import plan_prefix_restore, pure_recompute
from tests.policy.test_restore import layout, model

tier_lists = st.lists(st.sampled_from(["host", "disk", "remote", None]), max_size=30)


def serial_seconds(chunks, m, cut):
    """Loads of [0, cut) one after another, then the prefill of [cut, n)."""
    loads = sum(m.load_s(c.size_bytes, c.tier) for c in chunks[:cut])
    compute = sum(m.chunk_recompute_s(c.tokens, c.token_start) for c in chunks[cut:])
    return loads + compute


@settings(max_examples=300, deadline=None)
@given(tiers=tier_lists, token_s=st.floats(1e-5, 5e-3), bw=st.floats(1e8, 1e11))
def test_the_plan_is_a_loaded_prefix_then_recompute_and_the_fastest_such(tiers, token_s, bw):
    chunks = layout(tiers)
    m = model(token_s=token_s, host_bw=bw, disk_bw=bw / 5)
    plan = plan_prefix_restore(chunks, m)
    cut = plan.split
    assert plan.loads == tuple(range(cut))
    assert plan.recompute == tuple(range(cut, len(chunks)))
    assert all(chunks[i].tier is not None for i in plan.loads)
    stored_prefix = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
    best = min(serial_seconds(chunks, m, c) for c in range(stored_prefix + 1))
    assert math.isclose(plan.seconds, best, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(plan.seconds, serial_seconds(chunks, m, cut), rel_tol=1e-9)
    assert plan.seconds <= pure_recompute(chunks, m).seconds * (1 + 1e-9) + 1e-12


def test_a_fast_link_loads_everything_before_a_hole_and_recomputes_after_it():
    chunks = layout(["host", "host", None, "host"])
    plan = plan_prefix_restore(chunks, model(host_bw=1e11))
    assert (plan.kind, plan.loads, plan.recompute) == ("prefix", (0, 1), (2, 3))


def test_a_link_slower_than_the_prefill_recomputes_everything():
    chunks = layout(["disk"] * 8)
    plan = plan_prefix_restore(chunks, model(token_s=2e-4, disk_bw=1e8))
    assert (plan.kind, plan.loads) == ("recompute", ())
