"""Low-rank KV: bases fitted on real calibration KV, reconstruction, the press and the codec."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvtier.compress import CompressionConfig, PressSpec, fitted_bases, parse_method
from kvtier.compress.fitted_bases import LowRankFit, provide_basis, ready_basis
from kvtier.compress.lowrank import LowRankBasis, save_basis
from kvtier.compress.presses.lowrank import LowRankCodec, LowRankPress
from kvtier.compress.registry import build_lowrank_press
from kvtier.engine import SamplingParams
from kvtier.errors import KvtierError
from kvtier.lowrank import bases as lowrank
from kvtier.lowrank.bases import cache_path, load_or_fit, with_fitted_bases
from kvtier.lowrank.fit import (
    calibration_text,
    calibration_tokens,
    fit_basis,
    prompt_kv,
)
from kvtier.models.resolve import resolve_model_dir

from .conftest import prose_prompt

CALIBRATION = 384  # tokens: enough for a well-posed PCA of 192 dimensions, quick to prefill


@pytest.fixture(scope="module")
def calibration_ids(_engine) -> list[int]:
    return calibration_tokens(_engine.tokenizer, calibration_text("workshop_notes"), CALIBRATION)


@pytest.fixture(scope="module")
def bases(_engine, calibration_ids) -> dict[str, LowRankBasis]:
    return {g: fit_basis(_engine, calibration_ids, g) for g in ("head", "layer")}


@pytest.fixture(scope="module")
def held_out_kv(_engine) -> torch.Tensor:
    """KV of a different text than the calibration one (tests/data/english.txt)."""
    return prompt_kv(_engine, prose_prompt(_engine.tokenizer, 256))


@pytest.fixture
def empty_cache(tmp_path, monkeypatch, model_dir):
    """$KVTIER_CACHE with no fitted bases yet; the converted model is linked in, not
    converted again."""
    (tmp_path / "models").symlink_to(model_dir.parent)
    monkeypatch.setenv("KVTIER_CACHE", str(tmp_path))
    return tmp_path


def relative_error(restored: torch.Tensor, kv: torch.Tensor) -> float:
    return ((restored - kv).norm() / kv.norm()).item()


@pytest.mark.parametrize("grouping", ["head", "layer"])
@pytest.mark.slow
def test_bases_are_orthonormal_and_sorted_by_variance(bases, grouping):
    basis = bases[grouping]
    width = 64 if grouping == "head" else 3 * 64
    groups = 3 if grouping == "head" else 1
    assert basis.directions.shape == (30, 2, groups, width, width)
    gram = basis.directions.transpose(-1, -2) @ basis.directions
    assert torch.allclose(gram, torch.eye(width).expand_as(gram), atol=1e-5)
    assert torch.all(basis.variance[..., :-1] >= basis.variance[..., 1:])


@pytest.mark.parametrize("grouping", ["head", "layer"])
@pytest.mark.slow
def test_full_rank_reproduces_the_kv(bases, held_out_kv, grouping):
    basis = bases[grouping]
    restored = basis.reconstruct(held_out_kv, basis.width)
    assert restored.shape == held_out_kv.shape and restored.dtype == held_out_kv.dtype
    assert relative_error(restored, held_out_kv) < 1e-5


@pytest.mark.parametrize("grouping", ["head", "layer"])
@pytest.mark.slow
def test_error_falls_with_rank_on_text_not_calibrated_on(bases, held_out_kv, grouping):
    basis = bases[grouping]
    ranks = [r for r in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192) if r <= basis.width]
    errors = [relative_error(basis.reconstruct(held_out_kv, r), held_out_kv) for r in ranks]
    assert all(a > b for a, b in itertools.pairwise(errors)), errors
    assert errors[0] > 0.1 and errors[-1] < 1e-5


@pytest.mark.slow
def test_grouping_all_heads_keeps_more_at_equal_bytes(bases, held_out_kv):
    # Per-head bases are one candidate of the layer-wide fit, so at the same share of bytes
    # the layer grouping reconstructs at least as well (here: clearly better).
    for share in (0.25, 0.5, 0.75):
        per_head = bases["head"].reconstruct(held_out_kv, int(64 * share))
        per_layer = bases["layer"].reconstruct(held_out_kv, int(192 * share))
        assert relative_error(per_layer, held_out_kv) < relative_error(per_head, held_out_kv)


@pytest.mark.slow
def test_fit_is_deterministic(_engine, calibration_ids, bases):
    again = fit_basis(_engine, calibration_ids, "layer")
    for name in ("mean", "directions", "variance"):
        assert torch.equal(getattr(again, name), getattr(bases["layer"], name))


@pytest.mark.slow
def test_fits_are_cached_on_disk_per_model_text_and_grouping(empty_cache):
    first = load_or_fit(LowRankFit(grouping="head", num_tokens=128))  # fitted now: no file yet
    [path] = (empty_cache / "lowrank").glob("*.safetensors")
    assert path == cache_path(resolve_model_dir(None), "workshop_notes", "head", 128)
    mtime = path.stat().st_mtime_ns
    lowrank._load_or_fit.cache_clear()  # as a new process would: read back from disk
    again = load_or_fit(LowRankFit(grouping="head", num_tokens=128))
    assert path.stat().st_mtime_ns == mtime
    for name in ("mean", "directions", "variance"):
        assert torch.equal(getattr(again, name), getattr(first, name))
    assert again.grouping == "head" and (again.num_kv_heads, again.head_dim) == (3, 64)
    others = [
        cache_path(resolve_model_dir(None), *key)
        for key in (
            ("prose", "head", 128),
            ("workshop_notes", "layer", 128),
            ("workshop_notes", "head", 256),
        )
    ]
    assert len({path, *others}) == 4


@pytest.mark.slow
def test_ratio_sets_the_rank_as_the_share_of_bytes_removed(bases):
    basis = bases["layer"]
    assert [basis.rank_for(r) for r in (0.0, 0.25, 0.5, 0.75, 0.875)] == [192, 144, 96, 48, 24]
    assert bases["head"].rank_for(0.5) == 32
    assert basis.rank_for(rank=7) == 7


@pytest.mark.parametrize("rank", [16, 96, 192])
@pytest.mark.slow
def test_codec_moves_rank_over_width_of_the_bytes(bases, held_out_kv, rank):
    basis = bases["layer"]
    codec = LowRankCodec(basis, rank)
    assert codec.form == f"lowrank{rank}"
    block = held_out_kv[:, :, :, :16].bfloat16()  # one pool block as the bf16 pool holds it
    payload = codec.encode(block)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == block.numel() * 2 * rank // 192
    restored = codec.decode(payload, block.shape, torch.bfloat16)
    assert restored.shape == block.shape and restored.dtype == torch.bfloat16
    # float16 coefficients add almost nothing to the projection's own error
    projected = basis.reconstruct(block.float(), rank)
    assert relative_error(restored.float(), projected) < 4e-3
    if rank == 192:
        assert relative_error(restored.float(), block.float()) < 4e-3


@pytest.mark.slow
def test_press_keeps_sinks_and_a_residual_window_exact(bases, held_out_kv):
    press = LowRankPress(bases["layer"], 16, residual=32)  # and the default 4 sinks
    out = press.apply(held_out_kv)
    assert torch.equal(out[:, :, :, :4], held_out_kv[:, :, :, :4])
    assert torch.equal(out[:, :, :, -32:], held_out_kv[:, :, :, -32:])
    middle = held_out_kv[:, :, :, 4:-32]
    assert torch.equal(out[:, :, :, 4:-32], bases["layer"].reconstruct(middle, 16))
    assert relative_error(out[:, :, :, 4:-32], middle) > 0.1


def test_method_strings():
    assert parse_method("lowrank:0.5").presses == [PressSpec(name="lowrank", ratio=0.5)]
    [spec] = parse_method("lowrank@r32").presses
    assert spec.options == {"rank": 32} and spec.ratio == 0
    assert parse_method("lowrank:0").is_identity
    assert not parse_method("lowrank@r192").is_identity
    assert [p.name for p in parse_method("snapkv:0.5+lowrank:0.5").presses] == [
        "snapkv",
        "lowrank",
    ]


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("lowrank@32", "keeps every token"),
        ("lowrank@r0", "positive integer"),
        ("lowrank@rx", "not a int"),
        ("lowrank:1.5", r"must be in \[0, 1\)"),
        ("lowrank:-0.1", r"must be in \[0, 1\)"),
        ("lowrank:half", "not a float"),
    ],
)
def test_bad_method_strings(method, message):
    with pytest.raises(KvtierError, match=message):
        parse_method(method)


@pytest.mark.slow
def test_bad_ranks_options_and_geometry(bases):
    basis = bases["layer"]
    for rank in (0, 193, -1, 2.5, "32", True):
        with pytest.raises(KvtierError, match="rank must be an integer from 1 to 192"):
            basis.rank_for(rank=rank)
    with pytest.raises(KvtierError, match="keeps every token"):
        PressSpec(name="lowrank", keep_tokens=100)
    with pytest.raises(KvtierError, match="unknown options"):
        build_lowrank_press(PressSpec(name="lowrank", ratio=0.5, options={"rnk": 3}))
    with pytest.raises(KvtierError, match="grouping must be one of"):
        build_lowrank_press(PressSpec(name="lowrank", options={"grouping": "token"}))
    with pytest.raises(KvtierError, match="at least 64 tokens"):
        build_lowrank_press(PressSpec(name="lowrank", options={"calibration_tokens": 8}))
    with pytest.raises(KvtierError, match="unknown calibration text"):
        spec = PressSpec(name="lowrank", ratio=0.5, options={"calibration": "nope"})
        with_fitted_bases(CompressionConfig(presses=[spec]))
    with pytest.raises(KvtierError, match="residual must be"):
        LowRankPress(basis, 8, residual=-1)
    with pytest.raises(KvtierError, match="sinks must be"):
        LowRankPress(basis, 8, sinks=1.5)
    with pytest.raises(KvtierError, match="fitted for 30 layers x 3 KV heads"):
        basis.check_geometry(32, 8, 128)


@pytest.fixture
def no_ready_bases(monkeypatch):
    """This test starts with no basis handed to presses yet, as a new process would."""
    monkeypatch.setattr(fitted_bases, "_ready", {})


@pytest.mark.slow
def test_engine_full_rank_decodes_like_full_cache(engine, bases, empty_cache, no_ready_bases):
    # The fixture's fit stands in for the calibration step's own (same model, text and
    # length), so it reads it from the disk cache instead of fitting again.
    save_basis(
        bases["layer"], cache_path(resolve_model_dir(None), "workshop_notes", "layer", CALIBRATION)
    )
    prompt = prose_prompt(engine.tokenizer, 120)
    params = SamplingParams(temperature=0, max_tokens=8)
    [full] = engine.generate([prompt], params)
    engine.set_compression(parse_method("lowrank:0"))  # identity: no press at all
    assert engine.compressor is None
    for rank, same in ((192, True), (4, False)):
        spec = PressSpec(name="lowrank", options={"calibration_tokens": CALIBRATION, "rank": rank})
        engine.set_compression(with_fitted_bases(CompressionConfig(presses=[spec])))
        assert engine.compressor.lowrank.basis.directions.shape[-1] == 192
        [out] = engine.generate([prompt], params)
        assert (out.token_ids == full.token_ids) is same
        # a simulation: the pool still holds full-precision bytes
        assert out.kv_bytes_held == full.kv_bytes_held


@pytest.mark.slow
def test_the_engine_never_fits_it_takes_the_basis_the_calibration_step_provided(
    engine, bases, no_ready_bases
):
    spec = PressSpec(name="lowrank", options={"calibration_tokens": 100, "rank": 8})
    with pytest.raises(KvtierError, match=r"no basis fitted .*with_fitted_bases"):
        engine.set_compression(CompressionConfig(presses=[spec]))
    assert engine.compressor is None
    provide_basis(LowRankFit(num_tokens=100), bases["head"])
    engine.set_compression(CompressionConfig(presses=[spec]))
    assert engine.compressor.lowrank.basis is bases["head"]
    assert engine.compressor.lowrank.rank == 8


@pytest.mark.slow
def test_eval_reads_a_missing_basis_from_the_disk_cache_before_the_engine_needs_it(
    engine, bases, tokenizer, empty_cache, no_ready_bases
):
    from kvtier.eval.methods import plan_runs
    from kvtier.eval.runner import RunnerConfig, run_eval
    from kvtier.eval.tasks import generate_samples

    # stands in for the default fit (4,096 tokens), which would take a minute to compute
    save_basis(bases["layer"], cache_path(resolve_model_dir(None), "workshop_notes", "layer", 4096))
    samples = generate_samples(tokenizer, ["niah_single"], [512], 1, seed=0)
    result = run_eval(samples, plan_runs(["lowrank@r32"], [0]), RunnerConfig(), engine=engine)
    assert [s.spec for s in result.samples] == ["full", "lowrank@r32"]
    assert torch.equal(ready_basis(LowRankFit()).directions, bases["layer"].directions)


def test_eval_runs_lowrank_once_per_ratio():
    from kvtier.eval.methods import plan_runs

    runs = plan_runs(["full", "lowrank", "lowrank@r32", "kivi4"], [0, 0.25, 0.5, 0.75])
    assert [r.spec for r in runs] == [
        "full",
        "lowrank:0.25",
        "lowrank:0.5",
        "lowrank:0.75",
        "lowrank@r32",
        "kivi4",
    ]
    with pytest.raises(KvtierError, match="keeps every token"):
        plan_runs(["lowrank@512"], [0])
