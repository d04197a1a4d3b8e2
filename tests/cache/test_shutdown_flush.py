"""Closing the connector over a persistent disk tier writes to disk what memory holds: the
chunks of cached device blocks no tier has and the host's chunks without a copy, so the next
process restores them."""

from __future__ import annotations

import logging
import re

import pytest

from kvtier.cache import TiersConfig
from kvtier.cache.setup import attach_connector

from .scenario import make_turns, run_first_and_flood, run_second

pytestmark = pytest.mark.slow

MIB = 1 << 20


def persistent(tmp_path, **settings) -> TiersConfig:
    return TiersConfig(
        host_bytes=64 * MIB,
        disk_dir=tmp_path / "kv",
        disk_bytes=64 * MIB,
        disk_persist=True,
        chunk_tokens=64,
        **settings,
    )


def test_close_writes_device_and_host_chunks_to_disk_for_the_next_process(
    engine, expected, tmp_path, caplog
):
    tiers = persistent(tmp_path, disk_copy="on_shutdown")
    connector = attach_connector(engine, tiers, "offload")
    turns = make_turns(0)
    first = run_first_and_flood(engine, turns)  # s1 spilled to host, the flood on device
    assert connector.flush(30)
    assert connector.store.snapshot()["tiers"]["host"]["chunks"] > 0
    assert connector.store.tiers["disk"].entries() == []  # on_shutdown: nothing copied yet

    with caplog.at_level(logging.INFO, logger="kvtier.cache.shutdown_flush"):
        attach_connector(engine, None)  # closes it
    wrote = re.search(r"wrote (\d+) device and (\d+) host chunks", caplog.text)
    assert wrote is not None and int(wrote[1]) > 0 and int(wrote[2]) > 0, caplog.text

    restarted = attach_connector(engine, tiers, "offload")  # the next process, same disk
    assert len(restarted.store) > 0
    output, final = run_second(engine, turns, first)
    assert output == expected[1]
    assert final.metrics.prompt_token_sources["disk"] > 0
    assert final.metrics.prompt_token_sources["host"] == 0


def test_a_flush_cut_off_by_its_deadline_says_what_it_lost(engine, tmp_path, caplog):
    attach_connector(engine, persistent(tmp_path, shutdown_flush_s=1e-9), "offload")
    run_first_and_flood(engine, make_turns(0))
    with caplog.at_level(logging.WARNING, logger="kvtier.cache.shutdown_flush"):
        attach_connector(engine, None)
    assert "shutdown_flush_s (1e-09 s) ran out" in caplog.text
