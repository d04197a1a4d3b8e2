"""`kvtier calibrate` on the real engine, profile files it writes, and the order in which a
profile name is looked up (file, calibrated, bundled)."""

from __future__ import annotations

import pytest

from kvtier.cli import _ArgumentParser
from kvtier.errors import KvtierError
from kvtier.sim import calibrate_command
from kvtier.sim.calibrate import LinkTiming, fit_link
from kvtier.sim.profile import calibrated_path, load_profile, profile_origin
from kvtier.sim.profile_file import write_profile


def calibrate(*argv: str) -> int:
    parser = _ArgumentParser(prog="kvtier calibrate")
    calibrate_command.add_arguments(parser)
    return calibrate_command.run(parser.parse_args(list(argv)))


@pytest.mark.slow
def test_calibrate_times_the_engine_and_writes_a_profile_that_loads(tmp_path, capsys):
    out = tmp_path / "mine.toml"
    tiny = ("--prefill", "16@0,48@0,32@64", "--decode", "1x32,4x32,2x96", "--repeats", "1")
    # torch's attention runs everywhere; the profile says which attention it prices
    assert (
        calibrate(*tiny, "--name", "mine", "--out", str(out), "--prefill-attention", "torch") == 0
    )
    printed = capsys.readouterr().out
    assert "prefill attention by torch) on this machine" in printed
    assert "prefill 32 after 64" in printed and "decode batch 4 at" in printed
    assert "fit error: mean |error|" in printed and f"wrote {out}" in printed
    profile = load_profile(str(out))
    assert profile.name == "mine" and profile_origin(str(out)) == f"file {out}"
    device = profile.device()
    assert device.peak_flops > 0 and device.memory_bandwidth > 0
    assert profile.step_overhead_s >= 0 and profile.sequence_overhead_s >= 0
    # a CPU engine spends real time outside the model: the fit must see some of it
    assert profile.step_overhead_s + profile.sequence_overhead_s > 0
    paths = profile.tier_paths()
    assert paths["host"].read.bandwidth > 0 and paths["disk"].write.bandwidth > 0
    assert not paths["disk"].duplex and paths["host"].duplex
    assert "kvtier calibrate" in profile.description and "PLACEHOLDER" not in str(profile.sources)
    assert "prefill attention by torch" in profile.description
    assert "calibrated profile" not in printed  # --out elsewhere: lookup does not change


def test_calibrated_profile_is_preferred_over_the_bundled_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVTIER_CACHE", str(tmp_path))
    assert profile_origin("local-cpu") == "bundled"
    bundled = load_profile("local-cpu")
    mine = bundled.model_copy(update={"step_overhead_s": 0.0123, "description": "mine"})
    write_profile(mine, calibrated_path("local-cpu"))
    assert calibrated_path("local-cpu") == tmp_path / "profiles" / "local-cpu.toml"
    assert profile_origin("local-cpu") == f"calibrated {calibrated_path('local-cpu')}"
    assert load_profile("local-cpu") == mine
    assert load_profile("local-cpu", calibrated=False) == bundled
    # a file path beats both; a calibrated name need not be bundled
    other = write_profile(mine.model_copy(update={"name": "x"}), tmp_path / "local-cpu")
    assert load_profile(str(other)).name == "x"
    write_profile(mine.model_copy(update={"name": "box"}), calibrated_path("box"))
    assert load_profile("box").name == "box"
    with pytest.raises(KvtierError, match="not a bundled name, a calibrated profile in"):
        load_profile("h300")


def test_every_bundled_profile_survives_a_toml_round_trip(tmp_path):
    for name in ("h100-sxm", "l40s", "local-cpu"):
        profile = load_profile(name, calibrated=False)
        path = write_profile(profile, tmp_path / f"{name}.toml", ["a comment"])
        assert load_profile(str(path)) == profile
        assert path.read_text().startswith("# a comment\n")


def test_link_fit_solves_latency_and_bandwidth_from_two_sizes():
    timings = [LinkTiming(1_000, 3e-6, 2e-4), LinkTiming(1_001_000, 1.003e-3, 1e-4)]
    bandwidth, latency = fit_link(timings, write=True)  # 2 us + bytes / (1 GB/s)
    assert bandwidth == pytest.approx(1e9) and latency == pytest.approx(2e-6)
    # the large read faster than the small one: noise, not a size effect; all bandwidth
    assert fit_link(timings, write=False) == (pytest.approx(1.001e10), 0.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--threads", "0"), "--threads must be at least 1"),
        (("--repeats", "0"), "--repeats must be at least 1"),
        (("--prefill", "64at0"), "--prefill takes points like 64@0,64@512, not '64at0'"),
        (("--prefill", "64@7"), "whole 16-token blocks"),
        (("--decode", "0x128"), "a batch and a context of at least 1"),
        (("--decode", "4"), "--decode takes points like 1x128,8x512"),
        (("--dtype", "fp8"), "--dtype must be auto, bfloat16 or float32"),
        (("--base", "h300"), "unknown hardware profile 'h300'"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path, argv, message):
    with pytest.raises(KvtierError, match=message.replace("|", r"\|")):
        calibrate("--out", str(tmp_path / "p.toml"), *argv)


@pytest.mark.parametrize("source", ["file", "environment", "flag"])
def test_calibrate_times_the_prefill_attention_the_server_is_configured_with(
    tmp_path, monkeypatch, source
):
    """The [scheduling] key reaches calibrate's engine from each place `kvtier serve` reads it:
    the kernel by name in float32 is refused by the engine itself, before any step is timed."""
    argv = ["--dtype", "float32", "--out", str(tmp_path / "p.toml")]
    if source == "file":
        config = tmp_path / "kvtier.toml"
        config.write_text('[scheduling]\nprefill_attention = "kernel"\n')
        argv += ["--config", str(config)]
    elif source == "environment":
        monkeypatch.setenv("KVTIER_SCHEDULING__PREFILL_ATTENTION", "kernel")
    else:
        argv += ["--prefill-attention", "kernel"]
    with pytest.raises(KvtierError, match="prefill_attention 'kernel' is not available here"):
        calibrate(*argv)
    assert not (tmp_path / "p.toml").exists()


def test_a_bad_scheduling_value_from_the_environment_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_SCHEDULING__PREFILL_ATTENTION", "amx")
    with pytest.raises(KvtierError, match="prefill_attention"):
        calibrate("--out", str(tmp_path / "p.toml"))
