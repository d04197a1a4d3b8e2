"""The self-describing record that disk segments and Redis values hold.

    offset  size  field
    0       4     magic b"KVTR"
    4       1     version: 1, or 2, 3 or 4 for a layered record (below)
    5       1     flags: 1 = body sealed (AES-GCM), 2 = tombstone (a durable delete, no body),
                  4 = page head (the head is padded to 4096 bytes instead of 64),
                  8 = signed (a GMAC of the record follows the metadata),
                  16 = named key (the key id of the master key that protects it follows
                  the metadata)
    6       2     key length K
    8       2     namespace length N (UTF-8)
    10      2     metadata length M (form, dtype, shape; see Payload.meta)
    12      8     body length B
    20      8     xxh3-64 of the body, as stored (the ciphertext when sealed)
    28      8     written at, Unix seconds (float64): eviction order after a restart
    36      8     xxh3-64 of bytes 0..36 and of key + namespace + metadata (+ key id,
                  + signature or seal)
    44      K+N+M key, namespace, metadata
    ...     8     with flag 16: the key id (crypto.key_id) of the master key the record is
                  signed or sealed under
    ...     28    with flag 8: nonce || tag of a GMAC (crypto.Signer) over K, N, M, B, key,
                  namespace, metadata and body, under the namespace's key; in a version-4
                  record (flag 1): the nonce || tag its body was sealed with
    ...     0-63  zero padding: the head is a multiple of 64 bytes (of 4096 with flag 4)
    H       B     body (H = head length)

A layered record (version 2, written by a tier built with `layered=True`, for unsealed
full-precision chunks; version 3 when the tier signs them) serves the layer-wise pipelined
restore (docs/tiers.md): its metadata field starts with a layer table, `L` (u16) and one
xxh3-64 per layer (u64 each), before the payload's own metadata; and its body is stored
layer-major: the payload is [blocks, L, ...] block-major, the body is the same bytes with
the first two axes swapped, so layer i of the chunk is one contiguous range `[i * B / L, (i
+ 1) * B / L)` of the body that a reader can fetch, and verify against its own checksum,
alone. The body checksum still covers the whole body, so a whole read checks a layered
record as it checks any other (and swaps the axes back). Version 1 records are read as
before. A signed layered record (version 3: the same layout, FLAG_SIGNED, its signature over
the layer-major body) is read a layer at a time in order, each layer fed into the
signature's check as it passes its checksum, the signature checked with the last layer
(`LayerCheck`): a reader takes no layer of it as proof of anything until then. It has a
version of its own because readers before it call a version-2 record with a protection flag
corrupt, and delete it.

A sealed layered record (version 4, FLAG_SEALED) is a layered record whose layer-major body
was then sealed (AES-256-GCM, `Sealer.seal_detached`): the body is the ciphertext alone, as
long as the payload, and its nonce || tag sits in the head where a signed record has its
signature, so that layer i is still the range `[i * B / L, (i + 1) * B / L)`, of ciphertext
(GCM encrypts in counter mode: byte for byte in place). The layer checksums are of the
ciphertext, as stored. The associated data is a label of its own, K, N, M, B, key, namespace
and metadata (`_sealed_identity`), so neither a version-1 sealed body nor a signed record's
pieces can pass for one. It is read a layer at a time in order, each layer decrypted once it
passes its checksum, the tag checked with the last layer (`LayerCheck`). A new version
because a reader before it would read the nonce || tag as part of the body, and one before
version 2 refuses layered records anyway: to every older reader it is a miss.

A store that several deployments share (Redis) names the key in its keyed records (flag 16),
so that a writer can tell from a head alone whether a value was written under its own master
key and protection (`RecordCodec.owns`) before it replaces it. The key id is covered by the
head checksum, not by the signature or seal: a record under another key fails those anyway,
and leaving it out keeps what they cover the same with and without it.

A layered record's layer count must be its payload's axis 1 (the shape is in the metadata,
which the signature or the seal covers, the layer table is not), or it is corrupt: a layer
table edited to say 15 layers of 60 blocks would otherwise lay an authentic body out wrong.

All integers little-endian. Heads are padded so that a body starts 64-byte aligned wherever its
record does (segments start records at multiples of 64), as the buffers it is read into are:
the kernel then copies page-cache pages at full speed; bodies at unaligned file offsets read 30%
slower here. O_DIRECT segments write page heads (flag 4): their records start at multiples of
4096, so the body then starts on a page of the file and can move between the device and page-
aligned caller memory with no bounce copy; the flag makes each record say where its body is.

The head checksum lets a scan trust a record's length (and so find the next record) without
reading its body; the body checksum is verified on every read, so a record that was torn or
bit-rotted is never served. Both checksums are unkeyed: any reader can tell such damage
(`CorruptRecord`) from a record its own key does not verify (`RejectedRecord`: sealed or signed
with another key, or forged by someone who recomputed the checksums), which is why the keyed
check sits on top of them rather than replacing them. xxh3 runs at tens of GB/s (zlib's crc32
measured 4 GB/s here, blake2b 1 GB/s), yet a page-cache read is a memory copy too, so verifying
still costs a second pass over the bytes.
"""

