"""TiersConfig refuses settings it cannot honour, with a message naming the setting."""

from __future__ import annotations

import pytest

from kvtier.cache import TiersConfig
from kvtier.errors import KvtierError


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"spill_queue": 0}, "spill_queue"),
        ({"retries": -1}, "retries"),
        ({"retries": True}, "retries"),
        ({"host_bytes": -1}, "host_bytes"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"restore": "maybe"}, "restore"),
        ({"disk_bytes": 1 << 20}, "disk_dir"),
        ({"host_bytes": 0}, "at least one"),
    ],
)
def test_bad_settings_are_refused(options, message):
    with pytest.raises(KvtierError, match=message):
        TiersConfig(**options)


def test_defaults_swap_on_preemption_and_retry_failed_copies():
    config = TiersConfig()
    assert config.swap_on_preempt and config.retries == 2 and config.spill_queue == 16
