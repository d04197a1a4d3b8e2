"""The layer-wise pipelined restore (`restore_pipeline = "layer"`), real model, real segment
files, real redis-servers: the same greedy output as recomputing; a damaged layer in the middle
of a chunk, or a Redis that dies while the layers are coming, throws away only that request's
step (its neighbour in the batch is unaffected) and it recomputes from the failed chunk, and so
does a forged layer of a signed or sealed Redis value; records written before (version 1) still
restore, whole."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from kvtier.cache import TiersConfig
from kvtier.cache.setup import attach_connector
from kvtier.engine import Engine
from kvtier.tiers.record import FLAG_KEY_ID, FLAG_SEALED, VERSION, VERSION_SEALED_LAYERED

from .scenario import GREEDY, assert_no_leak, drain

pytestmark = pytest.mark.slow

MIB = 1 << 20
CHUNK = 32  # 2 blocks of 16: a 108-token history is 3 chunks
KEY = bytes(range(32))


def layered(kind: str, tmp_path: Path, redis_url: str | None = None, **extra) -> TiersConfig:
    # Generous Redis and restore timeouts: a loaded CI machine once took over the default
    # 0.25 s for a loopback read, so a restore the test counts fell back to recompute (output
    # still right, count off). The tests about lateness pass their own, tight ones.
    common = {
        "chunk_tokens": CHUNK,
        "restore_pipeline": "layer",
        "host_bytes": 0,
        "redis_timeout_s": 5.0,
        "restore_deadline_s": 30.0,
        **extra,
    }
    if kind == "disk":
        return TiersConfig(disk_bytes=64 * MIB, disk_dir=tmp_path / "d", **common)
    return TiersConfig(redis_url=redis_url, redis_prefix="kvt-layers", **common)


class Sessions:
    """Two sessions' turn 1, then two floods that push both out of the 22-block pool."""

    def __init__(self, engine: Engine, seed: int = 7) -> None:
        r = random.Random(seed)
        ids = lambda n: [r.randrange(1000, 20000) for _ in range(n)]  # noqa: E731
        self.firsts = {"a": ids(100), "b": ids(100)}
        self.extras = {"a": ids(10), "b": ids(10)}
        self.floods = [ids(250), ids(250)]
        self.engine = engine
        self.outputs: dict[str, list[int]] = {}

    def run_firsts(self) -> None:
        for name, prompt in self.firsts.items():
            rid = self.engine.add_request(prompt, GREEDY, session_id=name)
            self.outputs[name] = drain(self.engine)[rid]
        for i, flood in enumerate(self.floods):
            self.engine.add_request(flood, GREEDY, session_id=f"flood{i}")
            drain(self.engine)

    def second(self, name: str) -> list[int]:
        return self.firsts[name] + self.outputs[name] + self.extras[name]

    def references(self) -> dict[str, list[int]]:
        """Turn 2 of each session computed from scratch (no connector)."""
        attach_connector(self.engine, None)
        self.run_firsts()
        refs = {}
        for name in self.firsts:
            self.engine.reset_prefix_cache()
            rid = self.engine.add_request(self.second(name), GREEDY)
            refs[name] = drain(self.engine)[rid]
        self.engine.reset_prefix_cache()
        return refs

    def add_seconds(self) -> dict[str, str]:
        """Both turn 2s queued together: admitted, restored and prefilled in one step."""
        return {
            name: self.engine.add_request(self.second(name), GREEDY, session_id=name)
            for name in self.firsts
        }

    def finish(self, rids: dict[str, str]) -> dict[str, tuple[list[int], object]]:
        outs: dict[str, list[int]] = {}
        finals = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    finals[out.request_id] = out
        return {name: (outs[rid], finals[rid]) for name, rid in rids.items()}


def assert_only_a_recomputes(
    sessions: Sessions, refs: dict[str, list[int]], results: dict, source: str
) -> None:
    """Both outputs are the recomputed ones; session a kept its first chunk from `source` and
    recomputed the rest (the chunk after it failed), its neighbour b's restore stood."""
    assert results["a"][0] == refs["a"]
    assert results["b"][0] == refs["b"]
    sources_a = results["a"][1].metrics.prompt_token_sources
    sources_b = results["b"][1].metrics.prompt_token_sources
    assert sources_a[source] == CHUNK
    assert sources_a["recomputed"] == len(sessions.second("a")) - CHUNK
    assert sources_b[source] == 3 * CHUNK