from __future__ import annotations

import functools
import struct
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash

from kvtier.tiers.base import CorruptRecord, RejectedRecord, TierError
from kvtier.tiers.crypto import (
    KEY_ID_BYTES,
    MAC_BYTES,
    OVERHEAD_BYTES,
    Sealer,
    SignatureCheck,
    Signer,
    Unsealing,
)
from kvtier.tiers.payload import BytesLike, Payload, as_buffer, empty_bytes
from kvtier.vocab import FULL

MAGIC = b"KVTR"
VERSION = 1
VERSION_LAYERED = 2
VERSION_SIGNED_LAYERED = 3
VERSION_SEALED_LAYERED = 4
FLAG_SEALED = 1
FLAG_TOMBSTONE = 2
FLAG_PAGE_HEAD = 4
FLAG_SIGNED = 8
FLAG_KEY_ID = 16
_KNOWN_FLAGS = FLAG_SEALED | FLAG_TOMBSTONE | FLAG_PAGE_HEAD | FLAG_SIGNED | FLAG_KEY_ID
_PROTECTION = FLAG_SEALED | FLAG_SIGNED
# a layered record's version says how it is protected, and is checked against its flags
_LAYERED_VERSIONS = {
    0: VERSION_LAYERED,
    FLAG_SIGNED: VERSION_SIGNED_LAYERED,
    FLAG_SEALED: VERSION_SEALED_LAYERED,
}
_SEALED_LAYERED_LABEL = b"kvtier sealed layered record v4|"  # what a version-4 seal covers first

_FIXED = struct.Struct("<4sBBHHHQQd")
_IDENTITY = struct.Struct("<HHHQ")  # K, N, M, B: what a signature covers ahead of the bytes
_SUM = struct.Struct("<Q")
_LAYER_COUNT = struct.Struct("<H")
FIXED_BYTES = _FIXED.size + _SUM.size
HEAD_ALIGN = 64
PAGE_BYTES = 4096  # what a page head is padded to: O_DIRECT's file offset and memory alignment


