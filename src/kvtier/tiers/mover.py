"""Background movement: spills and prefetches run on worker threads behind bounded queues.

- `spill(chunk, payload)` never blocks. When the spill queue is full the spill is dropped and
  counted: the KV is recomputed if it is needed again, which is slower but correct. The caller
  must leave the payload's bytes untouched until the returned future is done (e.g. keep the
  device blocks or the staging buffer until then).
- `demote(chunk_id, to)` and `delete(chunk_id)` go through the same queue and workers: every
  write down the cascade (a store demotion reads one tier and writes the next, a disk delete
  appends a tombstone, a Redis delete is a round trip) leaves the caller's thread. With one
  spill worker (the default) writes run in the order they were queued, so a delete queued
  after a spill of the same chunk wins.
- `prefetch(chunk_ids, then=f)` returns a `Prefetch` whose `result(timeout)` gives what has
  arrived by the deadline, None for the rest: the caller recomputes those instead of waiting.
  `then` runs on the worker on each loaded payload (e.g. decoding a quantized chunk), so the
  caller gets its result ready; a None from it is a miss.
- A failed copy is retried `retries` times; then a prefetch is a miss (and the store forgets
  the chunk) and a spill reports False.
- `close(drain=True)` finishes queued work; `close(drain=False)` cancels it (spills report
  False, prefetches None). Either way no future is left unresolved.

The workers release the GIL in every copy, file and socket call, so threads suffice.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvtier.tiers.payload import Payload
from kvtier.tiers.store import Chunk, TieredStore

log = logging.getLogger(__name__)


class Prefetch:
    """Results of one prefetch, filled in as loads finish, in the order the chunks were given."""

    def __init__(self, count: int, then: Callable[[Payload], Any] | None = None) -> None:
        self._results: list[Any] = [None] * count
        self.then = then
        self._resolved = [False] * count
        self._pending = count
        self._done = threading.Condition()
        self.cancelled = False

    def result(self, timeout: float | None = None) -> list[Any]:
        """Wait until all loads finish or `timeout` seconds pass; what is not there is None."""
        with self._done:
            self._done.wait_for(lambda: self._pending == 0, timeout)
            return list(self._results)

    def entry(self, index: int, timeout: float | None = None) -> tuple[Any, bool]:
        """Wait until load `index` finishes or `timeout` seconds pass: (its payload, or what
        `then` made of it, or None; whether it finished). A restore takes chunks in order as
        they arrive, without waiting for loads it needs later."""
        with self._done:
            self._done.wait_for(lambda: self._resolved[index], timeout)
            return self._results[index], self._resolved[index]

    def done(self) -> bool:
        with self._done:
            return self._pending == 0

    def cancel(self) -> None:
        """Skip the loads not started yet (after a deadline the caller has moved on)."""
        self.cancelled = True

    def _resolve(self, index: int, payload: Any) -> None:
        with self._done:
            self._results[index] = payload
            self._resolved[index] = True
            self._pending -= 1
            self._done.notify_all()


class Mover:
    def __init__(
        self,
        store: TieredStore,
        *,
        spill_queue: int = 64,
        prefetch_queue: int = 256,
        spill_workers: int = 1,
        prefetch_workers: int = 2,
        retries: int = 2,
    ) -> None:
        self.store = store
        self.attempts = 1 + retries
        self._spills: queue.Queue[_WriteJob | None] = queue.Queue(spill_queue)
        self._prefetches: queue.Queue[_PrefetchJob | None] = queue.Queue(prefetch_queue)
        self._lock = threading.Lock()  # orders enqueues against close()
        self._closed = False
        self._counts_lock = threading.Lock()
        self.counts = {
            "spills": 0,
            "spills_dropped": 0,
            "spills_failed": 0,
            "demotes": 0,
            "demotes_dropped": 0,
            "demotes_failed": 0,
            "deletes": 0,
            "deletes_dropped": 0,
            "deletes_failed": 0,
            "prefetches": 0,
            "prefetches_dropped": 0,
            "prefetch_misses": 0,
        }
        self._workers: list[tuple[threading.Thread, queue.Queue]] = []
        for kind, jobs, count, run in (
            ("spill", self._spills, spill_workers, self._run_spills),
            ("prefetch", self._prefetches, prefetch_workers, self._run_prefetches),
        ):
            for i in range(count):
                worker = threading.Thread(target=run, name=f"kvtier-{kind}-{i}", daemon=True)
                worker.start()
                self._workers.append((worker, jobs))

    def spill(
        self,
        chunk: Chunk,
        payload: Payload,
        *,
        tier: str | None = None,
        form: str | None = None,
        ready: Callable[[], None] | None = None,
    ) -> Future[bool]:
        """Queue a chunk for storing; the future says whether it was stored (never raises).
        `ready`, when given, runs on the worker before the bytes are read (it waits for the
        copy that fills them, e.g. out of a GPU, without blocking the caller)."""
        store, attempts = self.store, self.attempts

        def run() -> bool:
            if ready is not None:
                ready()
            return store.put(chunk, payload, tier=tier, attempts=attempts, form=form)

        return self._write("spill", chunk.id, run)

    def demote(self, chunk: bytes, to: str | None = None, form: str | None = None) -> Future[bool]:
        """Queue `store.demote(chunk, to, form)`; the future says whether the chunk moved."""
        store = self.store
        return self._write("demote", chunk, lambda: store.demote(chunk, to, form))

    def delete(self, chunk: bytes) -> Future[bool]:
        """Queue `store.delete(chunk)`; the future resolves True once it is gone."""
        store = self.store

        def run() -> bool:
            store.delete(chunk)
            return True

        return self._write("delete", chunk, run)

    def _write(self, kind: str, chunk: bytes, run: Callable[[], bool]) -> Future[bool]:
        future: Future[bool] = Future()
        with self._lock:
            queued = not self._closed
            if queued:
                try:
                    self._spills.put_nowait(_WriteJob(kind, chunk, run, future))
                except queue.Full:
                    queued = False
        if queued:
            self._count(f"{kind}s")
        else:
            self._count(f"{kind}s_dropped")
            future.set_running_or_notify_cancel()
            future.set_result(False)
        return future

    def prefetch(
        self, chunks: Sequence[bytes], then: Callable[[Payload], Any] | None = None
    ) -> Prefetch:
        """Queue loads of these chunk ids, each result passed through `then` on the worker;
        chunks that find the queue full resolve to None."""
        handle = Prefetch(len(chunks), then)
        for index, chunk in enumerate(chunks):
            with self._lock:
                queued = not self._closed
                if queued:
                    try:
                        self._prefetches.put_nowait(_PrefetchJob(handle, index, chunk))
                    except queue.Full:
                        queued = False
            if queued:
                self._count("prefetches")
            else:
                self._count("prefetches_dropped")
                handle._resolve(index, None)
        return handle

    def close(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the workers after finishing (drain) or cancelling what is queued."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not drain:
            for jobs in (self._spills, self._prefetches):
                while True:
                    try:
                        job = jobs.get_nowait()
                    except queue.Empty:
                        break
                    if job is not None:
                        job.cancel()
        for _, jobs in self._workers:
            jobs.put(None)  # one stop mark per worker, behind whatever is still queued
        for worker, _ in self._workers:
            worker.join(timeout)

    # -- workers -------------------------------------------------------------------------

    def _run_spills(self) -> None:
        while (job := self._spills.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue  # the caller cancelled it while it waited
            ok = False
            try:
                ok = job.run()
            except Exception:  # a worker must outlive any one job, and resolve it
                log.exception("%s of chunk %s failed", job.kind, job.chunk.hex()[:16])
            if not ok:
                self._count(f"{job.kind}s_failed")
            job.future.set_result(ok)

    def _run_prefetches(self) -> None:
        while (job := self._prefetches.get()) is not None:
            result = None
            try:
                if not job.handle.cancelled:
                    payload = self.store.promote(job.chunk, attempts=self.attempts)
                    then = job.handle.then
                    result = payload if payload is None or then is None else then(payload)
            except Exception:  # see _run_spills
                log.exception("prefetch of chunk %s failed", job.chunk.hex()[:16])
            if result is None:
                self._count("prefetch_misses")
            job.handle._resolve(job.index, result)

    def _count(self, name: str) -> None:
        with self._counts_lock:
            self.counts[name] += 1


@dataclass(frozen=True, slots=True)
class _WriteJob:
    kind: str  # spill, demote, delete: names its counters
    chunk: bytes
    run: Callable[[], bool]
    future: Future[bool]

    def cancel(self) -> None:
        if self.future.set_running_or_notify_cancel():
            self.future.set_result(False)


@dataclass(frozen=True, slots=True)
class _PrefetchJob:
    handle: Prefetch
    index: int
    chunk: bytes

    def cancel(self) -> None:
        self.handle._resolve(self.index, None)
