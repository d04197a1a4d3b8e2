"""kvtier as a vLLM KV connector: host / disk / Redis tiers, retention policies and restore
planning under vLLM's prefix cache (docs/vllm.md).

vLLM loads the class named in `kv_connector` from this module
(`kv_connector_module_path="kvtier.integrations.vllm"`). The names below import vLLM on
first use only, so the adapters beside them (settings, port, request view) load without it.
"""

from __future__ import annotations

from kvtier.lazy_exports import lazy_getattr

_EXPORTS = {
    "KvtierConnector": "kvtier.integrations.vllm.connector",
    "KvtierMetadata": "kvtier.integrations.vllm.connector",
    "EngineTiers": "kvtier.integrations.vllm.engine_tiers",
    "REGISTRY": "kvtier.integrations.vllm.engine_tiers",
}

__all__ = list(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
