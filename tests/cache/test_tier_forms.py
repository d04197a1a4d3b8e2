"""Tier forms: chunks stored quantized (INT8 / INT4) in a tier, encoded on the mover's worker,
restored to full precision with their form recorded; a corrupt quantized chunk is a miss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.cache import TiersConfig
from kvtier.cache.forms import ChunkForms, lossiest
from kvtier.cache.setup import attach_connector
from kvtier.errors import KvtierError
from kvtier.tiers import Chunk, DiskTier, HostTier, Payload, TieredStore

from .scenario import assert_no_leak, make_turns, run_first_and_flood, run_second

MIB = 1 << 20


def one_tier(tier: str, form: str, tmp_path: Path, redis_url: str | None) -> TiersConfig:
    common = {"chunk_tokens": 64, "forms": {tier: form}}
    if tier == "host":
        return TiersConfig(host_bytes=64 * MIB, **common)
    if tier == "disk":
        return TiersConfig(host_bytes=0, disk_bytes=64 * MIB, disk_dir=tmp_path / form, **common)
    return TiersConfig(host_bytes=0, redis_url=redis_url, redis_prefix=f"kvt-{form}", **common)


def spill_session(engine, tiers: TiersConfig):
    """Turn 1 of the scenario's session, flooded out of the device into the tiers."""
    turns = make_turns(0)
    connector = attach_connector(engine, tiers, "offload")
    first = run_first_and_flood(engine, turns)
    assert connector.flush(timeout=30)
    return connector, turns, first


def stored_forms(connector) -> set[str]:
    return {placement.form for placement in connector.store._index.values()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tier", "form"), [("host", "int8"), ("disk", "int8"), ("disk", "int4"), ("remote", "int4")]
)
def test_session_round_trips_through_a_quantized_tier(engine, tier, form, tmp_path, redis_url):
    connector, turns, first = spill_session(engine, one_tier(tier, form, tmp_path, redis_url))
    assert stored_forms(connector) == {form}
    recodes = engine.stats().tiers["recodes"]
    assert recodes[f"full->{form}"]["ops"] == connector.counters["spilled_chunks"] > 0
    second, out = run_second(engine, turns, first)
    sources = out.metrics.prompt_token_sources
    assert sources[tier] > 0
    assert len(second) == 8
    # the restored blocks are in the pool under their keys, marked with the form they came from
    keys = connector.runner.sessions["s1"].keys
    first_restored, restored = sources["device"] // 16, sources[tier] // 16
    pool = engine.block_pool
    blocks = [pool.lookup(k) for k in keys[first_restored : first_restored + restored]]
    assert [pool.forms[b] for b in blocks] == [form] * restored
    assert pool.forms[pool.lookup(keys[-1])] == "full"  # computed by this turn
    assert connector.counters[f"restored_blocks_{form}"] == restored
    assert_no_leak(engine)


@pytest.mark.slow
def test_bytes_in_the_tier_drop_by_the_forms_ratio(engine, tmp_path):
    used = {}
    for form in ("full", "int8", "int4"):
        connector, _turns, _first = spill_session(engine, one_tier("disk", form, tmp_path, None))
        assert stored_forms(connector) == {form}
        used[form] = connector.store.tiers["disk"].used_bytes
        payload_bytes = sum(p.nbytes for p in connector.store._index.values())
        blocks = connector.counters["spilled_blocks"]
        assert payload_bytes == connector.chunk_forms.nbytes(blocks, form)
    attach_connector(engine, None)
    forms = ChunkForms(engine.kv_pool.block_shape, engine.kv_pool.dtype)
    for form in ("int8", "int4"):
        expected = forms.nbytes(4, form) / forms.nbytes(4, "full")
        assert used[form] / used["full"] == pytest.approx(expected, rel=0.02)


@pytest.mark.slow
def test_corrupt_int4_chunk_on_disk_is_recomputed(engine, expected, tmp_path):
    _first_ref, second_ref = expected
    connector, turns, first = spill_session(engine, one_tier("disk", "int4", tmp_path, None))
    segments = sorted((tmp_path / "int4").glob("*.seg"))
    assert segments
    flipped = 0
    for segment in segments:  # one byte in every record's body (a head is under 1 KB)
        data = bytearray(segment.read_bytes())
        start = data.find(b"KVTR")
        while start >= 0:
            data[start + 2000] ^= 0xFF
            flipped += 1
            start = data.find(b"KVTR", start + 1)
        segment.write_bytes(bytes(data))
    assert flipped >= connector.counters["spilled_chunks"]
    second, out = run_second(engine, turns, first)
    assert second == second_ref  # nothing restored: the whole history was recomputed
    assert out.metrics.prompt_token_sources["disk"] == 0
    assert connector.store.tiers["disk"].stats.errors >= 1
    assert connector.counters["restore_failures"] >= 1
    assert_no_leak(engine)


@pytest.mark.slow
def test_policy_view_shows_each_chunks_form_and_size(engine, tmp_path):
    connector, _turns, _first = spill_session(engine, one_tier("disk", "int8", tmp_path, None))
    view = connector.runner.view()
    (session,) = [s for s in view.sessions if s.session_id == "s1"]
    stored = [c for c in session.chunks if c.tier == "disk"]
    assert stored
    for chunk in stored:
        assert chunk.form == "int8"
        blocks = chunk.tokens // 16
        assert chunk.size_bytes == connector.chunk_forms.nbytes(blocks, "int8")
    attach_connector(engine, None)


# ----- the pieces, without the model ------------------------------------------------------

BLOCK = torch.Size((2, 2, 3, 16, 64))  # layers, K|V, kv heads, tokens, head dim