def chunk_ids(engine: Engine, connector, rid: str) -> list[bytes]:
    request = engine.scheduler.requests[rid]
    keys = request.keys_of_full_blocks(engine.config.block_size)
    return [chunk.id for chunk in connector.store.chunks(keys)]


@pytest.mark.parametrize(
    ("kind", "integrity"), [("disk", None), ("remote", None), ("remote", "encrypt")]
)
def test_layered_restore_gives_the_recomputed_output(engine, kind, integrity, tmp_path, redis_url):
    """Restored by layers from disk, plain Redis and sealing Redis (integrity "encrypt":
    version-4 records, each layer decrypted into the pool as it passes its checksum)."""
    sessions = Sessions(engine)
    refs = sessions.references()
    tiers = layered(kind, tmp_path, redis_url)
    if integrity is not None:
        tiers = dataclasses.replace(
            tiers, integrity=integrity, encrypt_key=KEY, redis_prefix=f"kvt-layers-{integrity}"
        )
    connector = attach_connector(engine, tiers, "offload")
    sessions.run_firsts()
    assert connector.flush(timeout=30)
    if integrity is not None:  # what the chunks are stored as: sealed layered records
        client = connector.store.tiers["remote"]._connection()
        values = [client.get(key) for key in client.keys(f"{tiers.redis_prefix}:*")]
        sealed = (VERSION_SEALED_LAYERED, FLAG_SEALED | FLAG_KEY_ID)  # naming their key
        assert values and {(raw[4], raw[5]) for raw in values} == {sealed}
    results = sessions.finish(sessions.add_seconds())
    for name, (tokens, final) in results.items():
        assert tokens == refs[name]
        assert final.metrics.prompt_token_sources[kind] == 3 * CHUNK
    counters = connector.counters
    assert counters["restored_chunks_layered"] == 6, sorted(counters.items())
    assert counters["prefetched_chunks"] == 0  # layered chunks are read beside the forward
    assert counters["restore_failures"] == 0
    assert_no_leak(engine)


