"""The words every layer uses for where KV lives and in what form, defined once.

Tiers, fastest first: `device` (the engine's pool), `host` (DRAM), `disk`, `remote`
(Redis). A prompt token's source is a tier or `recomputed`. Forms, most precise first:
`full` (the pool's dtype, bit for bit), `int8`, `int4` (kvtier.cache.forms).
"""

from __future__ import annotations

from typing import Final

DEVICE: Final = "device"
HOST: Final = "host"
DISK: Final = "disk"
REMOTE: Final = "remote"
TIERS: Final = (DEVICE, HOST, DISK, REMOTE)
LOWER_TIERS: Final = TIERS[1:]  # what a store below the device pool may hold
TIER_RANK: Final = {name: rank for rank, name in enumerate(TIERS)}

RECOMPUTED: Final = "recomputed"
SOURCES: Final = (*TIERS, RECOMPUTED)  # where a prompt token's KV came from

FULL: Final = "full"
INT8: Final = "int8"
INT4: Final = "int4"
FORM_PRECISION: Final = {FULL: 2, INT8: 1, INT4: 0}  # higher is more precise
FORMS: Final = tuple(FORM_PRECISION)


def lossiest(*forms: str) -> str:
    """The least precise of `forms` (FULL when none are given)."""
    return min(forms, key=FORM_PRECISION.__getitem__, default=FULL)


# The disk tier's implementations (`tiers.factory.DISK_BACKENDS` builds them), named here so
# settings can be checked without importing the backends.
DISK_BACKEND_NAMES = ("segments", "mmap")
