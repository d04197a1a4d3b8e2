"""Encryption at rest: per-namespace keys; anything tampered or mis-keyed is a miss."""

from __future__ import annotations

import os

import pytest
import redis
import torch

from kvtier.tiers import RedisTier, Sealer, TierError
from kvtier.tiers.crypto import OVERHEAD_BYTES

# what is opened differs from what was sealed: the namespace (so the key), the associated data
# (the block key), or a byte of the ciphertext
ANYTHING_CHANGED = pytest.mark.parametrize(
    "namespace, associated, flip",
    [("other-tenant", b"key", None), ("tenant", b"other-key", None), ("tenant", b"key", 500)],
    ids=["wrong-namespace-key", "moved-to-another-key", "tampered-ciphertext"],
)


def open_bytes(sealer: Sealer, namespace: str, associated: bytes, sealed: bytes) -> bytes:
    dest = bytearray(len(sealed) - OVERHEAD_BYTES)
    sealer.open_into(namespace, associated, sealed, memoryview(dest))
    return bytes(dest)


def test_seal_round_trips_and_hides_the_plaintext() -> None:
    sealer = Sealer(os.urandom(32))
    plaintext = os.urandom(1000)
    sealed = sealer.seal("tenant", b"key", plaintext)
    assert len(sealed) == len(plaintext) + OVERHEAD_BYTES
    assert plaintext[:32] not in sealed
    assert open_bytes(sealer, "tenant", b"key", sealed) == plaintext
    assert sealer.seal("tenant", b"key", plaintext) != sealed  # fresh nonce every time


@ANYTHING_CHANGED
def test_anything_changed_fails_to_open(namespace, associated, flip) -> None:
    sealer = Sealer(os.urandom(32))
    sealed = sealer.seal("tenant", b"key", os.urandom(1000))
    if flip is not None:
        sealed[flip] ^= 0x01
    with pytest.raises(TierError):
        open_bytes(sealer, namespace, associated, sealed)


def open_detached(sealer: Sealer, namespace: str, associated: bytes, seal: bytes, body) -> bytes:
    """Open a detached seal in uneven pieces, in order, in place: 1, 299, then the rest."""
    view = memoryview(body)
    opening = sealer.opener(namespace, associated, seal)
    for start, end in [(0, 1), (1, 300), (300, len(view))]:
        opening.update_into(view[start:end], view[start:end])
    opening.finish()
    return bytes(body)


def test_detached_seal_opens_piece_by_piece_under_the_same_key() -> None:
    """`seal_detached` (sealed layered records) encrypts in place under the namespace's
    sealing key, the one `seal` uses, with a fresh nonce; opened in pieces it gives the
    plaintext back."""
    sealer = Sealer(os.urandom(32))
    plaintext = os.urandom(1000)
    body = bytearray(plaintext)
    seal = sealer.seal_detached("tenant", b"key", memoryview(body))
    assert len(seal) == OVERHEAD_BYTES and plaintext[:32] not in body
    nonce, tag = seal[:12], seal[12:]
    assert open_bytes(sealer, "tenant", b"key", nonce + bytes(body) + tag) == plaintext
    again = bytearray(plaintext)
    assert sealer.seal_detached("tenant", b"key", memoryview(again))[:12] != nonce
    assert open_detached(sealer, "tenant", b"key", seal, bytearray(body)) == plaintext


@ANYTHING_CHANGED
def test_anything_changed_fails_a_detached_seal_at_the_end(namespace, associated, flip) -> None:
    sealer = Sealer(os.urandom(32))
    body = bytearray(os.urandom(1000))
    seal = sealer.seal_detached("tenant", b"key", memoryview(body))
    if flip is not None:
        body[flip] ^= 0x01
    with pytest.raises(TierError, match="failed authentication"):
        open_detached(sealer, namespace, associated, seal, body)


def test_another_master_key_cannot_open() -> None:
    sealed = Sealer(os.urandom(32)).seal("tenant", b"key", b"secret kv")
    with pytest.raises(TierError):
        open_bytes(Sealer(os.urandom(32)), "tenant", b"key", sealed)


def test_master_key_must_be_long_enough() -> None:
    with pytest.raises(ValueError):
        Sealer(b"short")


def test_sealed_redis_round_trips_and_tampering_is_a_miss(redis_url, make_payload, same) -> None:
    master = os.urandom(32)
    tier = RedisTier(redis_url, 8 << 20, sealer=Sealer(master))
    payload = make_payload(dtype=torch.float32)
    assert tier.put(b"k", payload, namespace="tenant")
    assert same(tier.get(b"k", namespace="tenant"), payload)
    rkey = tier.redis_key(b"k", "tenant")
    with redis.Redis.from_url(redis_url) as client:
        stored = client.get(rkey)
        assert payload.data is not None and bytes(payload.data[:64].numpy()) not in stored

    # another key reads and writes under other names (test_shared_keyspaces.py); the value
    # copied under its name is still a miss
    stranger = RedisTier(redis_url, 8 << 20, sealer=Sealer(os.urandom(32)))
    with redis.Redis.from_url(redis_url) as client:
        client.set(stranger.redis_key(b"k", "tenant"), client.get(rkey))
    assert stranger.get(b"k", namespace="tenant") is None and stranger.stats.rejected == 1
    stranger.close()

    tier.put(b"k", payload, namespace="tenant")
    with redis.Redis.from_url(redis_url) as client:
        value = bytearray(client.get(rkey))
        value[-20] ^= 0x01
        client.set(rkey, bytes(value))
    assert tier.get(b"k", namespace="tenant") is None and tier.stats.errors == 1
    tier.close()


def test_an_encrypting_tier_refuses_planted_plaintext(redis_url, make_payload) -> None:
    plain = RedisTier(redis_url, 8 << 20)
    plain.put(b"k", make_payload(), namespace="tenant")
    plain.close()
    sealed = RedisTier(redis_url, 8 << 20, sealer=Sealer(os.urandom(32)))
    with redis.Redis.from_url(redis_url) as client:  # what an attacker could write
        client.set(sealed.redis_key(b"k", "tenant"), client.get(plain.redis_key(b"k", "tenant")))
    assert sealed.get(b"k", namespace="tenant") is None and sealed.stats.rejected == 1
    sealed.close()
