"""One kvtier.toml, four readers: `kvtier serve`, `kvtier bench`, `kvtier simulate` and the vLLM
connector take the same [tiers], [scheduling] and [policy] keys from it and agree on what they
mean; `kvtier config show` reports the same values with their origins."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import build_parser
from kvtier.errors import KvtierError
from tests.host_dtype import AUTO_DTYPE

TOML = """
[tiers]
host_bytes = "64MiB"
chunk_tokens = 64
write_through = true
keep_moved = true

[scheduling]
max_num_seqs = 4
max_num_batched_tokens = 256
session_resume_after_s = 12

[policy]
name = "offload"
interval_s = 2.0

[policy.cost]
horizon_s = 7.0
"""
MIB = 1 << 20


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "kvtier.toml"
    path.write_text(TOML)
    return str(path)


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_serve_reads_the_file(config):
    from kvtier.server.command import settings_of

    settings = settings_of(parse("serve", "--config", config))
    assert (settings.tiers.host_bytes, settings.tiers.chunk_tokens) == (64 * MIB, 64)
    assert settings.tiers.write_through is True and settings.tiers.keep_moved is True
    assert settings.scheduling == {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 256,
        "session_resume_after_s": 12.0,
    }
    assert (settings.policy.name, settings.policy.interval_s, settings.policy.horizon_s) == (
        "offload",
        2.0,
        7.0,
    )


def test_bench_reads_the_same_values(config):
    from kvtier.bench.run_setup import run_settings

    run = run_settings(parse("bench", "--config", config))
    tiers = run.settings.tiers
    assert (tiers.host_bytes, tiers.chunk_tokens, tiers.write_through, tiers.keep_moved) == (
        64 * MIB,
        64,
        True,
        True,
    )
    assert run.scheduling["max_num_seqs"] == 4
    assert run.scheduling["max_num_batched_tokens"] == 256
    assert run.resume_after_s == 12.0
    # the bench's own pool (the file names none), sized in bf16 bytes: twice them in float32
    assert run.kv_cache_bytes == 64 * MIB * (2 if AUTO_DTYPE == "float32" else 1)
    assert (run.settings.policy.interval_s, run.settings.policy.horizon_s) == (2.0, 7.0)


def test_simulate_reads_the_same_values(config, capsys):
    from kvtier.sim import command

    args = parse("simulate", "--config", config, "--model", "smollm2-135m")
    command._settle(args)
    deployment = command._deployment(args, "local-cpu")
    assert deployment.tier_bytes["host"] == 64 * MIB
    assert (deployment.chunk_tokens, deployment.max_num_seqs) == (64, 4)
    assert deployment.max_num_batched_tokens == 256 and deployment.session_resume_after_s == 12.0
    assert deployment.write_through is True and deployment.keep_moved is True
    policy = command._policy_config(args, "cost")  # each run names its policy
    assert (policy.name, policy.interval_s, policy.horizon_s) == ("cost", 2.0, 7.0)


def test_a_flag_beats_the_file_in_every_command(config):
    from kvtier.bench.run_setup import run_settings
    from kvtier.server.command import settings_of
    from kvtier.sim import command

    flags = ("--config", config, "--host-bytes", "32MiB", "--max-num-seqs", "2")
    serve = settings_of(parse("serve", *flags))
    bench = run_settings(parse("bench", *flags))
    sim_args = parse("simulate", *flags, "--model", "smollm2-135m")
    command._settle(sim_args)
    sim = command._deployment(sim_args, "local-cpu")
    assert serve.tiers.host_bytes == bench.settings.tiers.host_bytes == sim.tier_bytes["host"]
    assert serve.scheduling["max_num_seqs"] == bench.scheduling["max_num_seqs"] == 2
    assert sim.max_num_seqs == 2
    assert serve.origin("tiers", "host_bytes") == "--host-bytes"
    assert serve.origin("tiers", "chunk_tokens") == config


def test_the_vllm_connector_reads_the_same_values(config):
    from kvtier.integrations.vllm.settings import parse_settings

    settings = parse_settings({"config": config, "tiers": {"chunk_tokens": 32}})
    assert settings.tiers.host_bytes == 64 * MIB
    assert settings.tiers.chunk_tokens == 32  # inline wins over the file
    assert (settings.policy.name, settings.policy.interval_s) == ("offload", 2.0)


def test_config_show_prints_each_value_with_its_origin(config, tmp_path):
    env = {"PATH": "", "KVTIER_TIERS__RETRIES": "5", "HOME": str(tmp_path)}
    out = subprocess.run(
        [str(Path(sys.executable).with_name("kvtier")), "config", "show", "--config", config,
         "--max-num-seqs", "3"],
        capture_output=True, text=True, env=env, check=True, cwd=tmp_path,
    ).stdout  # fmt: skip
    lines = {line.split(" = ")[0]: line for line in out.splitlines() if " = " in line}
    assert lines["host_bytes"].startswith('host_bytes = "64MiB"')
    assert lines["host_bytes"].endswith(f"# {config}")
    assert lines["retries"].startswith("retries = 5")
    assert lines["retries"].endswith("# environment variable KVTIER_TIERS__RETRIES")
    assert lines["max_num_seqs"].endswith("# --max-num-seqs")
    assert lines["name"].startswith('name = "offload"')
    assert lines["spill_queue"].endswith("# default")


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("[tier]\nhost_bytes = 1\n", {}, "unknown table [tier]; did you mean [tiers]?"),
        ("[tiers]\nhost_byte = 1\n", {}, "tiers.host_byte (from {path}): unknown key; did you "
         "mean host_bytes?"),
        ("", {"KVTIER_SCHEDULING__MAX_NUM_SEQ": "3"}, "scheduling.max_num_seq (from environment "
         "variable KVTIER_SCHEDULING__MAX_NUM_SEQ): unknown key; did you mean max_num_seqs?"),
        ("[scheduling]\nmax_num_seqs = 0\n", {}, "scheduling.max_num_seqs (from {path}): "),
        ("[server]\nmax_connections = -1\n", {}, "server.max_connections (from {path}): "),
        ("[policy]\nintervl_s = 1\n", {}, "policy.intervl_s (from {path}): unknown key; "),
        ("[policy]\nintervl_s = 1\n", {}, "; did you mean interval_s?"),
    ],
)  # fmt: skip
def test_a_bad_key_or_value_names_the_key_its_origin_and_the_closest_key(
    tmp_path, text, env, message
):
    from kvtier.settings.load import load_settings

    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    with pytest.raises(KvtierError) as error:
        load_settings(str(path), env=env)
    assert message.format(path=path) in str(error.value)


def test_one_default_per_setting():
    """The host tier's default is the model's, the same for every command that has no other
    reason (simulate sizes a data-centre node); TiersConfig and the loader agree."""
    from kvtier.cache.config import TiersConfig, default_host_bytes
    from kvtier.settings.load import load_settings

    assert TiersConfig().host_bytes == default_host_bytes()
    assert load_settings(None, env={}).tiers.host_bytes == default_host_bytes()


def test_a_policy_with_every_tier_off_is_said_not_dropped(tmp_path):
    from kvtier.settings.load import load_settings

    quiet = load_settings(None, env={}, flags={"tiers": {"host_bytes": "0"}})
    assert quiet.tiers is None and quiet.warnings() == []  # nothing asked for: nothing said
    told = load_settings(None, env={}, flags={"tiers": {"host_bytes": "0"}}, policy_name="cost")
    assert told.tiers is None
    assert "every tier is off" in told.warnings()[0] and "--policy" in told.warnings()[0]
    # kvtier serve says it on stderr as it starts (stopped before the model has loaded)
    serve = subprocess.Popen(
        [str(Path(sys.executable).with_name("kvtier")), "serve", "--host-bytes", "0",
         "--policy", "offload", "--port", "0"],
        stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    try:
        first = serve.stderr.readline()
    finally:
        serve.kill()
        serve.wait()
    assert first.startswith("kvtier: warning: every tier is off")
