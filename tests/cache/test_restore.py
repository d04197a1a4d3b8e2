"""Real model, real tiers: a session evicted from a tiny device pool comes back from host,
disk and Redis with greedy output identical to recomputing it; broken tiers cost only time."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvtier.cache import TiersConfig
from kvtier.cache.setup import attach_connector

from .scenario import assert_no_leak, make_turns, run_first_and_flood, run_second

pytestmark = pytest.mark.slow

MIB = 1 << 20


def tiers_for(kind: str, tmp_path: Path, redis_url: str | None = None) -> TiersConfig:
    common = {"chunk_tokens": 64}
    if kind == "host":
        return TiersConfig(host_bytes=64 * MIB, **common)
    if kind == "disk":
        return TiersConfig(host_bytes=0, disk_bytes=64 * MIB, disk_dir=tmp_path / "d", **common)
    if kind == "mmap":  # the example tier of docs/design.md, in the disk slot
        disk = {"disk_bytes": 64 * MIB, "disk_dir": tmp_path / "m", "disk_backend": "mmap"}
        return TiersConfig(host_bytes=0, **disk, **common)
    # a generous read timeout: the tests count tokens restored, and a loaded CI machine once
    # took over the 0.25 s default for a loopback read (the fallback is recompute)
    remote = {"redis_url": redis_url, "redis_prefix": "kvt-test", "redis_timeout_s": 5.0}
    return TiersConfig(host_bytes=0, **remote, **common)


@pytest.mark.parametrize("kind", ["host", "disk", "remote", "mmap"])
def test_resumed_session_restored_from_tier(engine, expected, kind, tmp_path, redis_url):
    turns = make_turns(0)
    first_ref, second_ref = expected
    connector = attach_connector(engine, tiers_for(kind, tmp_path, redis_url), "offload")
    first = run_first_and_flood(engine, turns)
    assert first == first_ref
    assert connector.flush(timeout=30)  # the spills ran on the mover's worker
    assert connector.counters["spilled_chunks"] > 0
    second, out = run_second(engine, turns, first)
    kind = "disk" if kind == "mmap" else kind  # the tier it stands in for
    sources = out.metrics.prompt_token_sources
    assert sources[kind] > 0, sources
    assert sources[kind] + sources["device"] + sources["recomputed"] == len(turns.second(first))
    assert second == second_ref
    stats = engine.stats().tiers
    assert stats["tokens"][kind] == sources[kind]
    assert stats["tiers"][kind]["bytes_read"] > 0 and stats["tiers"][kind]["hits"] > 0
    assert_no_leak(engine)


def test_corrupt_disk_block_is_recomputed(engine, expected, tmp_path):
    turns = make_turns(0)
    _first_ref, second_ref = expected
    connector = attach_connector(engine, tiers_for("disk", tmp_path), "offload")
    first = run_first_and_flood(engine, turns)
    assert connector.flush(timeout=30)
    # flip a byte near the end of every segment: the body of the newest record, which is
    # the first chunk the resumed turn needs (tails are evicted first)
    segments = sorted((tmp_path / "d").glob("*.seg"))
    assert segments
    for segment in segments:
        data = bytearray(segment.read_bytes())
        data[-1000] ^= 0xFF
        segment.write_bytes(bytes(data))
    second, out = run_second(engine, turns, first)
    assert second == second_ref
    assert connector.store.tiers["disk"].stats.errors >= 1
    assert connector.counters["restore_failures"] >= 1
    assert out.metrics.prompt_token_sources["recomputed"] > len(turns.extra)
    assert_no_leak(engine)


def test_corrupt_redis_value_is_recomputed(engine, expected, tmp_path, redis_server, redis_url):
    turns = make_turns(0)
    _first_ref, second_ref = expected
    connector = attach_connector(engine, tiers_for("remote", tmp_path, redis_url), "offload")
    first = run_first_and_flood(engine, turns)
    assert connector.flush(timeout=30)
    with redis_server.client() as client:
        keys = client.keys("kvt-test:*")
        assert keys
        for key in keys:
            length = client.strlen(key)
            byte = client.getrange(key, length - 100, length - 100)
            client.setrange(key, length - 100, bytes([byte[0] ^ 0xFF]))
    second, out = run_second(engine, turns, first)
    assert second == second_ref
    assert connector.store.tiers["remote"].stats.errors >= 1
    assert out.metrics.prompt_token_sources["remote"] == 0
    assert_no_leak(engine)


def test_redis_stopped_mid_run(engine, expected, tmp_path, own_redis):
    turns = make_turns(0)
    _first_ref, second_ref = expected
    connector = attach_connector(engine, tiers_for("remote", tmp_path, own_redis.url), "offload")
    first = run_first_and_flood(engine, turns)
    assert connector.flush(timeout=30)
    assert connector.counters["spilled_chunks"] > 0
    own_redis.stop()
    second, out = run_second(engine, turns, first)
    assert second == second_ref
    assert out.metrics.prompt_token_sources["remote"] == 0
    assert_no_leak(engine)


@pytest.mark.parametrize("damage", [False, True])
def test_chunk_read_straight_into_device_blocks(engine, expected, tmp_path, damage):
    """Without prefetch a disk chunk is read into its device blocks in place (no staging
    copy); a damaged record landing there first still fails its checksum, and the request
    recomputes those blocks: the output never changes."""
    turns = make_turns(0)
    _first_ref, second_ref = expected
    tiers = dataclasses.replace(tiers_for("disk", tmp_path), prefetch=False)
    connector = attach_connector(engine, tiers, "offload")
    first = run_first_and_flood(engine, turns)
    assert connector.flush(timeout=30)
    if damage:  # the body of every segment's newest record (see the test above)
        for segment in sorted((tmp_path / "d").glob("*.seg")):
            data = bytearray(segment.read_bytes())
            data[-1000] ^= 0xFF
            segment.write_bytes(bytes(data))
    second, out = run_second(engine, turns, first)
    assert second == second_ref
    counters = connector.counters
    assert counters["prefetched_chunks"] == 0
    if damage:
        assert counters["restore_failures"] >= 1
        assert connector.store.tiers["disk"].stats.corrupt >= 1
        assert out.metrics.prompt_token_sources["recomputed"] > len(turns.extra)
    else:
        assert counters["restored_chunks_in_place"] >= 1
        assert out.metrics.prompt_token_sources["disk"] > 0
    assert_no_leak(engine)


def test_a_load_failing_after_admission_recomputes_in_the_chunks_of_a_known_miss(
    engine, expected, tmp_path, monkeypatch
):
    """Every stored chunk damaged and no prefetch, so the failures surface only when the
    admitted request's loads run: it sits that step out, then computes the rest of its
    prompt in the chunks the scheduler cuts from its last device hit, as for a miss known at
    admission. Computing the step's tokens from the failed block at once would cut the
    recompute where the failed load ended, and the answer could depend on when a failure
    shows (bf16 matmuls round some row counts differently)."""
    turns = make_turns(0)
    _first_ref, second_ref = expected
    computed: list[tuple[str, int, int]] = []  # (request, first position, tokens) per forward
    execute = engine.runner.execute

    def recording(scheduled, **kwargs):
        computed.extend((r.request_id, r.num_computed_tokens, n) for r, n in scheduled)
        return execute(scheduled, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", recording)
    tiers = dataclasses.replace(tiers_for("disk", tmp_path), prefetch=False)
    connector = attach_connector(engine, tiers, "offload")
    first = run_first_and_flood(engine, turns)
    assert connector.flush(timeout=30)
    for segment in sorted((tmp_path / "d").glob("*.seg")):
        data = bytearray(segment.read_bytes())
        for at in range(4096, len(data), 4096):  # every record
            data[at] ^= 0xFF
        segment.write_bytes(bytes(data))
    computed.clear()
    second, out = run_second(engine, turns, first)
    assert connector.counters["restore_failures"] >= 1
    sources = out.metrics.prompt_token_sources
    assert sources["disk"] == 0
    prompt = len(turns.second(first))
    budget = engine.config.max_num_batched_tokens
    hit = sources["device"]
    chunks = [(start, n) for rid, start, n in computed if rid == out.request_id]
    cut = [(at, min(budget, prompt - at)) for at in range(hit, prompt, budget)]
    assert chunks[: len(cut)] == cut
    assert second == second_ref
    assert_no_leak(engine)