def align_up(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True, slots=True)
class RecordHead:
    """A record's head, checked: everything but the body."""

    flags: int
    key: bytes
    namespace: str
    meta: bytes
    body_len: int
    body_sum: int
    written_at: float
    head_len: int
    raw: bytes  # the head's bytes up to its zero padding, as read or written
    mac: bytes = b""  # the signature, with FLAG_SIGNED
    layer_sums: tuple[int, ...] = ()  # a layered record's per-layer xxh3-64s, else empty
    key_id: bytes = b""  # the key id it names, with FLAG_KEY_ID

    def matches(self, buf: BytesLike) -> bool:
        """Whether `buf` starts with exactly this head, padding included: how a reader checks
        that the record it read back is the one its index points to, without parsing it."""
        return bytes(memoryview(buf)[: self.head_len]) == self.raw + bytes(
            self.head_len - len(self.raw)
        )

    @property
    def record_len(self) -> int:
        return self.head_len + self.body_len

    @property
    def tombstone(self) -> bool:
        return bool(self.flags & FLAG_TOMBSTONE)

    @property
    def layered(self) -> bool:
        return bool(self.layer_sums)

    def layer_span(self, layer: int) -> tuple[int, int]:
        """Where layer `layer` lies in a layered record's body: (offset, length)."""
        length = self.body_len // len(self.layer_sums)
        return layer * length, length

    @property
    def payload_nbytes(self) -> int:
        """Size of the payload the body holds (a version-1 sealed body is longer by the nonce
        and tag; a sealed layered record keeps them in its head)."""
        if self.flags & FLAG_SEALED and not self.layered:
            return self.body_len - OVERHEAD_BYTES
        return self.body_len


def encode_head(
    key: bytes,
    namespace: str,
    meta: bytes,
    body: BytesLike,
    flags: int,
    written_at: float,
    mac: bytes = b"",
    layer_sums: tuple[int, ...] = (),
    key_id: bytes = b"",
) -> bytes:
    """The head of a record holding `body`, padded to 64 bytes, or to 4096 with FLAG_PAGE_HEAD.

    mac: the record's signature (`signed_pieces`), with FLAG_SIGNED; a sealed layered
        record's nonce || tag, with FLAG_SEALED and `layer_sums`.
    layer_sums: a layered record's per-layer checksums (version 2, 3 or 4 as `flags` protect
        it; `body` layer-major).
    key_id: the key id to name (`KEY_ID_BYTES`), which sets FLAG_KEY_ID; none clears it.
    """
    if key_id and len(key_id) != KEY_ID_BYTES:
        raise ValueError(f"a key id is {KEY_ID_BYTES} bytes")
    flags = flags | FLAG_KEY_ID if key_id else flags & ~FLAG_KEY_ID
    ns = namespace.encode()
    version = VERSION
    if layer_sums:
        meta = _layer_table(layer_sums) + meta
        version = _LAYERED_VERSIONS[flags & _PROTECTION]
    fixed = _FIXED.pack(
        MAGIC,
        version,
        flags,
        len(key),
        len(ns),
        len(meta),
        len(body),
        xxhash.xxh3_64_intdigest(body),
        written_at,
    )
    variable = key + ns + meta + key_id + mac
    head = fixed + _SUM.pack(xxhash.xxh3_64_intdigest(fixed + variable)) + variable
    return head + bytes(align_up(len(head), _head_align(flags)) - len(head))


def _layer_table(layer_sums: tuple[int, ...]) -> bytes:
    return _LAYER_COUNT.pack(len(layer_sums)) + b"".join(_SUM.pack(s) for s in layer_sums)


def _split_layer_table(meta: bytes) -> tuple[tuple[int, ...], bytes]:
    """A layered record's metadata field -> (its layer sums, the payload's metadata)."""
    if len(meta) < _LAYER_COUNT.size:
        raise CorruptRecord("layered record without a layer table")
    (count,) = _LAYER_COUNT.unpack_from(meta)
    end = _LAYER_COUNT.size + count * _SUM.size
    if count == 0 or len(meta) < end:
        raise CorruptRecord("layered record's layer table cut short")
    sums = tuple(_SUM.unpack_from(meta, _LAYER_COUNT.size + i * _SUM.size)[0] for i in range(count))
    return sums, meta[end:]


def _head_align(flags: int) -> int:
    return PAGE_BYTES if flags & FLAG_PAGE_HEAD else HEAD_ALIGN


def _mac_len(version: int, flags: int) -> int:
    """Length of the nonce || tag after the metadata (and key id): a signature, or a
    version-4 seal's."""
    return MAC_BYTES if flags & FLAG_SIGNED or version == VERSION_SEALED_LAYERED else 0