def chunk_payload(blocks: int = 4, seed: int = 0) -> Payload:
    generator = torch.Generator().manual_seed(seed)
    return Payload.of(torch.randn((blocks, *BLOCK), generator=generator).to(torch.bfloat16))


def test_recode_encodes_once_and_never_back_up():
    forms = ChunkForms(BLOCK, torch.bfloat16)
    full = chunk_payload()
    int8 = forms.recode(full, "int8")
    assert int8.form == "int8" and int8.nbytes == forms.nbytes(4, "int8") < full.nbytes
    assert forms.recode(int8, "full") is int8  # precision lost cannot come back
    int4 = forms.recode(int8, "int4")
    assert int4.nbytes == forms.nbytes(4, "int4") < int8.nbytes
    restored = forms.restore(int4)
    assert restored.form == "int4" and restored.blocks.shape == (4, *BLOCK)
    assert restored.blocks.dtype == torch.bfloat16
    assert lossiest("full", "int4", "int8") == "int4" and lossiest() == "full"


def test_restore_refuses_payloads_that_are_not_this_pools_blocks():
    forms = ChunkForms(BLOCK, torch.bfloat16)
    int8 = forms.recode(chunk_payload(), "int8")
    truncated = Payload(int8.data[:-1], int8.nbytes - 1, "int8", int8.dtype, int8.shape)
    other_dtype = Payload(int8.data, int8.nbytes, "int8", "float32", int8.shape)
    other_shape = Payload(int8.data, int8.nbytes, "int8", int8.dtype, (2, 4, *BLOCK[1:]))
    unknown = Payload(int8.data, int8.nbytes, "int3", int8.dtype, int8.shape)
    for payload in (truncated, other_dtype, other_shape, unknown, None):
        assert forms.restore(payload) is None


def test_store_encodes_into_a_tiers_form_on_put_and_on_demotion(tmp_path):
    forms = ChunkForms(BLOCK, torch.bfloat16)
    full = chunk_payload()
    block_bytes = forms.nbytes(1, "full")
    host = HostTier(8 * block_bytes, slot_bytes=block_bytes)
    disk = DiskTier(tmp_path / "disk", 1 << 22)
    store = TieredStore(
        [host, disk], block_tokens=16, chunk_tokens=64, forms={"disk": "int4"}, recode=forms.recode
    )
    chunk = Chunk((b"a" * 32,), "t")
    assert store.put(chunk, full)
    assert store.locate(chunk.id).form == "full"
    assert store.demote(chunk.id)  # host -> disk: encoded on the way
    placement = store.locate(chunk.id)
    assert (placement.tier, placement.form) == ("disk", "int4")
    assert placement.nbytes == forms.nbytes(4, "int4")
    back = forms.restore(store.promote(chunk.id))
    error = (back.blocks.float() - full.tensor().float()).abs().max()
    assert 0 < error < 1.0  # lossy, within INT4's half step of the normal values here
    other = Chunk((b"b" * 32,), "t")
    assert store.put(other, full, form="int8")  # a put may ask for less precision
    assert store.locate(other.id).form == "int8"
    assert store.snapshot()["recodes"]["full->int4"]["ops"] == 1
    for tier in (host, disk):
        tier.close()


def test_an_unreadable_payload_is_not_stored(tmp_path):
    forms = ChunkForms(BLOCK, torch.bfloat16)
    host = HostTier(1 << 22, slot_bytes=1 << 16)
    store = TieredStore([host], forms={"host": "int8"}, recode=forms.recode)
    bad = Payload.of(torch.zeros(10, dtype=torch.bfloat16))  # not a chunk of BLOCK
    assert not store.put(Chunk((b"c" * 32,)), bad)
    assert len(store) == 0
    host.close()


@pytest.mark.parametrize(
    ("forms", "message"),
    [
        ({"ssd": "int8"}, "unknown tier 'ssd'"),
        ({"disk": "int3"}, "unknown form 'int3'"),
        ({"host": "int4", "disk": "int8"}, "disk stores int8, more precise than int4 in host"),
        ({"disk": "int4", "remote": "full"}, "remote stores full"),
        ("int8", "must map tier names to forms"),
    ],
)
def test_bad_forms_are_refused(forms, message):
    with pytest.raises(KvtierError, match=message):
        TiersConfig(forms=forms)


def test_unlisted_tiers_keep_the_form_above_them():
    config = TiersConfig(forms={"disk": "int8"})
    assert config.tier_forms() == {"host": "full", "disk": "int8", "remote": "int8"}
    assert TiersConfig().tier_forms() == {"host": "full", "disk": "full", "remote": "full"}


@pytest.mark.slow
def test_attaching_tiers_to_a_packed_pool_engine_is_refused():
    from kvtier.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(kv_cache_bytes=64 * MIB, max_num_seqs=4, kv_quant="int8"))
    try:
        with pytest.raises(KvtierError, match="kv_quant with tiers"):
            attach_connector(engine, TiersConfig(forms={"disk": "int8"}))
    finally:
        engine.close()


def test_the_int4_kernels_are_prepared_off_the_restore_path():
    """A bfloat16 pool whose chunks may be stored INT4 compiles (or loads) the fused decode's
    kernels on a background thread; other forms and dtypes start nothing."""
    shape = torch.Size((30, 2, 3, 16, 64))
    thread = ChunkForms(shape, torch.bfloat16).prepare({"full", "int4"})
    assert thread is not None and thread.name == "kvtier-int4-kernels"
    thread.join(timeout=120)
    assert not thread.is_alive()
    import kvtier.compress.fused as fused

    assert fused._keys.signatures and fused._values.signatures
    assert ChunkForms(shape, torch.bfloat16).prepare({"full", "int8"}) is None
    assert ChunkForms(shape, torch.float32).prepare({"int4"}) is None
