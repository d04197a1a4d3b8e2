"""ServerConfig: the `[server]` table of `kvtier serve`: tenants (API keys, quotas), limits
and names.

TOML (the `[server]` table of a kvtier config file)::

    [server]
    model_name = "smollm2"
    admin_key = "admin-secret"
    max_concurrent_requests = 64
    max_concurrent_requests_per_tenant = 16
    max_prompt_tokens = 4096
    max_body_bytes = 1048576
    metrics_key = "metrics-secret"   # none: /metrics only for loopback clients

    [server.tenants.acme]
    api_key = "sk-acme"
    device_quota_bytes = 67108864   # idle cached KV this tenant may keep on device

No tenant configured = one anonymous tenant (no key needed), for local use.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError
from kvtier.models.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS
from kvtier.setting_doc import check_choices, setting

DEFAULT_MODEL_NAME = "smollm2"
# Other ids the embedded model goes by: `kvtier plan`, `bench` and `simulate` call it
# smollm2-135m, so a client configured from them finds the server too.
DEFAULT_MODEL_ALIASES = ("smollm2-135m",)


@dataclass(frozen=True)
class TenantConfig:
    name: str
    api_key: str
    device_quota_bytes: int | None = None  # None: no quota


@dataclass
class ServerConfig:
    model_name: str = setting(
        DEFAULT_MODEL_NAME,
        help='the id clients send as `"model"`',
        kind="string",
    )
    tenants: dict[str, TenantConfig] = field(default_factory=dict)  # [server.tenants.NAME]
    admin_key: str | None = setting(
        None,
        help="bearer key of `/admin/*`",
        kind="string",
        default_text="none: loopback clients only",
        flag=True,
    )
    metrics_key: str | None = setting(
        None,
        help="bearer key of `/metrics`",
        kind="string",
        default_text="none: loopback clients only",
        flag=True,
    )
    max_concurrent_requests: int = setting(
        64, help="generation requests in flight; beyond: 429", kind="int", flag=True
    )
    # None: half of max_concurrent_requests (rounded up) with two or more tenants, so a flood
    # from one leaves the others room; all of it with one tenant or none.
    max_concurrent_requests_per_tenant: int | None = setting(
        None,
        help="one tenant's requests in flight; beyond: 429",
        kind="int",
        default_text="half of `max_concurrent_requests` (rounded up) with two or more "
        "tenants, else all",
        flag=True,
    )
    max_prompt_tokens: int | None = setting(
        None,
        help="longest prompt; beyond: 400 `context_length_exceeded`",
        kind="int",
        default_text="the model context less one token",
        flag=True,
    )
    max_body_bytes: int = setting(
        1 << 20, help="request body size; beyond: 413", kind="int", flag=True
    )
    max_tokens_default: int = setting(
        256, help="`max_tokens` when a request gives none", kind="int"
    )
    max_output_tokens: int | None = setting(
        None,
        help="largest `max_tokens`; beyond: 400",
        kind="int",
        default_text="up to the model context",
        flag=True,
    )
    graceful_shutdown_s: float = setting(
        30.0, help="how long in-flight streams may drain on shutdown", kind="number", flag=True
    )
    body_timeout_s: float = setting(
        10.0,
        help="a request body not in full by then: 408, connection closed",
        kind="number",
        flag=True,
    )
    # Bounds what a flood of slow clients holds: well above max_concurrent_requests, under a
    # 1024 fd limit.
    max_connections: int = setting(
        512,
        help="open connections, idle keep-alive ones included; a new one closes the longest "
        "idle, or gets 503 when all are busy",
        kind="int",
        flag=True,
    )
    max_connections_per_address: int | None = setting(
        None,
        help="connections one client address may hold",
        kind="int",
        default_text="a quarter of `max_connections`",
        flag=True,
    )
    keep_alive_timeout_s: int = setting(
        5, help="an idle keep-alive connection is closed after this", kind="int", flag=True
    )
    # Sockets that send nothing, or a byte now and then, do not hold a slot.
    header_timeout_s: float = setting(
        10.0,
        help="request line and headers not in by then (from the connection's opening, or a "
        "later request's first byte): connection closed",
        kind="number",
        flag=True,
    )
    api_docs: bool = setting(
        False, help="serve `/docs`, `/redoc` and `/openapi.json`", kind="bool", flag=True
    )
    tool_call_parser: str = setting(
        DEFAULT_TOOL_PARSER,
        help="how tool calls are read from a chat reply (the model's output format)",
        kind="string",
        choices=tuple(TOOL_PARSERS),
        flag=True,
    )

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise KvtierError("server.model_name must be a non-empty string")
        for name in (
            "max_concurrent_requests",
            "max_body_bytes",
            "max_tokens_default",
            "max_connections",
            "keep_alive_timeout_s",
        ):
            _positive_int(f"server.{name}", getattr(self, name))
        for name in (
            "max_prompt_tokens",
            "max_output_tokens",
            "max_concurrent_requests_per_tenant",
            "max_connections_per_address",
        ):
            if getattr(self, name) is not None:
                _positive_int(f"server.{name}", getattr(self, name))
        for name in ("graceful_shutdown_s", "body_timeout_s", "header_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise KvtierError(f"server.{name} must be a positive number, got {value!r}")
        check_choices(self, "server")
        if not isinstance(self.api_docs, bool):
            raise KvtierError(f"server.api_docs must be true or false, got {self.api_docs!r}")
        for name in ("admin_key", "metrics_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise KvtierError(f"server.{name} must be a non-empty string")
        for name in self.tenants:
            if not name or "/" in name:
                raise KvtierError(f"tenant name {name!r}: non-empty, without '/'")
        keys = [t.api_key for t in self.tenants.values()]
        if len(set(keys)) != len(keys):
            raise KvtierError("two tenants share an api_key; give each tenant its own")
        for name in ("admin_key", "metrics_key"):
            if getattr(self, name) is not None and getattr(self, name) in keys:
                raise KvtierError(f"{name} must differ from every tenant api_key")

    @property
    def model_names(self) -> tuple[str, ...]:
        """Ids a request may name: `model_name` first (the one listed and answered with)."""
        if self.model_name == DEFAULT_MODEL_NAME:
            return (self.model_name, *DEFAULT_MODEL_ALIASES)
        return (self.model_name,)

    def prompt_token_limit(self, max_model_len: int) -> int:
        """The longest prompt served: `max_prompt_tokens`, by default (and at most) the model
        context less the one token a reply needs."""
        context = max_model_len - 1
        return min(self.max_prompt_tokens or context, context)

    @property
    def tenant_concurrency_limit(self) -> int:
        """Generation requests one tenant may have in flight."""
        if self.max_concurrent_requests_per_tenant is not None:
            return min(self.max_concurrent_requests_per_tenant, self.max_concurrent_requests)
        if len(self.tenants) < 2:
            return self.max_concurrent_requests
        return -(-self.max_concurrent_requests // 2)

    @property
    def address_connection_limit(self) -> int:
        """Connections one client address may hold."""
        if self.max_connections_per_address is not None:
            return min(self.max_connections_per_address, self.max_connections)
        return max(1, self.max_connections // 4)

    @property
    def anonymous(self) -> bool:
        """No tenant configured: every request is served as one anonymous tenant."""
        return not self.tenants

    def tenant_for_key(self, api_key: str) -> TenantConfig | None:
        for tenant in self.tenants.values():
            if _consteq(tenant.api_key, api_key):
                return tenant
        return None

    @classmethod
    def from_mapping(cls, table: dict[str, Any]) -> ServerConfig:
        """Build from the `[server]` table of a TOML file; unknown keys are errors."""
        table = dict(table)
        tenants_table = table.pop("tenants", {}) or {}
        if not isinstance(tenants_table, dict):
            raise KvtierError("server.tenants must be a table of tables")
        tenants = {}
        for name, spec in tenants_table.items():
            if not isinstance(spec, dict):
                raise KvtierError(f"server.tenants.{name} must be a table")
            tenants[name] = tenant_from_mapping(name, spec)
        known = {
            "model_name",
            "admin_key",
            "metrics_key",
            "max_concurrent_requests",
            "max_concurrent_requests_per_tenant",
            "max_prompt_tokens",
            "max_body_bytes",
            "max_tokens_default",
            "max_output_tokens",
            "graceful_shutdown_s",
            "body_timeout_s",
            "max_connections",
            "max_connections_per_address",
            "keep_alive_timeout_s",
            "header_timeout_s",
            "api_docs",
            "tool_call_parser",
        }
        unknown = sorted(set(table) - known)
        if unknown:
            raise KvtierError(
                f"unknown server setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(tenants=tenants, **table)

    @classmethod
    def from_toml(cls, path: str | Path) -> ServerConfig:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise KvtierError(f"cannot read server config {path}: {exc}") from exc
        return cls.from_mapping(data.get("server", {}))


def tenant_from_mapping(name: str, spec: dict[str, Any]) -> TenantConfig:
    unknown = sorted(set(spec) - {"api_key", "device_quota_bytes"})
    if unknown:
        raise KvtierError(f"server.tenants.{name}: unknown key(s) {', '.join(unknown)}")
    api_key = spec.get("api_key")
    if not isinstance(api_key, str) or not api_key:
        raise KvtierError(f"server.tenants.{name}.api_key must be a non-empty string")
    quota = spec.get("device_quota_bytes")
    if quota is not None:
        _positive_int(f"server.tenants.{name}.device_quota_bytes", quota)
    return TenantConfig(name, api_key, quota)


def parse_tenant_flag(value: str) -> TenantConfig:
    """`NAME:API_KEY[:QUOTA_BYTES]` from the command line."""
    parts = value.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
        raise KvtierError(f"--tenant wants NAME:API_KEY[:QUOTA_BYTES], got {value!r}")
    quota = None
    if len(parts) == 3:
        try:
            quota = int(parts[2])
        except ValueError:
            msg = f"--tenant quota must be an integer of bytes, got {parts[2]!r}"
            raise KvtierError(msg) from None
        _positive_int("--tenant quota", quota)
    return TenantConfig(parts[0], parts[1], quota)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KvtierError(f"{name} must be a positive integer, got {value!r}")


def _consteq(a: str, b: str) -> bool:
    import hmac

    return hmac.compare_digest(a.encode(), b.encode())
