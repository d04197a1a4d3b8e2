"""The block `kvtier serve` prints once it is ready: what runs, with what budgets, where."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.units import format_bytes

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine
    from kvtier.settings.server import ServerConfig


def startup_summary(engine: Engine, config: ServerConfig, address: str) -> str:
    pool = engine.block_pool
    block_bytes = engine.kv_pool.bytes_per_block
    lines = [
        f"kvtier serve: model {config.model_name} ({engine.model_dir}), "
        f"{engine.config.dtype}{' (deterministic)' if engine.config.deterministic else ''} "
        f"on {engine.device}, prefill attention by {engine.config.prefill_attention}",
        f"  device KV pool: {pool.num_blocks} blocks x {engine.config.block_size} tokens = "
        f"{format_bytes(pool.num_blocks * block_bytes)}",
        f"  tiers: {tier_line(engine)}",
        f"  policy: {policy_line(engine)}",
        f"  limits: {limits_line(engine, config)}",
        f"  listening on {address}",
    ]
    return "\n".join(lines)


def limits_line(engine: Engine, config: ServerConfig) -> str:
    per_tenant = ""
    if config.tenant_concurrency_limit < config.max_concurrent_requests:
        per_tenant = f" ({config.tenant_concurrency_limit} per tenant)"
    return (
        f"prompts up to {config.prompt_token_limit(engine.max_model_len):,} tokens; "
        f"{config.max_concurrent_requests} requests in flight{per_tenant}; "
        f"{config.max_connections} connections ({config.address_connection_limit} per address, "
        f"request head within {config.header_timeout_s:g} s)"
    )


def tier_line(engine: Engine) -> str:
    connector = engine.connector
    if connector is None:
        return "none (device only: KV that leaves the device is recomputed)"
    config = connector.config
    parts = []
    for name, tier in connector.store.tiers.items():
        text = f"{name} {format_bytes(tier.capacity_bytes)}"
        if name == "disk":
            persistent = "persistent" if getattr(tier, "persist", False) else "wiped at start"
            text += f" in {getattr(tier, 'directory', '?')} ({persistent}"
            text += ", sealed)" if config.encrypt else ")"
        elif name == "remote":
            text += f" at {without_password(getattr(tier, 'url', '?'))} "
            text += f"({config.remote_integrity()}"
            text += ", cluster)" if config.redis_cluster else ")"
        used = tier.used_bytes
        if used:
            text += f", {format_bytes(used)} recovered"
        parts.append(text)
    return "; ".join(parts) + f"; chunks of {config.chunk_tokens} tokens"


def policy_line(engine: Engine) -> str:
    connector = engine.connector
    if connector is None:
        return "none (no tiers to move KV to)"
    runner = connector.runner
    return f"{runner.policy_name} (decides every {runner.interval_s:g} s)"


def without_password(url: str) -> str:
    """The URL with any password replaced: the summary goes to logs."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
