"""Keyed protection of stored KV, one key per tenant namespace: sealing (AES-256-GCM, secrecy
and integrity) and signing (GMAC, integrity only).

Per-namespace keys are derived from one master key with HKDF-SHA256 (RFC 5869), so a
deployment keeps one secret, a leaked namespace key exposes one tenant only, and forgetting a
master key erases everything sealed with it. Sealing and signing derive different keys (their
own HKDF info), so the same master key serves both. Each seal or signature draws a fresh random
96-bit nonce; NIST SP 800-38D allows 2**32 such messages per key, i.e. 2**32 chunks per tenant
between master key rotations. The associated data binds a ciphertext (or a signature) to its
block key and metadata, so a record copied under another key, or with edited shape/form, fails
like tampered bytes do.

Signing is GMAC (NIST SP 800-38D): AES-GCM that authenticates the record and encrypts nothing.
It is the fastest keyed check measured here (docs/tiers.md, "Sealing and signing": 2.4-3.6x
HMAC-SHA256, 9-12x keyed BLAKE2b on a 5.9 MB body), and `cryptography`, which does the
sealing, already has it: no new dependency.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvtier.tiers.base import RejectedRecord
from kvtier.tiers.payload import BytesLike

NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD_BYTES = NONCE_BYTES + TAG_BYTES  # what sealing adds to a body
MAC_BYTES = NONCE_BYTES + TAG_BYTES  # a signature: nonce || tag
_SEAL_INFO = b"kvtier tier payload v1|"
_SIGN_INFO = b"kvtier tier mac v1|"

_Made = TypeVar("_Made")


class _NamespaceKeys(Generic[_Made]):
    """`make(derived key)` per namespace, derived from the master key once and cached."""

    def __init__(self, master_key: bytes, info: bytes, make: Callable[[bytes], _Made]) -> None:
        if len(master_key) < 32:
            raise ValueError("the master key must be at least 32 bytes of secret randomness")
        self._master_key = bytes(master_key)
        self._info = info
        self._make = make
        self._keys: dict[str, _Made] = {}
        self._lock = threading.Lock()

    def __call__(self, namespace: str) -> _Made:
        with self._lock:
            made = self._keys.get(namespace)
            if made is None:
                key = HKDF(
                    algorithm=hashes.SHA256(),
                    length=32,
                    salt=None,
                    info=self._info + namespace.encode(),
                ).derive(self._master_key)
                made = self._keys[namespace] = self._make(key)
        return made


class Sealer:
    """Seals and opens payload bytes for a namespace; one instance serves all tiers."""

    def __init__(self, master_key: bytes) -> None:
        self._cipher = _NamespaceKeys(master_key, _SEAL_INFO, AESGCM)

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
        """Write the plaintext into `dest` (exactly its size); RejectedRecord when the key,
        namespace, ciphertext or associated data differ from what was sealed."""
        view = memoryview(sealed)
        try:
            self._cipher(namespace).decrypt_into(
                bytes(view[:NONCE_BYTES]), view[NONCE_BYTES:], associated, dest
            )
        except InvalidTag as exc:
            raise RejectedRecord(
                "sealed payload failed authentication (tampered or wrong key)"
            ) from exc


class Signer:
    """Signs and verifies records for a namespace (integrity without secrecy): the bytes stay
    readable by anyone who can read the store, but nobody without the master key can write a
    record this tier will serve."""

    def __init__(self, master_key: bytes) -> None:
        self._aes = _NamespaceKeys(master_key, _SIGN_INFO, algorithms.AES)

    def sign(self, namespace: str, pieces: Sequence[BytesLike]) -> bytes:
        """nonce || tag (`MAC_BYTES`) over the concatenation of `pieces`, which the caller
        makes unambiguous (lengths first)."""
        nonce = os.urandom(NONCE_BYTES)
        encryptor = Cipher(self._aes(namespace), modes.GCM(nonce)).encryptor()
        for piece in pieces:
            encryptor.authenticate_additional_data(piece)
        encryptor.finalize()
        return nonce + encryptor.tag

    def verify(self, namespace: str, pieces: Sequence[BytesLike], mac: bytes) -> None:
        """RejectedRecord unless `mac` is this namespace's signature of exactly `pieces`."""
        check = self.verifier(namespace, mac)
        for piece in pieces:
            check.update(piece)
        check.finish()

    def verifier(self, namespace: str, mac: bytes) -> SignatureCheck:
        """`verify` a piece at a time, for pieces that arrive one after another (the layers
        of a layered record). RejectedRecord at once when `mac` has the wrong length."""
        if len(mac) != MAC_BYTES:
            raise RejectedRecord("record signature has the wrong length")
        mode = modes.GCM(mac[:NONCE_BYTES], mac[NONCE_BYTES:])
        return SignatureCheck(Cipher(self._aes(namespace), mode).decryptor())


class SignatureCheck:
    """A signature being checked: the signed pieces fed in order, then `finish`. Until
    `finish` returns, nothing fed may be trusted."""

    def __init__(self, decryptor: Any) -> None:
        self._decryptor = decryptor

    def update(self, piece: BytesLike) -> None:
        self._decryptor.authenticate_additional_data(piece)

    def finish(self) -> None:
        """RejectedRecord unless the pieces fed are exactly what was signed."""
        try:
            self._decryptor.finalize()
        except InvalidTag as exc:
            raise RejectedRecord("record signature does not verify (forged or wrong key)") from exc
