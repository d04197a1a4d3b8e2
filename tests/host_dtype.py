"""What `dtype = "auto"` runs on this host (bfloat16 on CUDA and on CPUs with AVX512_BF16 or AMX,
float32 elsewhere), and the embedded model's KV bytes in it: tests that size a pool in blocks
of the default engine size it with these."""

from __future__ import annotations

from kvtier.engine.config import EngineConfig

AUTO_DTYPE = EngineConfig().resolved_dtype()
# SmolLM2: 30 layers x K and V x 3 KV heads x head dim 64, 2 bytes a value in bfloat16
TOKEN_BYTES = 30 * 2 * 3 * 64 * (4 if AUTO_DTYPE == "float32" else 2)
BLOCK_BYTES = 16 * TOKEN_BYTES  # 16-token blocks, the engine's default
