"""Fault a CPU tensor's pages in on a background thread, without changing a byte of it.

Why: the device KV pool on CPU is an anonymous memory map (`kv_pool.zeros`) that the kernel
fills on first write. Until every block has been written once, a restore into a block no
request has used yet pays the page faults and the kernel's zeroing inside the copy: the
first host restore after start-up took 2.4-2.6x as long as later ones
(benchmarks/records/2026-12-01-kv-pool-prefault.md). Touching the pool while the engine
starts costs about 1 s per GiB of start-up latency on this VM; doing it here costs none, and
the pages are resident before the first restores come.

How: `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+) faults the pages in writable the way a
write would, but does not write: a page already there is left alone and a new one is the
zero page the first write would have found anyway, so the contents never change and the
engine may write to the pool at the same time (the kernel serialises the two faults of one
page). Writing zeros from Python instead would race with the engine's writes. The call goes
through ctypes, which releases the GIL, so the engine's thread runs Python while the kernel
works; it runs in slices, so `close` stops it within one slice, on a thread at the lowest
CPU priority. Where the call is not supported (older kernels, other systems) the pages
simply stay on demand, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module does not name it before 3.13
SLICE_BYTES = 32 << 20  # one madvise call: a few ms of kernel work, then a stop check
_LOWEST_PRIORITY = 19


def _madvise() -> Callable[[int, int, int], int] | None:
    if sys.platform != "linux":
        return None
    call = ctypes.CDLL(None, use_errno=True).madvise
    call.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    call.restype = ctypes.c_int
    return call


def page_span(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, length) of the whole pages inside `tensor`'s bytes (length 0: none)."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // page) * page
    return first, max(0, end // page * page - first)


class Prefaulter:
    """Populates the CPU tensors' pages on a daemon thread started at construction.

    `outcome` says how it ended: "done", "stopped" (closed first), "unsupported" (no
    MADV_POPULATE_WRITE here: pages stay on demand) or "failed: ..." (an errno); None while
    it runs. Tensors on other devices are skipped. The thread holds the tensors until it
    ends, so their memory cannot be unmapped under it."""

    def __init__(self, tensors: Sequence[torch.Tensor], slice_bytes: int = SLICE_BYTES) -> None:
        self.outcome: str | None = None
        self._spans = [page_span(t) for t in tensors if t.device.type == "cpu"]
        self._tensors = list(tensors)
        self._slice = slice_bytes
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-prefault", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the thread has ended (whatever its outcome)."""
        return self._done.wait(timeout)

    def close(self) -> None:
        """Stop after the slice under way and wait for the thread."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            self.outcome = self._populate()
        finally:
            self._tensors.clear()
            self._done.set()

    def _populate(self) -> str:
        madvise = _madvise()
        if madvise is None:
            return "unsupported"
        # On Linux a thread id names one thread: this lowers this thread's priority only.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _LOWEST_PRIORITY)
        for address, length in self._spans:
            for offset in range(0, length, self._slice):
                if self._stop.is_set():
                    return "stopped"
                size = min(self._slice, length - offset)
                if madvise(address + offset, size, MADV_POPULATE_WRITE) != 0:
                    code = ctypes.get_errno()
                    if code == errno.EINVAL:  # the kernel does not know the advice
                        return "unsupported"
                    log.warning("prefaulting the KV pool stopped: %s", os.strerror(code))
                    return f"failed: {errno.errorcode.get(code, code)}"
        return "done"
