"""Configuration: file < environment < flags, and errors that name the key, its source and the
allowed values."""

from __future__ import annotations

import argparse
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from kvtier.errors import KvtierError
from kvtier.policy import registry
from kvtier.policy.config import (
    load_config,
    parse_request_overrides,
)
from kvtier.policy.cost_model import CostProfile
from kvtier.policy.cost_policy import CostPolicy
from kvtier.policy.offload import OffloadPolicy
from kvtier.policy.registry import POLICIES, build_policy
from kvtier.policy.ttl import TtlPolicy
from kvtier.settings.flags import add_config_argument, add_table_arguments, from_args

SAMPLE = """
[scheduling]        # another table of the same file
block_size = 16

[policy]
name = "ttl"
interval_s = 2.5

[policy.ttl.seconds]
device = 30
host = 300

[policy.cost]
horizon_s = 10
dollars_per_gb_hour = { host = 0.01 }

[policy.profile]
prefill_fixed_s = 0.01
prefill_token_s = 3e-5
prefill_pair_s = 1e-9

[policy.profile.links.host]
bandwidth = 20e9
latency_s = 1e-5
"""


@pytest.fixture
def toml(tmp_path):
    def write(text: str):
        path = tmp_path / "kvtier.toml"
        path.write_text(text)
        return path

    return write


def test_defaults_build_the_cost_policy():
    policy = build_policy(load_config())
    assert isinstance(policy, CostPolicy)
    assert policy.horizon_s == 5.0


def test_file_values_are_read_and_built(toml):
    config = load_config(toml(SAMPLE))
    assert config.name == "ttl" and config.interval_s == 2.5 and config.horizon_s == 10
    policy = build_policy(config)
    assert isinstance(policy, TtlPolicy) and policy.seconds == {"device": 30, "host": 300}
    model = config.cost_model()
    assert model.profile.links["host"].bandwidth == 20e9
    assert model.profile.links["disk"].bandwidth == 5e9  # tiers not given keep their defaults
    assert model.prices.rent_s_per_gb_hour["host"] == pytest.approx(3600 * 0.01 / 2.5)


def test_environment_overrides_file_and_flags_override_environment(toml):
    env = {
        "KVTIER_POLICY__NAME": "offload",
        "KVTIER_POLICY__OFFLOAD__WATERMARK": "0.7",
        "KVTIER_POLICY__INTERVAL_S": "4",
        "KVTIER_CACHE": "/elsewhere",  # not ours
    }
    config = load_config(toml(SAMPLE), env=env)
    assert config.name == "offload" and config.interval_s == 4 and config.offload.watermark == 0.7
    config = load_config(toml(SAMPLE), env=env, settings=["offload.watermark=0.6"], policy="cost")
    assert config.name == "cost" and config.offload.watermark == 0.6
    assert isinstance(build_policy(load_config(env=env)), OffloadPolicy)


def test_command_line_wiring(toml, monkeypatch):
    parser = argparse.ArgumentParser()
    add_config_argument(parser)
    add_table_arguments(parser, "policy")
    args = parser.parse_args(
        [
            "--config",
            str(toml(SAMPLE)),
            "--policy",
            "retain",
            "--policy-set",
            "ttl.seconds={device = 5}",
        ]
    )
    monkeypatch.delenv("KVTIER_POLICY__NAME", raising=False)
    config = from_args(args, ("policy",)).policy
    assert config.name == "retain" and config.ttl.seconds == {"device": 5}


def test_pricing_units_reach_the_policy_from_the_settings():
    # what `--policy-set cost.pricing_chunks=N` sets is what the built policy's table merges
    assert build_policy(load_config()).pricing_chunks == 8
    policy = build_policy(load_config(settings=["cost.pricing_chunks=2"]))
    assert isinstance(policy, CostPolicy) and policy._state.unit == 2


def test_a_measured_profile_replaces_the_configured_one():
    measured = CostProfile(0.0, 1e-3, 0.0)
    policy = build_policy(load_config(), measured)
    assert policy.model.profile is measured


def test_unknown_policy_name_lists_the_choices():
    with pytest.raises(
        KvtierError, match="unknown policy 'lru'; choose one of retain, recompute"
    ) as err:
        load_config(policy="lru")
    assert all(name in str(err.value) for name in POLICIES)


def test_bad_value_names_key_source_and_problem(toml):
    with pytest.raises(KvtierError) as err:
        load_config(toml('[policy]\ninterval_s = "soon"\n'))
    message = str(err.value)
    assert "policy.interval_s" in message and "kvtier.toml" in message and "'soon'" in message
    with pytest.raises(KvtierError, match=r"policy\.cost\.horizon_s \(from environment variable"):
        load_config(env={"KVTIER_POLICY__COST__HORIZON_S": "-1"})
    with pytest.raises(KvtierError, match=r"policy\.offload\.watermark \(from --policy-set"):
        load_config(settings=["offload.watermark=2"])


