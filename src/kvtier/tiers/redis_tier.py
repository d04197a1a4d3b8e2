"""Remote tier on Redis (or Redis Cluster): one value per chunk, written and read in pipelines.

Key scheme: `<prefix>:<keyspace>:<namespace>:<hex key>`, or `<prefix>:<keyspace>:{<namespace>}:
<hex key>` with `hash_tag=True`, which puts all of a namespace's keys in one cluster slot (see
docs/tiers.md). The keyspace is the protection mode and the master key's id (`none`,
`signed-<key id>`, `sealed-<key id>`). Each value is a `record.py` record: head (with the key,
namespace and key id inside, so a value moved under another name is refused) followed by the
body, checksummed and optionally sealed or signed.

Ownership: replicas with another master key or mode write under other names, so they never
meet; this tier writes, counts, evicts and deletes only names in its own keyspace. A value
there that another key or mode wrote (moved by hand or by an attacker) is a miss that stays:
the count neither holds nor evicts it, and a put does not replace it (a name the tier does not
count is SET NX; a value already there is written over only when its head names this tier's
key and mode, or is damaged).

Budget: the tier counts the bytes (key + value) of the keys in its keyspace, oldest first
(written or last read), and before a put would pass `capacity_bytes` it deletes the oldest of
them (`on_full="evict"`) or refuses the put (`on_full="refuse"`). The count is rebuilt from a
SCAN of the keyspace at first contact and after every outage, so it stays exact across restarts
of this process and of the server. Keys also expire after `ttl_s` unless read again.

Failure: every call is bounded by `timeout_s` with no client-side retries. A connection error
or timeout marks the server down for a backoff (doubling from `retry_after_s[0]` up to
`retry_after_s[1]`); while down, calls fail at once without touching the network, so a dead
server costs one timeout per backoff period, not one per lookup. The next call after the
backoff reconnects.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import redis
import torch
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import Connection, Encoder, PythonRespSerializer
from redis.exceptions import RedisClusterException, RedisError, ResponseError
from redis.retry import Retry

from kvtier.tiers.base import (
    CorruptRecord,
    LayerRead,
    RejectedRecord,
    TierBackend,
    TierEntry,
    TierError,
    error_reason,
)
from kvtier.tiers.crypto import Sealer, Signer
from kvtier.tiers.payload import Payload
from kvtier.tiers.record import (
    LayerCheck,
    RecordCodec,
    RecordHead,
    deliver,
    head_len,
    parse_head,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
# enough for any head this package writes (keys, namespace, shape; a layered record's
# 30-layer table adds about 250 bytes); a longer head is read whole instead
_HEAD_PROBE_BYTES = 1024
# what a put reads of a value already under its name to tell whose it is: a head of any
# model this package serves (a layered record's table takes 8 bytes a layer) fits; a value
# with a longer head is left where it is
_REPLACE_PROBE_BYTES = 1 << 16
_UNREADABLE = "\x00unreadable"  # namespace slot for damaged values in our keyspace


class _UncopiedValuesConnection(Connection):
    """A connection that sends large values as they are.

    redis-py packs commands with hiredis when it is installed, which copies every value into a
    fresh buffer. With the fresh buffer the value itself needs (head + body), a put of a few
    hundred KB allocated and freed two large buffers per call, and glibc returned and re-faulted
    them each time: 0.9 ms per 368 KB SET here, against 0.23 ms with the pure-Python packer,
    which hands values over to `sendall` unchanged. Replies are still parsed by hiredis.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault(
            "command_packer",
            PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode),
        )
        super().__init__(*args, **kwargs)


@dataclass(slots=True)
class _Held:
    rkey: bytes
    stored_bytes: int  # key + value: what the budget counts
    expires_at: float  # time.time(); inf without a TTL
    counted_at: float  # time.monotonic() when this process counted it (see _rebuild)
    nbytes: int  # the payload's own size
    form: str