def _key_id_len(flags: int) -> int:
    return KEY_ID_BYTES if flags & FLAG_KEY_ID else 0


def head_len(fixed: BytesLike) -> int:
    """Total head length from its first FIXED_BYTES, so a reader knows how much more to read."""
    if len(fixed) < FIXED_BYTES:
        raise CorruptRecord("record head cut short")
    magic, version, flags, key_len, ns_len, meta_len, *_ = _FIXED.unpack_from(fixed)
    if magic != MAGIC:
        raise CorruptRecord("not a kvtier record (bad magic)")
    known = version == VERSION or version in _LAYERED_VERSIONS.values()
    if not known or flags & ~_KNOWN_FLAGS:
        # Likely a newer writer's record: not ours to judge, let alone delete.
        raise RejectedRecord(f"record of an unknown format (version {version}, flags {flags})")
    trailer = _key_id_len(flags) + _mac_len(version, flags)
    return align_up(FIXED_BYTES + key_len + ns_len + meta_len + trailer, _head_align(flags))


def parse_head(buf: BytesLike) -> RecordHead:
    """Check and decode a head; `buf` must start at the record and hold at least the head."""
    length = head_len(buf)
    if len(buf) < length:
        raise CorruptRecord("record head cut short")
    view = memoryview(buf)
    _, version, flags, key_len, ns_len, meta_len, body_len, body_sum, written_at = (
        _FIXED.unpack_from(view)
    )
    (head_sum,) = _SUM.unpack_from(view, _FIXED.size)
    meta_end = key_len + ns_len + meta_len
    key_id_end = meta_end + _key_id_len(flags)
    end = FIXED_BYTES + key_id_end + _mac_len(version, flags)
    variable = bytes(view[FIXED_BYTES:end])
    if xxhash.xxh3_64_intdigest(bytes(view[: _FIXED.size]) + variable) != head_sum:
        raise CorruptRecord("record head checksum mismatch")
    if bytes(view[end:length]) != bytes(length - end):  # memcmp: a page head pads ~4 KB
        raise CorruptRecord("record head padding is not zero")
    try:
        namespace = variable[key_len : key_len + ns_len].decode()
    except UnicodeDecodeError as exc:
        raise CorruptRecord("record namespace unreadable") from exc
    meta = variable[key_len + ns_len : meta_end]
    layer_sums: tuple[int, ...] = ()
    if version != VERSION:
        layer_sums, meta = _split_layer_table(meta)
        if body_len % len(layer_sums):
            raise CorruptRecord("layered record's body does not split into its layers")
        if _LAYERED_VERSIONS.get(flags & _PROTECTION) != version:
            raise CorruptRecord(f"version-{version} record with protection flags {flags}")
    return RecordHead(
        flags=flags,
        key=variable[:key_len],
        namespace=namespace,
        meta=meta,
        layer_sums=layer_sums,
        key_id=variable[meta_end:key_id_end],
        mac=variable[key_id_end:],
        body_len=body_len,
        body_sum=body_sum,
        written_at=written_at,
        head_len=length,
        raw=bytes(view[:end]),
    )


