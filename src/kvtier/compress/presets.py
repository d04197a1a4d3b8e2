"""Named pipelines for the deployment scenarios of docs/compression.md (rationale there).

Each value is a method string for `parse_method`, so a preset is also what a user could type.
The `auto` preset is not one of them: it picks one of these (or none) from an observed
workload, see `auto.py`; kvtier.toml names a preset in its `[compression]` table.
"""

from __future__ import annotations

PRESETS: dict[str, str] = {
    # One long document and a question at its end: query-aware eviction after the question.
    "long_single_request": "snapkv:0.5",
    # Many concurrent requests: halve what each holds, query-aware, then 8-bit the rest.
    "datacenter_throughput": "snapkv:0.5+kivi8",
    # Fixed small memory, endless sessions: constant-size cache, 4-bit.
    "edge_device": "streaming_llm@1024+kivi4",
    # Later turns reuse the earlier turns' blocks (cached before compression): mild eviction.
    "multi_turn_chat": "tova:0.25",
    # Every token may matter: only near-lossless 8-bit quantization.
    "accuracy_critical_reasoning": "kivi8",
    # Identifiers recur far apart: mild, query-aware eviction only.
    "long_code": "snapkv:0.25",
}
