"""A package's public names imported on first use (PEP 562), so that importing one light
module of the package (its settings, say) does not load torch, vLLM and every backend."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The package's module `__getattr__`: `exports` maps each name to the module holding it."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