class RecordCodec:
    """Payload <-> (head, body), sealing bodies when the tier encrypts at rest, or signing
    records when it wants integrity without secrecy (one or neither, never both).

    layered: write full-precision chunks as layered records (version 2, 3 when signed, 4
    when sealed: see the module doc), so they can be restored a layer at a time.
    name_key: name the master key in every keyed record (FLAG_KEY_ID) and accept only
    records that name this codec's key: for a store several deployments share."""

    def __init__(
        self,
        sealer: Sealer | None = None,
        signer: Signer | None = None,
        *,
        layered: bool = False,
        name_key: bool = False,
    ) -> None:
        if sealer is not None and signer is not None:
            raise ValueError("a tier seals or signs its records, not both (sealing authenticates)")
        self.sealer = sealer
        self.signer = signer
        self._protection = FLAG_SEALED if sealer else FLAG_SIGNED if signer else 0
        self.layered = layered
        keyed = sealer or signer
        self.key_id = keyed.key_id if name_key and keyed is not None else b""

    @property
    def mode(self) -> str:
        """How this codec protects its records: "sealed", "signed" or "none"."""
        return _MODES[self._protection]

    def owns(self, head: RecordHead) -> bool:
        """Whether `head` says its record was written under this codec's protection and key
        (its key id, where it names one): what a writer checks before it replaces a value.
        A head proves nothing (anyone can write one); the keyed check of a read does."""
        return head.flags & _PROTECTION == self._protection and head.key_id == self.key_id

    def accepts(self, head: RecordHead) -> bool:
        """Whether this reader may serve `head`'s record a layer at a time: layered as its
        shape says, and protected the way this tier protects (a sealing tier serves sealed
        layered records only, a signing tier signed ones, a plain one plain ones), under its
        key where records name one."""
        if not head.layered or not self.owns(head):
            return False
        try:
            _layout(head)
        except (CorruptRecord, ValueError):
            return False  # a whole read tells what is wrong with it
        return True

    def layer_check(self, head: RecordHead) -> LayerCheck:
        """What verifies one read of `head`'s record a layer at a time (`accepts` first)."""
        return LayerCheck(head, self.signer, self.sealer)

    def encode(
        self, key: bytes, namespace: str, payload: Payload, *, page_head: bool = False
    ) -> tuple[bytes, BytesLike]:
        """The head and the body to write after it (the payload's own bytes when not sealed).

        page_head: pad the head to 4096 bytes (FLAG_PAGE_HEAD) so that, in a file where the
            record starts on a page, the body does too. Not for sealed bodies: those are always
            decrypted out of a scratch buffer, so the padding would buy nothing.
        """
        if payload.data is None:
            raise TierError("a size-only payload has no bytes to store")
        meta = payload.meta()
        body: BytesLike = as_buffer(payload.data.cpu())
        flags = FLAG_PAGE_HEAD if page_head else 0
        mac = b""
        layers = _layer_count(payload) if self.layered else 0
        if layers:
            body = layer_major(payload.data.cpu(), payload.shape[0], layers)
            if self.sealer is not None:
                # sealed after the layout, in place (the layout is a copy of our own), so a
                # layer of ciphertext is a layer of the chunk; no page head, as below
                flags = FLAG_SEALED
                identity = _sealed_identity(key, namespace, meta, len(body))
                mac = self.sealer.seal_detached(namespace, identity, body)
            elif self.signer is not None:
                flags |= FLAG_SIGNED
                mac = self.signer.sign(namespace, signed_pieces(key, namespace, meta, body))
            sums = layer_sums(body, layers)  # of the body as stored: the ciphertext if sealed
            return encode_head(
                key, namespace, meta, body, flags, time.time(), mac, sums, self.key_id
            ), body
        if self.sealer is not None:
            body = self.sealer.seal(namespace, key + meta, body)
            flags = FLAG_SEALED
        elif self.signer is not None:
            flags |= FLAG_SIGNED
            mac = self.signer.sign(namespace, signed_pieces(key, namespace, meta, body))
        return encode_head(
            key, namespace, meta, body, flags, time.time(), mac, key_id=self.key_id
        ), body

    def tombstone(self, key: bytes, namespace: str) -> bytes:
        return encode_head(key, namespace, b"", b"", FLAG_TOMBSTONE, time.time())

    def body_into(self, head: RecordHead, out: torch.Tensor | None) -> torch.Tensor:
        """Where a reader puts the payload bytes: `out[:n]` when it is a CPU tensor, else a
        fresh CPU tensor (that `deliver` copies into a device `out` afterwards)."""
        nbytes = head.payload_nbytes
        if out is not None and out.device.type == "cpu":
            check_out(out, nbytes)
            return out[:nbytes]
        return empty_bytes(nbytes)

    def decode(
        self,
        head: RecordHead,
        body: BytesLike,
        dest: torch.Tensor,
        in_place: bool,
        body_sum: int | None = None,
    ) -> Payload:
        """Verify the body and leave the payload bytes in `dest`.

        in_place: the body was read straight into `dest` (an unsealed disk read), so only the
            checks remain to do; otherwise the body is copied or decrypted into `dest`.
        body_sum: the body's xxh3-64 when the reader already hashed it on the way in.

        CorruptRecord when the unkeyed checksum fails (damage any reader sees), RejectedRecord
        when this tier's key or settings do not accept the record.
        """
        if body_sum is None:
            body_sum = xxhash.xxh3_64_intdigest(body)
        if body_sum != head.body_sum:
            raise CorruptRecord("record body checksum mismatch")
        if head.flags & _PROTECTION != self._protection:
            # A tier that seals or signs must not serve a plain record someone planted (its
            # checksums are no proof of origin), and one cannot open what another sealed.
            found, expected = _describe(head.flags), _describe(self._protection)
            raise RejectedRecord(f"record is {found}; this tier expects {expected}")
        if head.key_id != self.key_id:
            # Another deployment's master key (a signature or seal would fail too, later and
            # at the price of a pass over the body).
            found, expected = head.key_id.hex() or "none", self.key_id.hex() or "none"
            raise RejectedRecord(f"record names key id {found}; this tier's is {expected}")
        try:
            described = _described(head.meta)
        except ValueError as exc:
            raise RejectedRecord(str(exc)) from exc  # a newer writer's dtype or form, maybe
        if self.sealer is not None and head.layered:
            # decrypted in order straight into the blocks' rows, the tag checked at the end
            identity = _sealed_identity(head.key, head.namespace, head.meta, head.body_len)
            opening = self.sealer.opener(head.namespace, identity, head.mac)
            _scatter([memoryview(body)], block_major_rows(dest, head), opening.update_into)
            opening.finish()
        elif self.sealer is not None:
            self.sealer.open_into(head.namespace, head.key + head.meta, body, as_buffer(dest))
        else:
            if self.signer is not None:
                pieces = signed_pieces(head.key, head.namespace, head.meta, body)
                self.signer.verify(head.namespace, pieces, head.mac)
            if head.layered:
                block_major_into(body, dest, head)
            elif not in_place:
                as_buffer(dest)[:] = body
        return Payload(dest, head.payload_nbytes, described.form, described.dtype, described.shape)


