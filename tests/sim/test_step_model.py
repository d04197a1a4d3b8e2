"""The step model's roofline, its closed-form decode runs and its transfer times."""

from __future__ import annotations

import pytest

from kvtier.plan.geometry import load_geometry
from kvtier.plan.planner import prefill_flops
from kvtier.sim.profile import load_profile
from kvtier.sim.step_model import StepModel

H100 = load_profile("h100-sxm")
LLAMA_8B = load_geometry("llama-3.1-8b")
LLAMA_70B = load_geometry("llama-3.1-70b")


def test_a_long_prefill_is_compute_bound_at_the_planners_flops():
    model = StepModel(H100, LLAMA_8B)
    tokens = 8192
    rate = 989e12 * 0.5
    assert model.flops(0, 0, ((tokens, 0),)) == pytest.approx(prefill_flops(LLAMA_8B, tokens))
    assert model.prefill_s(tokens) == pytest.approx(1e-3 + prefill_flops(LLAMA_8B, tokens) / rate)


def test_a_small_decode_batch_is_memory_bound_on_the_weights():
    model = StepModel(H100, LLAMA_8B)
    weights_s = model.weight_bytes / (3.35e12 * 0.8)
    assert model.step_s(1, 1000) == pytest.approx(1e-3 + weights_s, rel=0.02)
    # more sequences over the same keys cost about the same: the weights are read once a step
    assert model.step_s(32, 32 * 1000) < 1.5 * model.step_s(1, 1000)


def test_tensor_parallelism_divides_the_work_and_adds_all_reduces():
    one, eight = StepModel(H100, LLAMA_70B, 1), StepModel(H100, LLAMA_70B, 8)
    work = (0, 0, ((4096, 0),))
    assert eight.comm_s(4096) > 0 and one.comm_s(4096) == 0
    compute_8 = eight.flops(*work) / eight.compute_rate
    assert compute_8 == pytest.approx(one.flops(*work) / one.compute_rate / 8)
    assert eight.prefill_s(4096) == pytest.approx(1e-3 + compute_8 + eight.comm_s(4096))


@pytest.mark.parametrize("key_overhead_s", [0.0, 2e-8])
def test_decode_runs_sum_the_steps_exactly(key_overhead_s):
    profile = H100.model_copy(update={"key_overhead_s": key_overhead_s})
    model = StepModel(profile, LLAMA_70B, 8)
    for decodes, context in ((1, 100), (64, 64 * 8000), (256, 256 * 500)):
        steps = [model.step_s(decodes, context + i * decodes) for i in range(200)]
        total, last = model.decode_run_s(decodes, context, 200)
        assert total == pytest.approx(sum(steps), rel=1e-9)
        assert last == pytest.approx(steps[-1], rel=1e-9)


def test_the_per_key_overhead_charges_every_key_attended_to():
    cpu = load_profile("local-cpu", calibrated=False)
    smollm = load_geometry("smollm2-135m")
    model = StepModel(cpu, smollm)
    without = StepModel(cpu.model_copy(update={"key_overhead_s": 0.0}), smollm)
    # 8 decodes over 8,000 keys and a 100-token chunk after 400 cached: 8,500 keys
    work = (8, 8000, ((100, 400),))
    assert model.step_s(*work) - without.step_s(*work) == pytest.approx(8500 * cpu.key_overhead_s)


def test_decode_steps_within_ends_at_the_first_boundary_after_an_event():
    model = StepModel(H100, LLAMA_70B, 8)
    horizon = 0.5
    k = model.decode_steps_within(16, 16 * 4000, horizon, 10_000)
    assert model.decode_run_s(16, 16 * 4000, k)[0] >= horizon
    assert model.decode_run_s(16, 16 * 4000, k - 1)[0] < horizon
    assert model.decode_steps_within(16, 16 * 4000, horizon, 3) == 3


def test_small_transfers_reach_less_of_the_links_bandwidth():
    model = StepModel(H100, LLAMA_8B)
    link = model.paths["disk"].read  # NVMe Gen5: 14 GB/s, 80 us per operation
    for size in (64 * 1024, 4 * 2**20, 256 * 2**20):
        assert model.transfer_s(size, "disk") == pytest.approx(80e-6 + size / 14e9)
    effective = [size / model.transfer_s(size, "disk") for size in (2**16, 2**22, 2**28)]
    assert effective == sorted(effective) and effective[-1] < link.bandwidth
    assert model.transfer_s(2**20, "disk", write=True) > model.transfer_s(2**20, "disk")


def test_the_policies_cost_profile_matches_a_compute_bound_prefill():
    model = StepModel(H100, LLAMA_8B)
    profile = model.cost_profile()
    assert profile.prefill_fixed_s == pytest.approx(1e-3)
    seconds = profile.prefill_fixed_s + profile.prefill_token_s * 8192
    seconds += profile.prefill_pair_s * 8192 * 8192 / 2
    assert seconds == pytest.approx(model.prefill_s(8192))
    assert profile.links["host"].bandwidth == 50e9
