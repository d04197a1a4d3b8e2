"""Forms as a decision: the accuracy budget, the form chooser and the cost policy's moves."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvtier.errors import KvtierError
from kvtier.policy.accuracy import bundled_figures, form_budget, load_figures
from kvtier.policy.actions import Move
from kvtier.policy.config import load_config
from kvtier.policy.cost_model import (
    MEASURED_CPU_CODECS,
    CodecSpeed,
    CostModel,
    CostProfile,
    TierLink,
    memory_bound_codecs,
)
from kvtier.policy.cost_policy import CostPolicy
from kvtier.policy.forms import FormChooser, chunk_restore_s, full_bytes
from kvtier.policy.ledger import Ledger, form_bytes
from kvtier.policy.restore import plan_restore
from kvtier.policy.view import ChunkView, QueueView

GB = 10**9
CHUNK = 256 * 131_072  # a 256-token chunk of Llama-3.1-8B KV, bf16


def figures_file(tmp_path, losses, models=("llama-3.1-8b",)):
    path = tmp_path / "forms.json"
    forms = {form: {"loss": loss} for form, loss in losses.items()}
    path.write_text(json.dumps({"models": list(models), "forms": forms}))
    return path


def model(remote_bandwidth: float, codecs=None) -> CostModel:
    """Slow recompute; a remote tier at `remote_bandwidth` and a 25 GB/s host."""
    links = {
        "host": TierLink(25e9, 10e-6),
        "disk": TierLink(5e9),
        "remote": TierLink(remote_bandwidth),
    }
    profile = CostProfile(0.01, 5e-4, 5e-8, links, codecs or memory_bound_codecs(1e12))
    return CostModel(profile)


# ---- the budget ----------------------------------------------------------------------------


def test_default_budget_is_full_precision_only_even_with_lossless_figures(tmp_path):
    path = figures_file(tmp_path, {"int8": 0.0, "int4": 0.0})
    assert form_budget(0.0, "llama-3.1-8b", path).allowed == ("full",)
    assert load_config(None).form_budget().allowed == ("full",)


def test_a_form_is_allowed_when_its_measured_loss_is_within_the_budget(tmp_path):
    path = figures_file(tmp_path, {"int8": 0.5, "int4": 3.0})
    assert form_budget(0.4, "m", path).allowed == ("full",)
    assert form_budget(0.5, "m", path).allowed == ("full", "int8")
    assert form_budget(3.0, "m", path).allowed == ("full", "int8", "int4")


def test_a_model_without_figures_allows_only_full_and_says_why():
    budget = form_budget(5.0, "llama-3.1-70b")
    assert budget.allowed == ("full",)
    assert "no accuracy figures for model llama-3.1-70b" in budget.note


def test_bundled_figures_cover_the_embedded_model():
    for name in ("smollm2", "smollm2-135m", "/cache/models/smollm2-135m-instruct-bf16"):
        figures = bundled_figures(name)
        assert figures is not None and set(figures.loss) == {"int8", "int4"}, name
    assert bundled_figures("llama-3.1-70b") is None


def test_config_reads_the_budget_and_the_file(tmp_path):
    path = figures_file(tmp_path, {"int8": 0.0, "int4": 9.0}, models=("smollm2-135m",))
    config = load_config(None, settings=[f'accuracy_file="{path}"', "max_accuracy_loss=1"])
    assert config.form_budget().allowed == ("full", "int8")
    policy = CostPolicy.from_config(config, model(1e9))
    assert policy.forms is not None and policy.forms.allowed == ("full", "int8")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["max_accuracy_loss=-1"], "policy.max_accuracy_loss"),
        (["max_accuracy_loss=nan"], "policy.max_accuracy_loss"),
        (['accuracy_file="/nonexistent/forms.json"'], "no such file"),
    ],
)
def test_bad_budget_settings_are_clear_errors(settings, message):
    with pytest.raises(KvtierError, match=message):
        load_config(None, settings=settings)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("not json", "cannot read it as JSON"),
        ('{"models": [], "forms": {"int8": {"loss": 1}}}', "'models' must be"),
        ('{"models": ["m"], "forms": {"fp8": {"loss": 1}}}', "unknown form 'fp8'"),
        ('{"models": ["m"], "forms": {"int8": {"loss": "high"}}}', "loss must be a number"),
    ],
)
def test_bad_figures_files_are_clear_errors(tmp_path, document, message):
    path = tmp_path / "forms.json"
    path.write_text(document)
    with pytest.raises(KvtierError, match=message):
        load_figures(path)


# ---- the chooser ---------------------------------------------------------------------------


def chunk(tier="device", form="full", size=CHUNK) -> ChunkView:
    return ChunkView(3, 768, 1024, tier, size, form)


ALL = ("full", "int8", "int4")


def test_on_a_slow_link_with_a_fast_codec_the_smallest_form_restores_fastest():
    chooser = FormChooser(model(1e9), ALL)
    assert chooser.choose(chunk(), "remote") == "int4"
    # ... unless the budget forbids it
    assert FormChooser(model(1e9), ("full", "int8")).choose(chunk(), "remote") == "int8"
    assert FormChooser(model(1e9)).choose(chunk(), "remote") == "full"


def test_choosing_many_forms_at_once_is_choosing_each():
    chunks = [chunk(), chunk(form="int8"), chunk(), chunk(form="int4")]
    tiers = ["remote", "remote", "host", "host"]
    for allowed in (ALL, ("full", "int8"), ("full",)):
        chooser = FormChooser(model(1e9), allowed)
        want = [chooser.choose(c, t) for c, t in zip(chunks, tiers, strict=True)]
        assert chooser.choose_many(chunks, tiers) == want
    # with a lossy form allowed, what is chosen depends on the tier (only disk and remote take
    # one) and on the chunk's own form (never more precise than it is)
    assert FormChooser(model(1e9), ALL).choose_many(chunks, tiers) == [
        "int4",
        "int4",
        "full",
        "int4",
    ]


def test_where_decoding_is_slower_than_the_link_full_precision_restores_fastest():
    # this machine's CPU decodes at 0.66-1.05 GB/s of output: slower than a 5 GB/s disk
    chooser = FormChooser(model(1e9, MEASURED_CPU_CODECS), ALL)
    assert chooser.choose(chunk(), "disk") == "full"
    assert chooser.restore_s(CHUNK, "full", "disk") < chooser.restore_s(CHUNK, "int4", "disk")
    # ... but a 0.1 GB/s remote store is slower than decoding
    slow = FormChooser(model(1e8, MEASURED_CPU_CODECS), ALL)
    assert slow.choose(chunk(), "remote") == "int4"


def test_the_host_tier_is_never_lossy():
    assert FormChooser(model(1e9), ALL).choose(chunk(), "host") == "full"


def test_precision_only_goes_down():
    chooser = FormChooser(model(1e9, MEASURED_CPU_CODECS), ("full", "int8"))
    # on a link where full would be fastest, an int4 chunk still stays int4
    stored = chunk("disk", "int4", form_bytes(CHUNK, "full", "int4"))
    assert chooser.choose(stored, "remote") == "int4"
    restored = chunk("device", "int4")  # decoded on the device, but lossy
    assert chooser.choose(restored, "disk") == "int4"


def test_restore_time_counts_the_decode_of_a_quantized_chunk():
    m = model(1e9)
    stored = chunk("remote", "int4", form_bytes(CHUNK, "full", "int4"))
    assert full_bytes(stored) == pytest.approx(CHUNK, rel=1e-6)
    expected = m.load_s(stored.size_bytes, "remote") + m.decode_s(CHUNK, "int4")
    assert chunk_restore_s(m, stored) == pytest.approx(expected)
    assert m.decode_s(CHUNK, "int4") > 0 and m.decode_s(CHUNK, "full") == 0
    assert chunk_restore_s(m, chunk()) == 0.0


def test_the_restore_planner_recomputes_a_chunk_whose_decode_is_too_slow():
    # a 1-token chunk, cheap to recompute; stored as int4 with a very slow decoder
    slow_codec = {"int8": CodecSpeed(1e3, 1e3), "int4": CodecSpeed(1e3, 1e3)}
    m = model(1e12, slow_codec)
    small = ChunkView(0, 0, 1, "remote", 1000, "int4")
    assert plan_restore([small], m).recompute == (0,)
    assert plan_restore([dataclasses.replace(small, form="full")], m).loads == (0,)


def test_codec_speeds_derived_from_memory_bandwidth_decode_faster_than_they_encode():
    for form, speed in memory_bound_codecs(1e12).items():
        assert speed.decode_bytes_per_s > speed.encode_bytes_per_s, form
    assert (
        CodecSpeed.memory_bound(1e12, "int4").decode_bytes_per_s
        > CodecSpeed.memory_bound(1e12, "int8").decode_bytes_per_s
    )
    with pytest.raises(KvtierError):
        CodecSpeed(0, 1)


# ---- the cost policy -----------------------------------------------------------------------


def spilled_forms(kv, allowed) -> dict[str, set[str]]:
    """Forms of the moves the cost policy makes for an idle session on a full device with a
    queue, the only lower tier being a slow remote store."""
    m = model(1e9)
    policy = CostPolicy(m, forms=FormChooser(m, allowed))
    s = kv.session("a", 6144)
    queue = QueueView(waiting_requests=20, waiting_tokens=20 * 4096)
    capacity = {"device": 80 * GB, "remote": 500 * GB}
    v = kv.view([s], capacity, other_used={"device": 75 * GB}, queue=queue)
    actions = policy.decide(v, 5.0)
    Ledger(v).apply_all(actions)  # budgets hold with the smaller forms
    moves = [a for a in actions if isinstance(a, Move)]
    assert moves
    out: dict[str, set[str]] = {}
    for move in moves:
        out.setdefault(move.tier, set()).add(move.form)
    return out


def test_the_cost_policy_stores_moves_to_a_slow_tier_in_the_allowed_form(kv):
    assert spilled_forms(kv, ALL) == {"remote": {"int4"}}
    assert spilled_forms(kv, ("full", "int8")) == {"remote": {"int8"}}
    assert spilled_forms(kv, ("full",)) == {"remote": {"full"}}
