"""Encryption at rest for spilled KV: AES-256-GCM with one key per tenant namespace.

Per-namespace keys are derived from one master key with HKDF-SHA256 (RFC 5869), so a
deployment keeps one secret, a leaked namespace key exposes one tenant only, and forgetting a
master key erases everything sealed with it. Each seal draws a fresh random 96-bit nonce; NIST
SP 800-38D allows 2**32 such messages per key, i.e. 2**32 chunks per tenant between master
key rotations. The associated data binds a ciphertext to its block key and metadata, so a record
copied under another key, or with edited shape/form, fails to open like tampered bytes do.
"""

from __future__ import annotations

import os
import threading

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvtier.tiers.base import TierError
from kvtier.tiers.payload import BytesLike

NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD_BYTES = NONCE_BYTES + TAG_BYTES
_HKDF_INFO = b"kvtier tier payload v1|"


class Sealer:
    """Seals and opens payload bytes for a namespace; one instance serves all tiers."""

    def __init__(self, master_key: bytes) -> None:
        if len(master_key) < 32:
            raise ValueError("the master key must be at least 32 bytes of secret randomness")
        self._master_key = bytes(master_key)
        self._ciphers: dict[str, AESGCM] = {}
        self._lock = threading.Lock()

    def _cipher(self, namespace: str) -> AESGCM:
        with self._lock:
            cipher = self._ciphers.get(namespace)
            if cipher is None:
                key = HKDF(
                    algorithm=hashes.SHA256(),
                    length=32,
                    salt=None,
                    info=_HKDF_INFO + namespace.encode(),
                ).derive(self._master_key)
                cipher = self._ciphers[namespace] = AESGCM(key)
        return cipher

    def seal(self, namespace: str, associated: bytes, plaintext: BytesLike) -> bytearray:
        """nonce || ciphertext || tag, `OVERHEAD_BYTES` longer than the plaintext."""
        sealed = bytearray(len(plaintext) + OVERHEAD_BYTES)
        view = memoryview(sealed)
        nonce = view[:NONCE_BYTES] = os.urandom(NONCE_BYTES)
        self._cipher(namespace).encrypt_into(nonce, plaintext, associated, view[NONCE_BYTES:])
        return sealed

    def open_into(
        self, namespace: str, associated: bytes, sealed: BytesLike, dest: memoryview
    ) -> None:
        """Write the plaintext into `dest` (exactly its size); TierError when the key, namespace,
        ciphertext or associated data differ from what was sealed."""
        view = memoryview(sealed)
        try:
            self._cipher(namespace).decrypt_into(
                bytes(view[:NONCE_BYTES]), view[NONCE_BYTES:], associated, dest
            )
        except InvalidTag as exc:
            raise TierError("sealed payload failed authentication (tampered or wrong key)") from exc
