"""The background step loop behind `Engine.stream`.

One daemon thread runs `engine.step()` while requests are in flight and sleeps otherwise, so
the asyncio event loop never blocks on the model. Outputs reach each stream's asyncio queue
through `Engine`'s dispatch; aborts from cancelled streams are queued here and applied by
this thread, so a cancelling coroutine never waits for a step to finish.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine

log = logging.getLogger(__name__)


class StepLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._wake = threading.Event()
        self._aborts: deque[str] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtier-step-loop", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def abort_soon(self, request_id: str) -> None:
        self._aborts.append(request_id)
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        # The intra-op thread count is per calling thread; match the engine's setting.
        torch.set_num_threads(self.engine.config.resolved_num_threads())
        while not self._closed:
            while self._aborts:
                self.engine.abort(self._aborts.popleft())
            if self.engine.has_unfinished_requests():
                try:
                    self.engine.step()
                except Exception:
                    # One request's failure ends that request inside `step`; reaching here
                    # means the whole batch failed (the forward pass, say). A dead loop would
                    # leave every stream waiting forever: end them all instead, and keep
                    # serving new requests. The client sees no exception text.
                    log.exception("engine step failed; ending every request in flight")
                    self.engine.fail_all("engine step failed (see the server log)")
            else:
                self._wake.wait()
                self._wake.clear()
