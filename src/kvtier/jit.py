"""numba's `njit` as kvtier compiles its kernels (compress/fused.py, policy/kernels.py): eagerly,
for the signature given, without the GIL, and cached on disk (next to the kernel's module, or
numba's per-user directory when that is not writable). Where numba finds no writable directory
for a cache (a read-only install and no writable home) each process compiles anew, as the
first one would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba


def compiled(signature: str, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    def compile_(func: Callable[..., Any]) -> Any:
        try:
            return numba.njit(signature, nogil=True, cache=True, **options)(func)
        except RuntimeError:  # numba: "cannot cache function ...: no locator available"
            return numba.njit(signature, nogil=True, **options)(func)

    return compile_