def _layer_count(payload: Payload) -> int:
    """A chunk payload's layer count when it can be stored layered: full precision, shaped
    [blocks, layers, ...] (the engine's block-major chunks), else 0."""
    shape = payload.shape
    if payload.form != FULL or len(shape) < 3 or shape[1] < 1:
        return 0
    return int(shape[1])


def layer_major(data: torch.Tensor, blocks: int, layers: int) -> memoryview:
    """A block-major chunk's bytes with blocks and layers swapped: always a fresh copy (a
    sealing codec encrypts it in place), even where the swap alone would be a view."""
    swapped = torch.empty(data.numel(), dtype=torch.uint8)
    swapped.view(layers, blocks, -1).copy_(data.view(blocks, layers, -1).transpose(0, 1))
    return as_buffer(swapped)


def layer_sums(body: memoryview, layers: int) -> tuple[int, ...]:
    """Each layer's xxh3-64 of a layer-major body."""
    step = len(body) // layers
    return tuple(xxhash.xxh3_64_intdigest(body[i * step : (i + 1) * step]) for i in range(layers))


def _layout(head: RecordHead) -> tuple[int, int]:
    """A layered record's (blocks, layers), its layer table checked against its shape: the
    shape is authenticated with the body where a key protects it, the table is not.
    CorruptRecord when they disagree; ValueError when the metadata is unreadable."""
    shape = _described(head.meta).shape
    layers = len(head.layer_sums)
    if len(shape) < 3 or shape[1] != layers:
        raise CorruptRecord("layered record's layer table does not match its shape")
    return shape[0], layers


