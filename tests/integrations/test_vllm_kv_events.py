"""vLLM's KV events with the kvtier connector: a router subscribed to vLLM's ZMQ stream is
told each chunk kvtier's tiers take and drop, by medium (the tier), in vLLM's own block
hashes, and what it is told adds up to what the tiers hold."""

from __future__ import annotations

import pytest

from .conftest import BLOCK, run_driver

pytestmark = pytest.mark.slow

KVTIER_MEDIA = {"host", "disk", "remote"}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-events")
    return run_driver(tmp, "events", "--disk-dir", str(tmp / "kv"))


def kvtier_events(run: dict) -> list[dict]:
    return [e for e in run["events"] if e.get("medium") in KVTIER_MEDIA]


def test_every_chunk_the_tiers_hold_was_announced_and_every_drop_removed(run):
    announced: dict[str, set[tuple[int, ...]]] = {"host": set(), "disk": set()}
    hashes_of: dict[tuple[int, ...], list] = {}
    for event in kvtier_events(run):
        if event["type"] == "BlockStored":
            tokens = tuple(event["token_ids"])
            hashes_of[tokens] = event["block_hashes"]
            assert tokens not in announced[event["medium"]], "stored twice, never removed"
            announced[event["medium"]].add(tokens)
        else:
            # a removal names a chunk the router was told that medium holds
            matches = [t for t, h in hashes_of.items() if h == event["block_hashes"]]
            assert len(matches) == 1
            assert matches[0] in announced[event["medium"]], "removed but never stored"
            announced[event["medium"]].remove(matches[0])
    held = {tier: {tuple(tokens) for tokens in chunks} for tier, chunks in run["held"].items()}
    assert None not in held["host"] | held["disk"]  # every held chunk is one this run sent
    assert announced == held
    assert held["host"] and held["disk"]
    assert run["counters"]["kv_events_dropped"] == 0


def test_the_small_tiers_demoted_and_dropped_and_said_so(run):
    kinds = [(e["type"], e["medium"]) for e in kvtier_events(run)]
    stored_on_host = kinds.count(("BlockStored", "host"))
    assert stored_on_host == run["counters"]["written_through_chunks"] > 7
    assert kinds.count(("BlockRemoved", "host")) > 0  # the host (3 chunks) demoted
    assert kinds.count(("BlockStored", "disk")) > 0
    assert kinds.count(("BlockRemoved", "disk")) > 0  # the disk (4 chunks) dropped
    assert all(e["locality"] == "LOCAL" for e in kvtier_events(run))


def test_a_chunk_is_named_by_vllms_own_block_hashes(run):
    """A router joins kvtier's chunks with vLLM's device blocks: each announced block hash is
    one vLLM published for its device cache, over the same tokens, after the same parent."""
    device: dict[object, tuple[object, tuple[int, ...]]] = {}  # hash -> (parent, tokens)
    for event in run["events"]:
        if event["type"] == "BlockStored" and event["medium"] not in KVTIER_MEDIA:
            parent = event["parent_block_hash"]
            for i, block_hash in enumerate(event["block_hashes"]):
                tokens = tuple(event["token_ids"][i * BLOCK : (i + 1) * BLOCK])
                device[block_hash] = (parent, tokens)
                parent = block_hash
    stored = [e for e in kvtier_events(run) if e["type"] == "BlockStored"]
    assert stored and device
    for event in stored:
        assert event["block_size"] == BLOCK
        assert len(event["token_ids"]) == BLOCK * len(event["block_hashes"])
        parent = event["parent_block_hash"]
        for i, block_hash in enumerate(event["block_hashes"]):
            tokens = tuple(event["token_ids"][i * BLOCK : (i + 1) * BLOCK])
            assert device.get(block_hash) == (parent, tokens)
            parent = block_hash