def test_bad_tier_name_lists_the_tiers(toml):
    with pytest.raises(
        KvtierError, match=r"policy\.ttl\.seconds\.gpu.*'device', 'host', 'disk' or 'remote'"
    ):
        load_config(toml("[policy.ttl.seconds]\ngpu = 5\n"))


def test_unknown_key_lists_the_keys_allowed_there(toml):
    with pytest.raises(
        KvtierError, match=r"policy\.cost\.horizon .*unknown key; allowed here: horizon_s"
    ):
        load_config(toml("[policy.cost]\nhorizon = 5\n"))
    with pytest.raises(KvtierError, match="unknown key; allowed here: name, interval_s"):
        load_config(settings=["nme=cost"])


def test_partial_profile_coefficients_are_rejected():
    with pytest.raises(KvtierError, match="all three of prefill_fixed_s"):
        load_config(settings=["profile.prefill_token_s=1e-4"])


def test_file_problems_are_clear(tmp_path, toml):
    with pytest.raises(KvtierError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(KvtierError, match="not valid TOML"):
        load_config(toml("[policy\n"))
    with pytest.raises(KvtierError, match="must be a table"):
        load_config(toml('policy = "cost"\n'))
    with pytest.raises(KvtierError, match="KEY=VALUE"):
        load_config(settings=["horizon"])


def test_bad_module_paths_say_what_is_wrong():
    with pytest.raises(KvtierError, match="cannot import module 'no_such_module_xyz'"):
        load_config(policy="no_such_module_xyz:Policy")
    with pytest.raises(KvtierError, match="module 'json' has no 'Nope'"):
        load_config(policy="json:Nope")
    with pytest.raises(
        KvtierError, match=r"not a subclass of kvtier\.policy\.base\.RetentionPolicy"
    ):
        load_config(policy="json:JSONDecoder")
    with pytest.raises(KvtierError, match=r"must look like package\.module:ClassName"):
        load_config(policy=":Policy")


CUSTOM = """
from dataclasses import dataclass
from kvtier.policy.actions import Drop
from kvtier.policy.base import RetentionPolicy

@dataclass
class DropOld(RetentionPolicy):
    after_s: float = 60.0

    def decide(self, view, now):
        return [Drop(s.session_id) for s in view.candidates(now) if s.idle_s(now) > self.after_s]
"""


def test_custom_policy_from_module_path_gets_its_options(tmp_path, monkeypatch):
    (tmp_path / "my_policies.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(policy="my_policies:DropOld", settings=["options.after_s=5"])
    assert build_policy(config).after_s == 5
    with pytest.raises(KvtierError, match=r"bad \[policy\.options\].*'speed'"):
        build_policy(load_config(policy="my_policies:DropOld", settings=["options.speed=1"]))


def test_custom_policy_from_an_entry_point(tmp_path, monkeypatch):
    (tmp_path / "plugin_policies.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin = EntryPoint("dropold", "plugin_policies:DropOld", registry.ENTRY_POINT_GROUP)
    broken = EntryPoint("broken", "plugin_policies:Missing", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [plugin, broken])
    assert type(build_policy(load_config(policy="dropold"))).__name__ == "DropOld"
    with pytest.raises(KvtierError, match=r"policy 'broken' .* failed to load"):
        load_config(policy="broken")
    with pytest.raises(KvtierError, match=r"choose one of .*broken, dropold"):
        load_config(policy="nope")


def test_shipped_policies_without_options_reject_them():
    with pytest.raises(KvtierError, match="policy 'retain': bad"):
        build_policy(load_config(policy="retain", settings=["options.x=1"]))


def test_request_overrides_are_validated():
    hints = parse_request_overrides({"pin": True, "priority": 2, "ttl_s": 600})
    assert hints.pin and hints.priority == 2 and hints.ttl_s == 600
    with pytest.raises(KvtierError, match=r"request\.priority.*less than or equal to 8"):
        parse_request_overrides({"priority": 99})
    with pytest.raises(
        KvtierError,
        match=r"request\.pinned: unknown key; allowed here: close, expect_return_s, priority, "
        r"pin, ttl_s",
    ):
        parse_request_overrides({"pinned": True})


def test_the_sample_file_in_the_docs_is_valid(toml):
    docs = Path(__file__).resolve().parents[2] / "docs" / "policy.md"
    sample = docs.read_text().split("```toml\n")[1].split("```")[0]
    config = load_config(toml(sample))
    assert isinstance(build_policy(config), CostPolicy)
    assert config.cost_model().prices.rent_s_per_gb_hour["device"] == pytest.approx(45.0)
