"""The connector against every vLLM release it is checked against, read from the committed
interface snapshots (tests/data/vllm_interface/, `make vllm-interface` regenerates them), and
the installed vLLM against its snapshot, so a changed install is noticed.

The snapshot checks parse kvtier's sources the same way the snapshots parse vLLM's, so they
run without vLLM: every abstract method implemented, every override callable the way vLLM
calls the base, every import and attribute kvtier uses present in each release.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess

import pytest

from kvtier.errors import KvtierError
from kvtier.integrations.vllm.compat import (
    CHECKED_RELEASES,
    refuse_sleep_mode,
    release_of,
    unchecked_release_note,
)

from .conftest import REPO, VLLM_PYTHON, need_vllm
from .vllm_interface import (
    INTEGRATION,
    SNAPSHOTS,
    ReleaseSource,
    describe_class,
    find_class,
    kvtier_imports,
)
from .vllm_interface import snapshot as read_snapshot

SNAPSHOT_FILES = sorted(SNAPSHOTS.glob("*.json"))
BUILT_AGAINST = "0.32.0"  # the release the connector's return contracts follow

# what kvtier reads off vLLM's objects, beyond the methods it overrides
READS = {
    "KVConnectorBase_V1": {
        "_vllm_config",
        "_kv_transfer_config",
        "_kv_cache_config",
        "_kv_cache_manager",
        "_get_connector_metadata",
    },
    "VllmConfig": {"parallel_config", "cache_config", "model_config", "kv_transfer_config"},
    "ParallelConfig": {"world_size"},
    "CacheConfig": {"block_size"},
    "ModelConfig": {"model", "enable_sleep_mode"},
    "KVTransferConfig": {"engine_id", "kv_connector_extra_config", "kv_load_failure_policy"},
    "KVCacheConfig": {"num_blocks"},
    "KVCacheBlocks": {"get_block_ids"},
    "KVCacheManager": {"get_block_ids"},
    "SchedulerOutput": {"num_scheduled_tokens"},
    "KVConnectorOutput": {"kv_connector_worker_meta"},
    "KVConnectorStats": {"data"},
    "Request": {
        "request_id",
        "all_token_ids",
        "num_computed_tokens",
        "num_prompt_tokens",
        "cache_salt",
        "kv_transfer_params",
    },
}


def load(path) -> dict:
    return json.loads(path.read_text())


def kvtier_subclasses() -> list[tuple[str, dict, str]]:
    """(class, its interface, the vLLM base it extends) for each kvtier class on a vLLM base."""
    bases = {name for _, name in kvtier_imports()}
    found = []
    for file in sorted(INTEGRATION.glob("*.py")):
        for node in ast.parse(file.read_text()).body:
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    if isinstance(base, ast.Name) and base.id in bases:
                        found.append((node.name, describe_class(node), base.id))
    return found


def call_mismatches(ours: dict, theirs: dict) -> list[str]:
    """Why vLLM's call of the base method would not fit ours: the same kind, its positional
    parameters in order, its keyword names accepted, what it may omit defaulted on our side,
    and every parameter of ours that it never passes defaulted."""
    if ours["kind"] != theirs["kind"]:
        return [f"is a {ours['kind']}, vLLM's is a {theirs['kind']}"]
    problems = []
    positional = ("positional_only", "positional_or_keyword")
    our_pos = [p for p in ours["params"] if p["kind"] in positional]
    their_pos = [p for p in theirs["params"] if p["kind"] in positional]
    our_kinds = {p["kind"] for p in ours["params"]}
    by_name = {p["name"]: p for p in ours["params"]}
    for i, param in enumerate(their_pos):
        if i >= len(our_pos):
            if "var_positional" not in our_kinds:
                problems.append(f"takes no positional parameter {i} ({param['name']})")
            continue
        mine = our_pos[i]
        if mine["name"] != param["name"] and param["kind"] != "positional_only":
            problems.append(f"parameter {i} is {mine['name']}, vLLM's is {param['name']}")
        if param["default"] and not mine["default"]:
            problems.append(f"{mine['name']} needs a default: vLLM may leave it out")
    for param in theirs["params"]:
        if param["kind"] == "keyword_only":
            mine = by_name.get(param["name"])
            if mine is None and "var_keyword" not in our_kinds:
                problems.append(f"does not accept keyword {param['name']}")
            elif mine is not None and param["default"] and not mine["default"]:
                problems.append(f"{param['name']} needs a default: vLLM may leave it out")
        elif param["kind"] in ("var_positional", "var_keyword") and param["kind"] not in our_kinds:
            problems.append(f"takes no {param['kind']} (vLLM's {param['name']})")
    their_names = {p["name"] for p in theirs["params"]}
    for i, mine in enumerate(ours["params"]):
        extra = mine["name"] not in their_names and not (
            mine["kind"] in positional and i < len(their_pos)
        )
        if extra and mine["kind"] in (*positional, "keyword_only") and not mine["default"]:
            problems.append(f"{mine['name']} is ours alone and has no default")
    return problems


@pytest.fixture(params=SNAPSHOT_FILES, ids=lambda p: p.stem)
def release(request) -> dict:
    return load(request.param)


def test_the_checked_releases_are_the_committed_snapshots():
    assert sorted(release_of(load(p)["version"]) for p in SNAPSHOT_FILES) == sorted(
        CHECKED_RELEASES
    )


def test_every_name_kvtier_imports_from_vllm_is_in_the_release(release):
    recorded = {(i["module"], i["name"]): i["present"] for i in release["imports"]}
    unrecorded = [name for name in kvtier_imports() if name not in recorded]
    assert not unrecorded, f"kvtier imports {unrecorded} now: `make vllm-interface`"
    missing = [name for name in kvtier_imports() if not recorded[name]]
    assert not missing, f"vLLM {release['version']} no longer defines {missing}"


def test_every_abstract_method_of_vllms_bases_is_implemented(release):
    subclasses = kvtier_subclasses()
    assert {base for _, _, base in subclasses} >= {
        "KVConnectorBase_V1",
        "KVConnectorMetadata",
        "KVConnectorWorkerMetadata",
        "KVConnectorStats",
    }
    for name, ours, base in subclasses:
        theirs = release["classes"][base]["methods"]
        abstract = {m for m, sig in theirs.items() if sig["abstract"]}
        missing = sorted(abstract - set(ours["methods"]))
        assert not missing, f"{name} lacks vLLM {release['version']}'s abstract {missing}"


def test_every_override_accepts_vllms_call_of_the_base(release):
    checked = 0
    for name, ours, base in kvtier_subclasses():
        theirs = release["classes"][base]["methods"]
        for method, signature in ours["methods"].items():
            if method in theirs and method != "__init__":
                problems = call_mismatches(signature, theirs[method])
                assert not problems, f"{name}.{method} on vLLM {release['version']}: {problems}"
                checked += 1
    assert checked >= 20  # the connector's overrides, its metadata's and its stats'


def test_the_overridden_methods_return_what_they_did_in_the_release_built_against(release):
    built = next(load(p) for p in SNAPSHOT_FILES if release_of(load(p)["version"]) == BUILT_AGAINST)
    for _, ours, base in kvtier_subclasses():
        now, then = release["classes"][base]["methods"], built["classes"][base]["methods"]
        for method in set(ours["methods"]) & set(now) & set(then):
            assert now[method]["returns"] == then[method]["returns"], (
                f"vLLM {release['version']} changed what {base}.{method} returns"
            )


def test_the_attributes_kvtier_reads_are_in_the_release(release):
    for cls, names in READS.items():
        known = release["classes"][cls]
        missing = sorted(names - set(known["attributes"]) - set(known["methods"]))
        assert not missing, f"vLLM {release['version']}'s {cls} lacks {missing}"


def test_a_release_outside_the_checked_ones_is_named_at_start_up():
    assert unchecked_release_note("0.32.0+cpu") is None
    assert unchecked_release_note("0.34.0") is None
    note = unchecked_release_note("0.35.1")
    assert note is not None and "0.35.1" in note and "0.32.0, 0.34.0" in note


def test_sleep_mode_is_refused_with_a_clear_error():
    refuse_sleep_mode(False)
    with pytest.raises(KvtierError, match="sleep mode"):
        refuse_sleep_mode(True)


def test_the_snapshot_reader_records_a_signature_change(tmp_path):
    """The reader itself: a changed parameter, a new abstract method and a moved import all
    show in the data the tests compare."""
    package = tmp_path / "site" / "vllm"
    (package / "v1").mkdir(parents=True)
    (tmp_path / "site" / "vllm-9.9.9.dist-info").mkdir()
    (tmp_path / "site" / "vllm-9.9.9.dist-info" / "METADATA").write_text(
        "Name: vllm\nVersion: 9.9.9\n"
    )
    (package / "__init__.py").write_text("")
    (package / "v1" / "__init__.py").write_text("from .base import Base as Reexported\n")
    (package / "v1" / "base.py").write_text(
        "from abc import ABC, abstractmethod\n"
        "class Base(ABC):\n"
        "    x: int\n"
        "    @abstractmethod\n"
        "    def load(self, ctx, /, n=1, *, hint: str, **kw) -> int: ...\n"
        "    @classmethod\n"
        "    def make(cls, config) -> 'Base':\n"
        "        cls.y = 0\n"
        "    def bind(self, m):\n"
        "        self.manager = m\n"
    )
    base = ReleaseSource(tmp_path / "site")
    module, node = find_class(base, "vllm.v1", "Reexported")
    assert module == "vllm.v1.base"
    described = describe_class(node)
    assert described["attributes"] == ["manager", "x"]
    load_ = described["methods"]["load"]
    assert load_["abstract"] and load_["returns"] == "int"
    assert [(p["name"], p["kind"], p["default"]) for p in load_["params"]] == [
        ("ctx", "positional_only", False),
        ("n", "positional_or_keyword", True),
        ("hint", "keyword_only", False),
        ("kw", "var_keyword", False),
    ]
    assert described["methods"]["make"]["kind"] == "classmethod"
    assert find_class(base, "vllm.v1.base", "Gone") is None
    assert base.distribution() == ("vllm", "9.9.9")


def test_call_mismatches_name_what_vllm_could_not_call():
    def sig(*params, kind="instance"):
        fields = ("name", "kind", "default")
        return {"kind": kind, "params": [dict(zip(fields, p, strict=True)) for p in params]}

    base = sig(("request", "positional_or_keyword", False), ("n", "positional_or_keyword", True))
    assert call_mismatches(base, base) == []
    renamed = sig(("req", "positional_or_keyword", False), ("n", "positional_or_keyword", True))
    assert "parameter 0 is req" in call_mismatches(renamed, base)[0]
    short = sig(("request", "positional_or_keyword", False))
    assert "no positional parameter 1" in call_mismatches(short, base)[0]
    extra = sig(
        ("request", "positional_or_keyword", False),
        ("n", "positional_or_keyword", True),
        ("mine", "keyword_only", False),
    )
    assert "mine is ours alone" in call_mismatches(extra, base)[0]
    assert "classmethod" in call_mismatches(sig(kind="classmethod"), sig())[0]


def test_the_installed_vllm_matches_its_committed_snapshot():
    need_vllm()
    (site,) = VLLM_PYTHON.parents[1].glob("lib/python3*/site-packages")
    live = read_snapshot(ReleaseSource(site))
    name = f"{live['distribution']}-{live['version']}.json"
    committed = SNAPSHOTS / name
    assert committed.exists(), f"no snapshot of the installed {name}: `make vllm-interface`"
    assert live == load(committed), f"the installed vLLM differs from {name}"


def test_the_connector_classes_load_complete_on_the_installed_vllm():
    need_vllm()
    code = (
        "from kvtier.integrations.vllm.connector import KvtierConnector, KvtierWorkerMetadata\n"
        "from kvtier.integrations.vllm.stats import KvtierStats\n"
        "for cls in (KvtierConnector, KvtierWorkerMetadata, KvtierStats):\n"
        "    left = getattr(cls, '__abstractmethods__', frozenset())\n"
        "    assert not left, (cls, sorted(left))\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-4000:]