def block_major_rows(dest: torch.Tensor, head: RecordHead) -> list[memoryview]:
    """`dest`'s rows for a layered record's body in body order: layer 0 of every block, then
    layer 1, ...: where a layer-major body lands block-major."""
    blocks, layers = _layout(head)
    view = as_buffer(dest)
    step = head.body_len // (blocks * layers)
    rows = (step * (block * layers + layer) for layer in range(layers) for block in range(blocks))
    return [view[at : at + step] for at in rows]


def block_major_into(body: BytesLike, dest: torch.Tensor, head: RecordHead) -> None:
    """Copy a layered record's (verified) layer-major body into `dest` block-major."""
    blocks, layers = _layout(head)
    with warnings.catch_warnings():  # a Redis reply is read-only bytes; it is only read here
        warnings.simplefilter("ignore", UserWarning)
        src = torch.frombuffer(body, dtype=torch.uint8)
    # in 8-byte words when a block's layer is whole words: half the time of a byte copy here
    word = torch.int64 if head.body_len % (8 * blocks * layers) == 0 else torch.uint8
    laid_out = dest[: head.body_len].view(word).view(blocks, layers, -1)
    laid_out.copy_(src.view(word).view(layers, blocks, -1).transpose(0, 1))


def verify_layer(head: RecordHead, layer: int, pieces: list[memoryview]) -> None:
    """Check a layer of a layered record, read as `pieces` in body order, against its own
    checksum; CorruptRecord if it fails (nothing of it may be used)."""
    hasher = xxhash.xxh3_64()
    for piece in pieces:
        hasher.update(piece)
    if hasher.intdigest() != head.layer_sums[layer]:
        raise CorruptRecord(f"layer {layer} checksum mismatch")


def signed_pieces(
    key: bytes, namespace: str, meta: bytes, body: BytesLike
) -> tuple[bytes, BytesLike]:
    """What a record's signature covers: the lengths, then key, namespace and metadata, then
    the body. The lengths make the concatenation unambiguous, and naming key and namespace
    binds the record to them: a signed record copied under another name does not verify."""
    return _signed_identity(key, namespace, meta, len(body)), body


def _signed_identity(key: bytes, namespace: str, meta: bytes, body_len: int) -> bytes:
    ns = namespace.encode()
    return _IDENTITY.pack(len(key), len(ns), len(meta), body_len) + key + ns + meta


def _sealed_identity(key: bytes, namespace: str, meta: bytes, body_len: int) -> bytes:
    """A sealed layered record's associated data: its own label, then what a signature
    covers ahead of the body (the lengths make it unambiguous)."""
    return _SEALED_LAYERED_LABEL + _signed_identity(key, namespace, meta, body_len)


