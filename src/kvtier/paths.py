"""Where kvtier keeps derived files (converted models, calibration profiles)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$KVTIER_CACHE`, else `~/.cache/kvtier`; created on first use."""
    root = Path(os.environ.get("KVTIER_CACHE") or Path.home() / ".cache" / "kvtier").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root