def test_damaged_layer_mid_chunk_discards_that_request_alone(engine, tmp_path):
    sessions = Sessions(engine)
    refs = sessions.references()
    connector = attach_connector(engine, layered("disk", tmp_path), "offload")
    sessions.run_firsts()
    assert connector.flush(timeout=30)
    rids = sessions.add_seconds()
    # Layer 15 of 30 of session a's middle chunk: layers 0-14 verify and are signalled
    # ready, so the forward is well under way when the damage is found.
    target = chunk_ids(engine, connector, rids["a"])[1]
    disk = connector.store.tiers["disk"]
    (loc,) = [loc for (_, key), loc in disk._index.items() if key == target]
    offset, length = loc.head.layer_span(15)
    at = loc.offset + loc.head.head_len + offset + length // 2
    with open(loc.segment.path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert_only_a_recomputes(sessions, refs, sessions.finish(rids), "disk")
    assert connector.counters["restore_layer_failures"] == 1
    assert disk.stats.corrupt == 1
    assert_no_leak(engine)


@pytest.mark.parametrize("integrity", ["mac", "encrypt"])
def test_forged_layer_of_a_keyed_record_is_recomputed(
    engine, tmp_path, redis_url, forge_layered, integrity
):
    """A signing (integrity "mac") or sealing ("encrypt") Redis tier restores by layers too.
    One byte of layer 15 of session a's middle chunk (ciphertext, when sealed) is changed with
    every checksum recomputed: every layer passes its checksum, the tag fails with the last,
    after the forward has read the rest (sealed: decrypted, unauthenticated), so a's step is
    thrown away and it recomputes from that chunk; b's restore stands."""
    sessions = Sessions(engine)
    refs = sessions.references()
    tiers = layered("remote", tmp_path, redis_url, integrity=integrity, encrypt_key=KEY)
    tiers = dataclasses.replace(tiers, redis_prefix=f"kvt-layers-keyed-{integrity}")
    connector = attach_connector(engine, tiers, "offload")
    sessions.run_firsts()
    assert connector.flush(timeout=30)
    rids = sessions.add_seconds()
    remote = connector.store.tiers["remote"]
    client = remote._connection()
    target = chunk_ids(engine, connector, rids["a"])[1]
    (rkey,) = client.keys(f"kvt-layers-keyed-{integrity}:*{target.hex()}")

    def flip_a_byte_of_layer_15(body: bytearray, step: int) -> None:
        body[15 * step + step // 2] ^= 0xFF

    client.set(rkey, forge_layered(client.get(rkey), flip_a_byte_of_layer_15))
    assert_only_a_recomputes(sessions, refs, sessions.finish(rids), "remote")
    counters = connector.counters
    # a's first chunk and b's three, all keyed and restored by layers; a's forged one failed
    assert counters["restored_chunks_layered"] == 4, sorted(counters.items())
    assert counters["restore_layer_failures"] == 1
    assert_no_leak(engine)


def test_redis_dying_mid_restore_is_recomputed(engine, tmp_path, own_redis):
    sessions = Sessions(engine)
    refs = sessions.references()
    connector = attach_connector(engine, layered("remote", tmp_path, own_redis.url), "offload")
    sessions.run_firsts()
    assert connector.flush(timeout=30)
    remote = connector.store.tiers["remote"]
    read_layer = remote.read_layer

    def dies_before_layer_10(items, layer: int) -> list[bool]:
        if layer == 10 and own_redis.process is not None:
            own_redis.stop()  # layers 0-9 of every chunk came and were signalled ready
        return read_layer(items, layer)

    remote.read_layer = dies_before_layer_10
    results = sessions.finish(sessions.add_seconds())
    for name, (tokens, final) in results.items():
        assert tokens == refs[name]
        assert final.metrics.prompt_token_sources["remote"] == 0
    assert connector.counters["restore_layer_failures"] == 6
    assert_no_leak(engine)


SEALED = {"encrypt": True, "encrypt_key": KEY}


@pytest.mark.parametrize(
    ("written", "read", "keys", "reader", "version"),
    [
        ("chunk", "layer", {}, {"prefetch": False}, VERSION),
        ("layer", "chunk", SEALED, {}, VERSION_SEALED_LAYERED),
    ],
    ids=["version-1-under-layer", "sealed-version-4-under-chunk"],
)
def test_records_restore_whole_across_pipelines(
    engine, tmp_path, written, read, keys, reader, version
):
    """Records one pipeline wrote, kept by a persistent disk tier, restore whole under the
    other, and the output is the same: version-1 records (written with "chunk", from before
    layered records) under "layer"; sealed layered records (version 4, written with "layer")
    under "chunk", prefetched and decrypted straight into block-major order."""
    sessions = Sessions(engine)
    refs = sessions.references()
    writer = layered("disk", tmp_path, restore_pipeline=written, disk_persist=True, **keys)
    connector = attach_connector(engine, writer, "offload")
    sessions.run_firsts()
    assert connector.flush(timeout=30)
    disk = connector.store.tiers["disk"]
    assert {loc.head.raw[4] for loc in disk._index.values()} == {version}
    connector = attach_connector(
        engine,
        layered("disk", tmp_path, restore_pipeline=read, disk_persist=True, **keys, **reader),
        "offload",
    )
    results = sessions.finish(sessions.add_seconds())
    for name, (tokens, final) in results.items():
        assert tokens == refs[name]
        assert final.metrics.prompt_token_sources["disk"] == 3 * CHUNK
    assert connector.counters["restored_chunks_layered"] == 0
    assert connector.counters["restored_chunks"] == 6
    assert_no_leak(engine)


def test_layer_past_the_deadline_is_not_used(engine, tmp_path, own_redis):
    """A Redis that freezes while the layers come: the forward stops waiting at the restore
    deadline and goes on, so the layers it read unverified are thrown away with the step."""
    sessions = Sessions(engine)
    refs = sessions.references()
    tiers = layered("remote", tmp_path, own_redis.url, restore_deadline_s=0.2, redis_timeout_s=1.0)
    connector = attach_connector(engine, tiers, "offload")
    sessions.run_firsts()
    assert connector.flush(timeout=30)
    remote = connector.store.tiers["remote"]
    read_layer = remote.read_layer

    def freezes_before_layer_5(items, layer: int) -> list[bool]:
        if layer == 5:
            own_redis.pause()
        return read_layer(items, layer)

    remote.read_layer = freezes_before_layer_5
    try:
        results = sessions.finish(sessions.add_seconds())
    finally:
        own_redis.resume()
    for name, (tokens, final) in results.items():
        assert tokens == refs[name]
        assert final.metrics.prompt_token_sources["remote"] == 0
    assert connector.counters["restore_late"] == 6
    assert_no_leak(engine)
