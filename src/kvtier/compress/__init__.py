"""KV compression: presses (token eviction, quantization, low rank) and pipelines of them.

`CompressionConfig` (a list of `PressSpec`) is what `EngineConfig.compression` takes;
`parse_method` turns CLI strings ("snapkv:0.5", "kivi4", "full") into one.
"""

from kvtier.compress.config import CompressionConfig, PressSpec
from kvtier.compress.registry import parse_method

__all__ = ["CompressionConfig", "PressSpec", "parse_method"]
