"""LayerLoader: one step's layered chunks read a layer at a time while the forward runs.

The layer-wise pipelined restore (`TiersConfig.restore_pipeline = "layer"`,
docs/tiers.md): a thread reads layer 0 of every chunk of the step, verifies each
against the layer's own checksum (`tiers.record`, layered records), and only then says layer
0 is ready; then layer 1, and so on. The forward waits in `wait(i)` before layer i's
attention reads the pool (`KVConnector.layer_ready`), so the new tokens' layers 0..i-1 are
computed while layers i.. are still being read. Nothing unverified is ever signalled as
ready: a layer that fails its check (or a tier that fails) marks its chunk failed; a layer
not ready by the deadline marks every chunk still loading failed (the forward then goes on
without it). `finish`, after the forward, stops and joins the thread and names the failed
chunks: the engine throws those requests' step away and they recompute from the failed
chunk's first block, which is why a chunk's bytes may be half written or unverified when the
forward reads them.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import NamedTuple

from kvtier.tiers.base import LayerRead, TierBackend
from kvtier.tiers.record import LayerCheck


class LayerJob(NamedTuple):
    """One chunk to fill a layer at a time: the check of its layered record in `tier`
    (`check.head`: the record's head), and the device blocks it fills (`blocks`: each
    block's bytes, in the chunk's order; anywhere in the pool)."""

    request_id: str
    first: int  # the request's first block this chunk fills
    tier: TierBackend
    key: bytes
    namespace: str
    check: LayerCheck
    blocks: list[memoryview]

    def slabs(self, layer: int, layers: int) -> list[memoryview]:
        """Where layer `layer` goes: its slice of each block, in block order."""
        step = len(self.blocks[0]) // layers
        at = layer * step
        return [block[at : at + step] for block in self.blocks]


class LayerLoader:
    def __init__(self, jobs: list[LayerJob], num_layers: int, deadline_s: float) -> None:
        self.jobs = jobs
        self.num_layers = num_layers
        self._deadline = time.monotonic() + deadline_s
        self._failed: set[int] = set()  # indices into jobs
        self._ready = 0  # layers 0..ready-1 are read and verified (or failed) for every job
        self._late = False  # the forward went on without a layer: every job is failed
        self._cancel = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvtier-layers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for layer in range(self.num_layers):
                by_tier: dict[TierBackend, list[int]] = defaultdict(list)
                for i, job in enumerate(self.jobs):
                    if i not in self._failed:
                        by_tier[job.tier].append(i)
                for tier, indices in by_tier.items():
                    if self._cancel:
                        return
                    reads = [
                        LayerRead(
                            job.key,
                            job.namespace,
                            job.check.head,
                            job.slabs(layer, self.num_layers),
                            job.check,
                        )
                        for job in (self.jobs[i] for i in indices)
                    ]
                    oks = tier.read_layer(reads, layer)
                    with self._cond:
                        self._failed.update(i for i, ok in zip(indices, oks, strict=True) if not ok)
                with self._cond:
                    self._ready = layer + 1
                    self._cond.notify_all()
        finally:
            with self._cond:
                if self._ready < self.num_layers:  # stopped early: nothing more comes
                    self._failed.update(range(len(self.jobs)))
                    self._ready = self.num_layers
                self._cond.notify_all()

    def wait(self, layer: int) -> None:
        """Return once layer `layer` of every job is verified or failed, or at the deadline
        (every job then counts as failed: its layer was not there when the forward read it)."""
        with self._cond:
            if self._ready > layer or self._late:
                return
            ok = self._cond.wait_for(
                lambda: self._ready > layer, timeout=max(0.0, self._deadline - time.monotonic())
            )
            if not ok:
                self._late = True

    def finish(self) -> tuple[list[LayerJob], bool]:
        """Stop and join the thread (a tier read in flight ends within its own timeout);
        the jobs that failed, and whether it was late. Nothing writes to the blocks after."""
        self._cancel = True
        self._thread.join()
        with self._cond:
            failed = set(range(len(self.jobs))) if self._late else self._failed
            return [self.jobs[i] for i in sorted(failed)], self._late
