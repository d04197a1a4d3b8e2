"""The simulator with the cost policy choosing stored forms: a budget that allows INT4 shrinks
what a slow tier holds and moves, restores pay their decode, and runs stay deterministic."""

from __future__ import annotations

import json

import pytest

from kvtier.policy.config import PolicyConfig
from kvtier.results.report import to_document
from kvtier.sim.simulator import simulate
from kvtier.workload.generator import generate
from kvtier.workload.model import flatten
from kvtier.workload.presets import preset_config
from tests.sim.conftest import GB, deployment


@pytest.fixture(scope="module")
def workload():
    config = preset_config("default", sessions=40, session_rate=0.5)
    return flatten(generate(config, seed=3))


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    path = tmp_path_factory.mktemp("figures") / "forms.json"
    forms = {"int8": {"loss": 0.5}, "int4": {"loss": 2.0}}
    path.write_text(json.dumps({"models": ["llama-3.1-8b"], "forms": forms}))
    return str(path)


def run(workload, figures, budget):
    # no host tier: idle KV leaves the device for NVMe, whose 5 GB/s a GPU decoder outruns
    dep = deployment(device_kv_bytes=8 * GB, tier_bytes={"disk": 200 * GB})
    config = PolicyConfig(
        name="cost", interval_s=30.0, max_accuracy_loss=budget, accuracy_file=figures
    )
    return simulate(workload, dep, config)


def test_a_budget_that_allows_int4_stores_disk_chunks_as_int4(workload, figures):
    full, lossy = run(workload, figures, 0.0), run(workload, figures, 2.0)
    assert full.forms["restored_tokens"].keys() <= {"full"}
    assert not full.forms["codec_s"]
    restored = lossy.forms["restored_tokens"]
    assert restored.get("int4", 0) > 0 and "int8" not in restored
    assert lossy.forms["codec_s"]["encode"] > 0 and lossy.forms["codec_s"]["decode"] > 0
    # INT4 holds and moves about a third of the bytes
    disk_full, disk_lossy = full.run.tiers["disk"], lossy.run.tiers["disk"]
    assert disk_lossy.bytes_written < 0.5 * disk_full.bytes_written
    assert disk_lossy.bytes_read < 0.5 * disk_full.bytes_read
    for result in (full, lossy):
        disk = result.run.tiers["disk"]
        leaves = disk.bytes_read + disk.bytes_dropped + disk.resident_bytes
        assert disk.bytes_written == leaves
        assert len(result.run.requests) == len(workload)
        assert not any(r.failed for r in result.run.requests)


def test_a_budget_below_every_measured_loss_stores_full_precision(workload, figures):
    result = run(workload, figures, 0.4)
    assert result.forms["restored_tokens"].keys() <= {"full"}


def test_runs_with_forms_are_deterministic(workload, figures):
    documents = [
        json.dumps(to_document("simulate", {}, [run(workload, figures, 2.0).run])) for _ in range(2)
    ]
    assert documents[0] == documents[1]


def test_hardware_profiles_give_codec_speeds_measured_or_derived():
    from kvtier.policy.cost_model import MEASURED_CPU_CODECS
    from kvtier.sim.profile import load_profile

    cpu = load_profile("local-cpu", calibrated=False).codec_speeds()
    for form, speed in MEASURED_CPU_CODECS.items():  # the measured figures, as written
        assert cpu[form].decode_bytes_per_s == pytest.approx(speed.decode_bytes_per_s, rel=0.01)
    h100 = load_profile("h100-sxm").codec_speeds()
    h100_tp8 = load_profile("h100-sxm").codec_speeds(8)
    # derived from HBM bandwidth: far faster than NVMe, and each GPU decodes its share
    assert h100["int4"].decode_bytes_per_s > 100e9
    assert h100_tp8["int4"].decode_bytes_per_s == pytest.approx(8 * h100["int4"].decode_bytes_per_s)