class LayerCheck:
    """Verifies one read of a layered record a layer at a time and leaves each layer's payload
    bytes where they go: each layer checked against its own checksum (damage) and, for a
    signed or sealed record, the whole body against the signature or the seal's tag (forgery:
    the checksums are unkeyed, so whoever can write the record can make them match); a sealed
    record's layers are decrypted as they pass.

    The tag covers the body in order, so a signed or sealed record's layers must come in
    order, 0 to L-1, each fed into the check (a sealed one decrypted) once it passes its
    checksum, and the tag is checked with the last one: until then no layer of it is
    authenticated (a sealed layer's plaintext included), and a caller that has used earlier
    layers must throw away what it computed from them when the last one fails (the pipelined
    restore does: the request's step is discarded and recomputed). Any failure raises
    (CorruptRecord or RejectedRecord) and fails every later layer of this read too."""

    def __init__(
        self, head: RecordHead, signer: Signer | None, sealer: Sealer | None = None
    ) -> None:
        self.head = head
        self._keyed: SignatureCheck | Unsealing | None = None
        if head.flags & FLAG_SIGNED:
            if signer is None:
                raise RejectedRecord("record is signed; this tier has no key to check it")
            self._keyed = signer.verifier(head.namespace, head.mac)
            self._keyed.update(_signed_identity(head.key, head.namespace, head.meta, head.body_len))
        elif head.flags & FLAG_SEALED:
            if sealer is None:
                raise RejectedRecord("record is sealed; this tier has no key to open it")
            identity = _sealed_identity(head.key, head.namespace, head.meta, head.body_len)
            self._keyed = sealer.opener(head.namespace, identity, head.mac)
        self._next = 0  # the layer a keyed record's check takes next; -1 once failed

    def verify(
        self, layer: int, pieces: list[memoryview], into: list[memoryview] | None = None
    ) -> None:
        """Check layer `layer`, read as `pieces` in body order, and leave its payload bytes in
        `into` (in body order; the blocks' slices of the layer), or in `pieces` themselves
        when None (read where they go: a sealed layer is decrypted in place). Raises if it
        may not be used, and `into` may then hold anything."""
        into = pieces if into is None else into
        if self._keyed is None:
            verify_layer(self.head, layer, pieces)
            _copy_into(pieces, into)
            return
        if layer != self._next:
            self._next = -1
            kind = _describe(self.head.flags)
            raise RejectedRecord(f"{kind} record's layer {layer} read out of order")
        self._next = -1  # until this layer has passed
        verify_layer(self.head, layer, pieces)
        if isinstance(self._keyed, Unsealing):
            _scatter(pieces, into, self._keyed.update_into)
        else:
            for piece in pieces:
                self._keyed.update(piece)
            _copy_into(pieces, into)
        if layer == len(self.head.layer_sums) - 1:
            self._keyed.finish()
        self._next = layer + 1


def _copy_into(pieces: list[memoryview], into: list[memoryview]) -> None:
    if into is not pieces:
        _scatter(pieces, into, _copy)


def _copy(source: memoryview, target: memoryview) -> None:
    target[:] = source


def _scatter(
    pieces: list[memoryview], into: list[memoryview], step: Callable[[memoryview, memoryview], None]
) -> None:
    """`step(source, target)` over `pieces` laid end to end against `into` laid end to end,
    in equal runs (a layer read as one Redis reply goes to 16 blocks' slices; one read into
    the slices themselves is opened in place). TierError when their lengths differ."""
    if sum(len(piece) for piece in pieces) != sum(len(target) for target in into):
        raise TierError("layer slabs do not match the record's layer")
    targets = iter(into)
    target, at = memoryview(b""), 0
    for piece in pieces:
        done = 0
        while done < len(piece):
            if at == len(target):
                target, at = next(targets), 0
                continue
            n = min(len(piece) - done, len(target) - at)
            step(piece[done : done + n], target[at : at + n])
            done += n
            at += n


_MODES = {0: "none", FLAG_SIGNED: "signed", FLAG_SEALED: "sealed"}


def _describe(protection: int) -> str:
    if protection & FLAG_SEALED:
        return "sealed"
    return "signed" if protection & FLAG_SIGNED else "neither sealed nor signed"


@functools.lru_cache(maxsize=1024)
def _described(meta: bytes) -> Payload:
    """Form, dtype and shape from a record's metadata, parsed once per distinct value: chunks of
    one model share a few (parsing took a tenth of a small read's time). Errors are not cached."""
    return Payload.from_meta(None, 0, meta)


def check_out(out: torch.Tensor, nbytes: int) -> None:
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < nbytes:
        raise TierError(f"out must be a 1-D uint8 tensor of at least {nbytes} bytes")


def deliver(payload: Payload, out: torch.Tensor | None) -> Payload:
    """Move a payload read on the CPU into a device `out`; a CPU `out` already holds it."""
    if out is None or payload.data is None or payload.data.data_ptr() == out.data_ptr():
        return payload
    check_out(out, payload.nbytes)
    target = out[: payload.nbytes]
    target.copy_(payload.data)
    return payload.with_data(target)
