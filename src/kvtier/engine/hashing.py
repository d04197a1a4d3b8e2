"""Content addresses of KV blocks: key = H(parent key, block token ids, namespace).

The key of block i covers every token before it through the parent chain, so two sequences
share a key only when they share the whole prefix. H is BLAKE2b (a cryptographic hash) so one
tenant cannot craft tokens that collide with another tenant's key, and the encoding is fixed
(little-endian int32 token ids, length-prefixed fields) so keys are stable across processes,
machines and restarts; Python's `hash()` is salted per process and never used.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KEY_BYTES = 32
_DOMAIN = b"kvtier-block-v1"  # BLAKE2b personalization: at most 16 bytes


def namespace_bytes(model_id: str, tenant_salt: str | bytes | None = None) -> bytes:
    """The namespace of a request: model id plus the tenant's salt (empty when none).

    Length prefixes keep ("ab", "c") and ("a", "bc") apart.
    """
    model = model_id.encode()
    salt = tenant_salt.encode() if isinstance(tenant_salt, str) else (tenant_salt or b"")
    return struct.pack("<I", len(model)) + model + struct.pack("<I", len(salt)) + salt


def block_key(parent_key: bytes | None, token_ids: Sequence[int], namespace: bytes) -> bytes:
    """Key of one block given its parent's key (None for the first block of a sequence)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_DOMAIN)
    h.update(struct.pack("<I", len(namespace)))
    h.update(namespace)
    # A flag byte rather than a zero key: no real key can then pose as "no parent".
    h.update(b"\x01" + parent_key if parent_key is not None else b"\x00")
    h.update(struct.pack(f"<I{len(token_ids)}i", len(token_ids), *token_ids))
    return h.digest()


def extend_block_keys(
    keys: list[bytes], token_ids: Sequence[int], block_size: int, namespace: bytes
) -> list[bytes]:
    """Append the keys of every full block of `token_ids` not yet in `keys` (in place).

    Requests keep their key list and call this as tokens arrive, so each block is hashed once.
    """
    num_full = len(token_ids) // block_size
    for i in range(len(keys), num_full):
        parent = keys[i - 1] if i else None
        keys.append(block_key(parent, token_ids[i * block_size : (i + 1) * block_size], namespace))
    return keys
