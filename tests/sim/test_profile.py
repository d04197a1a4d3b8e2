"""Hardware profile files: the bundled ones load, bad ones fail with one clear line, and a
profile fitted to measured steps recovers the machine that produced them."""

from __future__ import annotations

import json

import pytest

from kvtier.errors import KvtierError
from kvtier.plan.geometry import load_geometry
from kvtier.plan.hardware import ACCELERATORS
from kvtier.sim.fit import Measurements, fit_profile
from kvtier.sim.profile import bundled_profiles, load_profile
from kvtier.sim.step_model import StepModel

GOOD = {
    "name": "mine",
    "accelerator": "h100-sxm",
    "links": {"host": {"link": "pcie4"}, "disk": {"bandwidth": 2e9, "latency_s": 1e-4}},
}


def test_every_bundled_profile_loads_and_resolves_its_links():
    assert set(bundled_profiles()) == {"h100-sxm", "h200", "a100-80gb", "l40s", "local-cpu"}
    for name in bundled_profiles():
        profile = load_profile(name, calibrated=False)
        assert profile.sources, f"{name} cites no source"
        paths = profile.tier_paths()
        assert set(paths) == {"host", "disk", "remote"}
        assert all(p.read.bandwidth > 0 and p.read.latency_s > 0 for p in paths.values())
    h100 = load_profile("h100-sxm")
    assert h100.device() is ACCELERATORS["h100-sxm"]  # the plan's preset, not a copy
    nvme = h100.tier_paths()["disk"]
    assert (nvme.read.bandwidth, nvme.write.bandwidth, nvme.duplex) == (14e9, 10e9, False)
    local = load_profile("local-cpu", calibrated=False)  # measured by kvtier calibrate
    assert "PLACEHOLDER" not in local.description and "kvtier calibrate" in local.description


def test_profiles_load_from_toml_and_json_files(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(GOOD))
    profile = load_profile(str(path))
    assert profile.tier_paths()["disk"].write.bandwidth == 2e9  # no write figure: the read one
    assert profile.tier_paths()["host"].read.bandwidth == 25e9  # pcie4 in kvtier.plan.hardware
    toml = tmp_path / "mine.toml"
    toml.write_text('name = "t"\naccelerator = "l40s"\n[links.host]\nlink = "pcie5"\n')
    assert load_profile(str(toml)).with_links({"host": "pcie4"}).tier_paths()["host"].read == (
        load_profile(str(path)).tier_paths()["host"].read
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"accelerator": "h300"}, "is not a kvtier.plan.hardware preset"),
        ({"efficiency": {"compute": 1.5}}, "efficiency.compute: Input should be less than"),
        ({"links": {"host": {"link": "pcie9"}}}, "unknown link 'pcie9'"),
        ({"links": {"host": {"bandwidth": 1e9}}}, "give `link`"),
        ({"links": {"tape": {"link": "pcie4"}}}, "links.tape"),
        ({"speed": 3}, "speed: Extra inputs are not permitted"),
    ],
)
def test_bad_profiles_fail_with_the_field_named(tmp_path, change, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**GOOD, **change}))
    with pytest.raises(KvtierError, match="invalid hardware profile") as error:
        load_profile(str(path))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_unknown_names_and_unreadable_files_are_clear(tmp_path):
    with pytest.raises(KvtierError, match="bundled: a100-80gb, h100-sxm, h200, l40s, local-cpu"):
        load_profile("h300")
    path = tmp_path / "broken.toml"
    path.write_text("name = ")
    with pytest.raises(KvtierError, match="not valid TOML/JSON"):
        load_profile(str(path))


def test_fit_recovers_the_machine_that_made_the_measurements():
    geometry = load_geometry("smollm2-135m")
    base = load_profile("local-cpu", calibrated=False)
    truth = base.model_copy(
        update={
            "step_overhead_s": 0.004,
            "sequence_overhead_s": 0.002,
            "key_overhead_s": 2e-5,
            "accelerator": base.accelerator.model_copy(
                update={"peak_flops": 2e11, "memory_bandwidth": 10e9}
            ),
        }
    )
    model = StepModel(truth, geometry)
    measured = Measurements(
        prefill=[(t, p, model.prefill_s(t, p)) for t, p in ((256, 0), (512, 0), (1024, 512))],
        decode=[(b, c, model.step_s(b, b * (c + 1))) for b, c in ((1, 512), (4, 1024), (8, 256))],
    )
    fitted = fit_profile(measured, geometry, base, name="calibrated")
    assert fitted.name == "calibrated" and fitted.efficiency.compute == 1.0
    assert fitted.step_overhead_s == pytest.approx(0.004, rel=1e-4)
    assert fitted.sequence_overhead_s == pytest.approx(0.002, rel=1e-4)
    assert fitted.key_overhead_s == pytest.approx(2e-5, rel=1e-4)
    assert fitted.device().peak_flops == pytest.approx(2e11, rel=1e-4)
    assert fitted.device().memory_bandwidth == pytest.approx(10e9, rel=1e-4)
    with pytest.raises(KvtierError, match="2 prefill and 2 decode"):
        fit_profile(Measurements(measured.prefill[:1], measured.decode), geometry, truth)
