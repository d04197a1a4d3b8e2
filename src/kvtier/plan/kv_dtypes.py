"""Number formats a KV cache (or the weights) can be stored in, and what one element costs.

Integer formats are group-quantized: every `group_size` consecutive elements share one fp16 scale
and one fp16 zero point (asymmetric quantization, as in KIVI, Liu et al. 2024,
arXiv:2402.02750), so

    bytes_per_element = bits / 8 + (2 + 2) / group_size

INT4 at group 32 is 0.5 + 0.125 = 0.625 bytes: the metadata adds 25% to the 4-bit payload.
fp8 (e4m3) keeps one scale per tensor (vLLM's `kv_cache_dtype="fp8"`), which is a few bytes per
layer and counted as zero here.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from kvtier.errors import KvtierError

DEFAULT_GROUP_SIZE = 32
SCALE_BYTES = 2  # fp16 scale per group
ZERO_POINT_BYTES = 2  # fp16 zero point per group


@dataclass(frozen=True)
class KVDtype:
    name: str
    bits: int
    grouped: bool  # integer formats carry a scale and zero point per group

    def bytes_per_element(self, group_size: int = DEFAULT_GROUP_SIZE) -> Fraction:
        """Exact bytes per stored element, group metadata included."""
        payload = Fraction(self.bits, 8)
        if not self.grouped:
            return payload
        if group_size <= 0:
            raise KvtierError(f"group size must be a positive number of elements, not {group_size}")
        return payload + Fraction(SCALE_BYTES + ZERO_POINT_BYTES, group_size)


KV_DTYPES: dict[str, KVDtype] = {
    d.name: d
    for d in (
        KVDtype("fp32", 32, grouped=False),
        KVDtype("bf16", 16, grouped=False),
        KVDtype("fp16", 16, grouped=False),
        KVDtype("fp8", 8, grouped=False),
        KVDtype("int8", 8, grouped=True),
        KVDtype("int4", 4, grouped=True),
        KVDtype("int2", 2, grouped=True),
    )
}


# formats weights are stored in: int2 weights are a research topic, not a serving choice
WEIGHT_DTYPES = tuple(name for name in KV_DTYPES if name != "int2")


def get_kv_dtype(name: str | KVDtype) -> KVDtype:
    if isinstance(name, KVDtype):
        return name
    try:
        return KV_DTYPES[name.lower()]
    except KeyError:
        raise KvtierError(f"unknown dtype {name!r}; choose one of {', '.join(KV_DTYPES)}") from None