class RedisTier(TierBackend):
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        capacity_bytes: int = 1 << 30,
        *,
        prefix: str = "kvt",
        ttl_s: float | None = 3600.0,
        timeout_s: float = 0.25,
        cluster: bool = False,
        hash_tag: bool = False,
        on_full: Literal["evict", "refuse"] = "evict",
        sealer: Sealer | None = None,
        signer: Signer | None = None,
        retry_after_s: tuple[float, float] = (0.1, 5.0),
        layered: bool = False,
        name: str = "remote",
    ) -> None:
        """
        sealer, signer: encrypt and authenticate every value (AES-GCM), or only authenticate
            it (GMAC); at most one. With neither, a value is only checksummed, and whoever can
            write to the server can make this tier serve bytes of their choosing: logged as a
            warning (see "Threat model" in docs/storage-format.md).
        layered: write full-precision chunks as layered records (record.py: a layer is one
            contiguous range of the value), read back a layer at a time with pipelined
            GETRANGEs by the pipelined restore (signed and sealed ones too: record.LayerCheck
            checks the tag with the last layer).
        """
        super().__init__(name)
        self.url = url
        self._capacity = capacity_bytes
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.cluster = cluster
        self.hash_tag = hash_tag
        self.on_full = on_full
        self.retry_after_s = retry_after_s
        self._codec = RecordCodec(sealer, signer, layered=layered, name_key=True)
        key_id = self._codec.key_id.hex()
        self.keyspace = f"{self._codec.mode}-{key_id}" if key_id else self._codec.mode
        if sealer is None and signer is None:
            log.warning(
                "%s: values in redis at %s are neither signed nor sealed: whoever can write "
                "there can make this tier serve forged KV; give it a master key to sign them",
                name,
                url,
            )
        self._client: redis.Redis | RedisCluster | None = None
        self._held: OrderedDict[tuple[str, bytes], _Held] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()  # the held-keys count
        self._link = threading.Lock()  # the client and the outage state below
        self._down_until = 0.0
        self._failures = 0
        self._resync = True  # the held-keys count is rebuilt from the server at first contact
        self._budget_checked = False  # the server's own bound, checked once (first contact)

    # -- budget --------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def fits(self, nbytes: int) -> bool:
        if self.on_full == "evict":
            return nbytes < self._capacity
        return self._used + nbytes <= self._capacity

    # -- contract ------------------------------------------------------------------------

    def redis_key(self, key: bytes, namespace: str) -> bytes:
        tagged = f"{{{namespace}}}" if self.hash_tag else namespace
        return f"{self.prefix}:{self.keyspace}:{tagged}:".encode() + key.hex().encode()

    def _put(self, key: bytes, payload: Payload, namespace: str) -> bool:
        result = self._put_batch([(key, payload)], namespace)[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def put_many(
        self, items: Sequence[tuple[bytes, Payload]], *, namespace: str = ""
    ) -> list[bool]:
        """One pipeline for all items (evictions included): one round trip, not one per chunk."""
        start = time.perf_counter()
        try:
            results: list[bool | BaseException] = self._put_batch(items, namespace)
        except Exception as exc:  # see TierBackend.put
            results = [exc] * len(items)
        elapsed = time.perf_counter() - start
        oks = [
            self._record_put(key, payload, result, elapsed)
            for (key, payload), result in zip(items, results, strict=True)
        ]
        self._deliver_evictions()
        return oks

    def _get(self, key: bytes, namespace: str, out: torch.Tensor | None) -> Payload | None:
        result = self._get_batch([key], namespace, [out])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def get_many(
        self,
        keys: Sequence[bytes],
        *,
        namespace: str = "",
        outs: Sequence[torch.Tensor | None] | None = None,
    ) -> list[Payload | None]:
        """One pipeline for all keys; each result is checked on its own."""
        outs = outs if outs is not None else [None] * len(keys)
        start = time.perf_counter()
        try:
            results: list[Payload | BaseException | None] = self._get_batch(keys, namespace, outs)
        except Exception as exc:  # see TierBackend.get
            results = [exc] * len(keys)
        elapsed = time.perf_counter() - start
        return [
            self._record_get(key, result, elapsed)
            for key, result in zip(keys, results, strict=True)
        ]

    @property
    def layered(self) -> bool:
        return self._codec.layered

    def layer_heads(self, keys: Sequence[tuple[bytes, str]]) -> list[RecordHead | None]:
        """One pipeline: each value's first `_HEAD_PROBE_BYTES` bytes (GETRANGE) and, as GETEX does
        for a whole read, its TTL refreshed."""
        if not self._codec.layered:
            return [None] * len(keys)
        px = self._px()

        def probe(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for key, namespace in keys:
                rkey = self.redis_key(key, namespace)
                pipe.getrange(rkey, 0, _HEAD_PROBE_BYTES - 1)
                if px is not None:
                    pipe.pexpire(rkey, px)
            return pipe.execute(raise_on_error=False)

        try:
            replies = self._call(probe)[:: 1 if px is None else 2]
        except TierError as exc:
            self._failed("layer heads", b"", exc)
            return [None] * len(keys)
        heads = [
            self._layered_head(key, ns, reply)
            for (key, ns), reply in zip(keys, replies, strict=True)
        ]
        found = sum(head is not None for head in heads)
        self.stats.add(reads=found, hits=found)
        return heads

    def _layered_head(self, key: bytes, namespace: str, reply: Any) -> RecordHead | None:
        if not isinstance(reply, bytes) or not reply:
            return None  # missing, or the pipeline's command failed: a whole read decides
        try:
            head = parse_head(reply)
        except TierError:
            return None  # not a layered record we can read a layer at a time (or damaged)
        if head.key != key or head.namespace != namespace or not self._codec.accepts(head):
            return None
        return head

    def layer_check(self, head: RecordHead) -> LayerCheck:
        return self._codec.layer_check(head)

    def read_layer(self, items: Sequence[LayerRead], layer: int) -> list[bool]:
        """One pipeline of GETRANGEs, one per chunk, each checked against its layer's sum
        before its bytes are copied (decrypted, when sealed) into the slabs."""
        start = time.perf_counter()
        spans = [item.head.layer_span(layer) for item in items]

        def read(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for item, (offset, length) in zip(items, spans, strict=True):
                first = item.head.head_len + offset
                pipe.getrange(self.redis_key(item.key, item.namespace), first, first + length - 1)
            return pipe.execute(raise_on_error=False)

        try:
            replies = self._call(read)
        except TierError as exc:
            for item in items:
                self._failed("layer read", item.key, exc)
            return [False] * len(items)
        oks = []
        for item, (_, length), reply in zip(items, spans, replies, strict=True):
            try:
                if not isinstance(reply, bytes) or len(reply) != length:
                    raise CorruptRecord("layer range missing or cut short")
                # checked, then copied (a sealed layer decrypted) from the reply into the slabs
                item.check.verify(layer, [memoryview(reply)], item.slabs)
            except (TierError, ValueError) as exc:
                self._failed("layer read", item.key, exc)
                oks.append(False)
                continue
            self.stats.add(bytes_read=length)
            oks.append(True)
        self.stats.get_latency.observe(time.perf_counter() - start)
        return oks

    def _delete(self, key: bytes, namespace: str) -> None:
        with self._lock:
            self._drop((namespace, key))
        self._call(lambda client: client.delete(self.redis_key(key, namespace)))

    def _contains(self, key: bytes, namespace: str) -> bool:
        return bool(self._call(lambda client: client.exists(self.redis_key(key, namespace))))

    def entries(self) -> list[TierEntry]:
        """Keys under the prefix that this tier counts, oldest first (rebuilt on first contact)."""
        try:
            self._call(lambda client: None)
        except TierError:
            return []
        with self._lock:
            return [
                TierEntry(key, namespace, held.nbytes, held.form)
                for (namespace, key), held in self._held.items()
                if namespace != _UNREADABLE
            ]

    shared = True  # replicas write the same keys: the store asks here on a local miss

    def find(self, keys: Sequence[bytes], *, namespace: str = "") -> list[TierEntry | None]:
        """Which of `keys` the server holds, written by this process or any other: one
        pipeline of STRLEN (0: absent), then one of head reads for those present; each call
        bounded by `timeout_s`. Heads that do not name the key asked for, or this tier's
        protection and key, are not entries."""
        try:
            rkeys = [self.redis_key(key, namespace) for key in keys]
            lengths = self._call(lambda client: _pipelined(client, "strlen", rkeys))
            present = [i for i, n in enumerate(lengths) if isinstance(n, int) and n > 0]
            if not present:
                return [None] * len(keys)
            probes = self._call(
                lambda client: _pipelined(
                    client, "getrange", [rkeys[i] for i in present], 0, _HEAD_PROBE_BYTES - 1
                )
            )
        except TierError as exc:  # counted, not logged each time: see TierBackend._failed
            self.stats.error(error_reason(exc))
            log.debug("%s: find failed: %s", self.name, exc)
            return [None] * len(keys)
        found: list[TierEntry | None] = [None] * len(keys)
        for i, probe in zip(present, probes, strict=True):
            with contextlib.suppress(TierError, ValueError, TypeError):
                head = parse_head(probe)
                if (
                    head.key == keys[i]
                    and head.namespace == namespace
                    and not head.tombstone
                    and self._codec.owns(head)
                ):
                    form = Payload.from_meta(None, 0, head.meta).form
                    found[i] = TierEntry(keys[i], namespace, head.payload_nbytes, form)
        return found

    def close(self) -> None:
        with self._link:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- batches -------------------------------------------------------------------------

    def _put_batch(
        self, items: Sequence[tuple[bytes, Payload]], namespace: str
    ) -> list[bool | BaseException]:
        self._call(lambda client: None)  # fail fast while down; recount before counting more
        values = []
        for key, payload in items:
            head, body = self._codec.encode(key, namespace, payload)
            values.append(b"".join((head, body)))  # one copy, into the bytes the client sends
        results: list[bool | BaseException] = [False] * len(items)
        # In decision order, so a key evicted by a later item of the same batch is deleted
        # after it was set: (redis key, index of the item for a SET, or None for a DEL).
        commands: list[tuple[bytes, int | None]] = []
        evicted: list[tuple[tuple[str, bytes], _Held]] = []
        fresh = set()  # items whose name this tier does not count: SET NX (see write)
        with self._lock:
            self._purge_expired()
            for index, ((key, payload), value) in enumerate(zip(items, values, strict=True)):
                rkey = self.redis_key(key, namespace)
                stored = len(rkey) + len(value)
                replacing = self._drop((namespace, key))
                if stored > self._capacity or (
                    self.on_full == "refuse" and self._used + stored > self._capacity
                ):
                    if replacing:
                        # Uncounted now, so it must not stay behind: a refused overwrite
                        # leaves no value rather than an old one nobody counts.
                        commands.append((rkey, None))
                    continue
                victims = self._evict_until(self._capacity - stored)
                commands.extend((held.rkey, None) for _, held in victims)
                evicted.extend(victims)
                # Counted before the write: if the pipeline dies half way the count is high,
                # never low, and the resync after the outage makes it exact again.
                self._held[(namespace, key)] = _Held(
                    rkey, stored, self._expiry(), time.monotonic(), payload.nbytes, payload.form
                )
                self._used += stored
                commands.append((rkey, index))
                if not replacing:
                    fresh.add(index)
        self._report(evicted)

        def write(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            px = self._px()
            for rkey, index in commands:
                if index is None:
                    pipe.delete(rkey)
                else:
                    # A name this tier counts holds its own value: written over. Any other
                    # is set only if empty (NX), the common case, and a value already there
                    # is replaced once its head says whose it is (`_replace`).
                    pipe.set(rkey, values[index], px=px, nx=index in fresh)
            return pipe.execute(raise_on_error=False)

        replies = self._call(write)
        taken = []
        for (_, index), reply in zip(commands, replies, strict=True):
            if index is None:
                continue
            if isinstance(reply, BaseException):
                with self._lock:
                    self._drop((namespace, items[index][0]))
                results[index] = TierError(f"SET refused: {reply}")
            elif reply is None:  # NX: the name holds a value already
                taken.append(index)
            else:
                results[index] = True
        replaced = self._replace(items, values, taken, namespace)
        for index, result in zip(taken, replaced, strict=True):
            results[index] = result
        return results

    def _replace(
        self,
        items: Sequence[tuple[bytes, Payload]],
        values: Sequence[bytes],
        taken: Sequence[int],
        namespace: str,
    ) -> list[bool | BaseException]:
        """Write `items[i]` (i in `taken`) over the value its name already holds when that
        value's head says this tier's key and mode wrote it for this name (the same chunk:
        keys are content addresses), or when it is damaged (every reader sees that); a value
        another key or mode wrote stays, and its put is refused as a RejectedRecord."""
        if not taken:
            return []
        rkeys = [self.redis_key(items[i][0], namespace) for i in taken]
        probes = self._call(
            lambda client: _pipelined(client, "getrange", rkeys, 0, _REPLACE_PROBE_BYTES - 1)
        )
        results: dict[int, bool | BaseException] = {}
        rewrite = []
        with self._lock:
            for i, probe in zip(taken, probes, strict=True):
                key = items[i][0]
                if (namespace, key) not in self._held:
                    # Evicted by a later item of this batch, its DEL already sent: as if set
                    # and then evicted, like any other item of the batch.
                    results[i] = True
                elif self._may_replace(key, namespace, probe):
                    rewrite.append(i)
                else:
                    self._drop((namespace, key))
                    results[i] = RejectedRecord("the name holds a value of another key or mode")
        pairs = [(self.redis_key(items[i][0], namespace), values[i]) for i in rewrite]
        replies = (
            self._call(lambda client: _pipelined_sets(client, pairs, self._px())) if pairs else []
        )
        for i, reply in zip(rewrite, replies, strict=True):
            results[i] = True
            if isinstance(reply, BaseException):
                with self._lock:
                    self._drop((namespace, items[i][0]))
                results[i] = TierError(f"SET refused: {reply}")
        return [results[i] for i in taken]

    def _may_replace(self, key: bytes, namespace: str, probe: Any) -> bool:
        """Whether a put of `key` may write over the value whose first bytes are `probe` (see
        `_replace`); a value gone since the SET NX may be written too."""
        if probe == b"":
            return True
        if not isinstance(probe, bytes):
            return False  # the probe failed: whose it is is unknown
        try:
            if head_len(probe) > len(probe):
                return False  # a head longer than the probe: whose it is is unknown
            head = parse_head(probe)
        except CorruptRecord:
            return True  # damage every reader sees
        except TierError:
            return False  # a format this reader does not know: a newer writer's
        return head.key == key and head.namespace == namespace and self._codec.owns(head)

    def _get_batch(
        self, keys: Sequence[bytes], namespace: str, outs: Sequence[torch.Tensor | None]
    ) -> list[Payload | BaseException | None]:
        def read(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            px = self._px()
            for key in keys:
                # GETEX refreshes the TTL: a chunk that is read stays, like an LRU.
                pipe.getex(self.redis_key(key, namespace), px=px)
            return pipe.execute(raise_on_error=False)

        replies = self._call(read)
        results: list[Payload | BaseException | None] = []
        corrupt: list[bytes] = []
        for key, out, reply in zip(keys, outs, replies, strict=True):
            try:
                results.append(self._decode(key, namespace, out, reply))
            except TierError as exc:
                results.append(exc)
                if isinstance(exc, CorruptRecord):
                    corrupt.append(key)
        with self._lock:
            for key, result in zip(keys, results, strict=True):
                if isinstance(result, Payload) and (namespace, key) in self._held:
                    self._held.move_to_end((namespace, key))
                    self._held[(namespace, key)].expires_at = self._expiry()
                elif result is None or isinstance(result, CorruptRecord | RejectedRecord):
                    # Gone (expired, evicted by the server, lost in a restart), damaged (and
                    # deleted below), or not this tier's (a value another key wrote, moved
                    # under this name): not counted, so never evicted either.
                    self._drop((namespace, key))
        if corrupt:
            # Damage every reader sees (a checksum or a length): remove it (best effort; the
            # cluster client splits a multi-key DEL by slot). A RejectedRecord stays: it may
            # be another reader's to serve (this one may have the wrong key), and a forger
            # could write it again anyway.
            with contextlib.suppress(TierError):
                self._call(
                    lambda client: client.delete(*[self.redis_key(k, namespace) for k in corrupt])
                )
        return results

    def _decode(
        self, key: bytes, namespace: str, out: torch.Tensor | None, reply: Any
    ) -> Payload | None:
        if reply is None:
            return None
        if isinstance(reply, BaseException):
            raise TierError(f"GET failed: {reply}")
        head = parse_head(reply)
        body = memoryview(reply)[head.head_len :]
        if len(body) != head.body_len:
            raise CorruptRecord("value length does not match its head")
        if head.key != key or head.namespace != namespace or head.tombstone:
            # Not damage that every reader sees: a reader with another key scheme (hash_tag)
            # may find the same Redis key under another name.
            raise RejectedRecord("value belongs to another key or namespace")
        dest = self._codec.body_into(head, out)
        return deliver(self._codec.decode(head, body, dest, in_place=False), out)

    # -- connection, backoff, resync -----------------------------------------------------

    def _call(self, op: Callable[[Any], T]) -> T:
        """Run `op(client)` within the timeout; any failure becomes a TierError."""
        client = self._connection()
        try:
            return op(client)
        except ResponseError as exc:  # the server answered: it is up, the command failed
            raise TierError(f"redis refused: {exc}") from exc
        except (RedisError, RedisClusterException, OSError) as exc:
            self._mark_down(client, exc)
            raise TierError(f"redis unreachable: {exc}") from exc

    def _connection(self) -> Any:
        """The current client, connected and recounted; TierError while the server is down.

        Under `_link`, so that of the threads arriving after an outage one reconnects and
        recounts and the others wait for it (then use its client, or fail fast in its backoff).
        """
        with self._link:
            if time.monotonic() < self._down_until:
                raise TierError("remote tier is down; waiting out the backoff")
            client = self._client
            if client is None:
                client = self._client = self._connect()
            if self._resync:
                try:
                    self._rebuild(client)
                except ResponseError as exc:
                    raise TierError(f"redis refused: {exc}") from exc
                except (RedisError, RedisClusterException, OSError) as exc:
                    self._mark_down_locked(client, exc)
                    raise TierError(f"redis unreachable: {exc}") from exc
                if self._failures:
                    # A recount went through: the server answers again.
                    log.info("%s: redis at %s is back", self.name, self.url)
                    self._failures = 0
            return client

    def _connect(self) -> redis.Redis | RedisCluster:
        options: dict[str, Any] = {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            # No client retries: a lookup that fails must fail within one timeout; the
            # backoff below decides when to try again.
            "retry": Retry(NoBackoff(), 0),
        }
        if self.url.startswith("redis://"):  # TLS and Unix sockets keep their own classes
            options["connection_class"] = _UncopiedValuesConnection
        if self.cluster:
            return RedisCluster.from_url(self.url, **options)
        return redis.Redis.from_url(self.url, **options)

    def _mark_down(self, client: Any, exc: BaseException) -> None:
        with self._link:
            self._mark_down_locked(client, exc)

    def _mark_down_locked(self, client: Any, exc: BaseException) -> None:
        if client is not self._client:
            # A call on a client already replaced: its outage is counted (and logged) once,
            # by whichever call failed first; a failure on an old client says nothing of a
            # new one.
            return
        self._failures += 1
        first, cap = self.retry_after_s
        delay = min(cap, first * 2 ** (self._failures - 1))
        self._down_until = time.monotonic() + delay
        if self._failures == 1:
            log.warning("%s: redis at %s unreachable (%s); backing off", self.name, self.url, exc)
        # A fresh client (and connection pool) at the next contact: a restarted server makes
        # the old connections stale. The old client is dropped, not closed: other threads may
        # still be reading from its sockets (closing them under a reader raised "I/O operation
        # on closed file"); their calls fail or finish on their own, and the pool's connections
        # are closed when it is garbage-collected. The keys are recounted at the next contact:
        # the server may have lost or kept anything meanwhile.
        self._client = None
        self._resync = True

    def _rebuild(self, client: Any) -> None:
        """Recount the keys in our keyspace from the server (SCAN + one pipeline)."""
        started = time.monotonic()
        match = f"{self.prefix}:{self.keyspace}:*".encode()
        rkeys = list(client.scan_iter(match=match, count=1000))
        pipe = client.pipeline(transaction=False)
        for rkey in rkeys:
            pipe.strlen(rkey)
            pipe.getrange(rkey, 0, _HEAD_PROBE_BYTES - 1)
            pipe.pttl(rkey)
        replies = pipe.execute(raise_on_error=False)
        found = []
        now = time.time()
        for i, rkey in enumerate(rkeys):
            length, probe, pttl = replies[3 * i : 3 * i + 3]
            if not isinstance(length, int) or length == 0:
                continue  # vanished between SCAN and now
            expires = now + pttl / 1000 if isinstance(pttl, int) and pttl > 0 else float("inf")
            written_at, entry, nbytes, form = 0.0, (_UNREADABLE, bytes(rkey)), 0, ""
            try:
                head = parse_head(probe)
            except CorruptRecord:
                pass  # damage every reader sees: counted, and first to be evicted
            except TierError:
                continue  # a newer writer's format: not this tier's to count or evict
            else:
                if self.redis_key(head.key, head.namespace) != rkey or not self._codec.owns(head):
                    continue  # another key's or mode's value under this name: likewise
                try:
                    form = Payload.from_meta(None, 0, head.meta).form
                except ValueError:
                    continue  # a form or dtype of a newer writer: likewise
                written_at, entry = head.written_at, (head.namespace, head.key)
                nbytes = head.payload_nbytes
            held = _Held(bytes(rkey), len(rkey) + length, expires, started, nbytes, form)
            found.append((written_at, entry, held))
        found.sort(key=lambda item: item[0])
        with self._lock:
            held_now = OrderedDict((entry, held) for _, entry, held in found)
            # Keys this process counted while the SCAN ran may be missing from it: keep them.
            for entry, held in self._held.items():
                if held.counted_at >= started:
                    held_now[entry] = held
            self._held = held_now
            self._used = sum(held.stored_bytes for held in held_now.values())
            # The budget may be smaller than last run's, whatever `on_full` says.
            excess = self._evict_until(self._capacity)
            self._resync = False
        if excess:
            client.delete(*[held.rkey for _, held in excess])
        self._report(excess)
        if not self._budget_checked:
            self._budget_checked = True
            self._check_server_budget(client)
        log.info(
            "%s: counted %d keys (%d bytes) under %s:%s:*",
            self.name,
            len(found),
            self._used,
            self.prefix,
            self.keyspace,
        )

    def _check_server_budget(self, client: Any) -> None:
        """Warn once when the server itself bounds nothing. This tier counts only its own
        writes, so under several replicas the global budget is Redis's: `maxmemory` with an
        evicting policy (docs/serve.md, "Replicas sharing Redis")."""
        if self.cluster:
            return  # INFO answers per node; each node's own settings apply
        try:
            memory = client.info("memory")
        except (RedisError, OSError):
            return  # INFO may be renamed or refused on managed servers: nothing to check
        limit, policy = memory.get("maxmemory", 0), memory.get("maxmemory_policy", "")
        if not limit or policy == "noeviction":
            log.warning(
                "%s: redis at %s has maxmemory=%s, maxmemory-policy=%s: nothing bounds what "
                "all replicas together store there; set maxmemory and allkeys-lru",
                self.name,
                self.url,
                limit,
                policy,
            )

    # -- bookkeeping (under self._lock) --------------------------------------------------

    def _px(self) -> int | None:
        """The TTL every write and read sets, in milliseconds (PX), or None without one."""
        return None if self.ttl_s is None else int(self.ttl_s * 1000)

    def _expiry(self) -> float:
        return float("inf") if self.ttl_s is None else time.time() + self.ttl_s

    def _purge_expired(self) -> None:
        now = time.time()
        while self._held:
            held = next(iter(self._held.values()))
            if held.expires_at > now:
                break
            self._held.popitem(last=False)
            self._used -= held.stored_bytes

    def _evict_until(self, limit: int) -> list[tuple[tuple[str, bytes], _Held]]:
        """Uncount the oldest keys until at most `limit` bytes are counted; returns them."""
        victims = []
        while self._held and self._used > limit:
            entry, held = self._held.popitem(last=False)
            self._used -= held.stored_bytes
            victims.append((entry, held))
        return victims

    def _report(self, victims: list[tuple[tuple[str, bytes], _Held]]) -> None:
        for (namespace, key), _ in victims:
            if namespace != _UNREADABLE:
                self._evicted(key, namespace)

    def _drop(self, entry: tuple[str, bytes]) -> bool:
        held = self._held.pop(entry, None)
        if held is not None:
            self._used -= held.stored_bytes
        return held is not None


def _pipelined_sets(client: Any, pairs: Sequence[tuple[bytes, bytes]], px: int | None) -> list[Any]:
    """SET of every (redis key, value) pair in one pipeline, with the TTL `px`."""
    pipe = client.pipeline(transaction=False)
    for rkey, value in pairs:
        pipe.set(rkey, value, px=px)
    return pipe.execute(raise_on_error=False)


def _pipelined(client: Any, command: str, rkeys: Sequence[bytes], *args: Any) -> list[Any]:
    """`command(rkey, *args)` for every key in one pipeline; failed replies come back as
    exceptions in the list."""
    pipe = client.pipeline(transaction=False)
    for rkey in rkeys:
        getattr(pipe, command)(rkey, *args)
    return pipe.execute(raise_on_error=False)
