"""Who is calling: the API-key dependencies the routes declare.

`Auth(config).caller` names the tenant behind a request's bearer key (the OpenAI API);
`admin` and `metrics_reader` guard the admin API and /metrics with their own keys, or
with loopback-only access where no key was given.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from kvtier.server.api_errors import APIError
from kvtier.server.tenants import ANONYMOUS

if TYPE_CHECKING:
    from kvtier.settings.server import ServerConfig


@dataclass(frozen=True)
class Caller:
    tenant: str  # name used in metrics and accounting
    salt: str | None  # what salts the block keys (None: the anonymous tenant)


class Auth:
    """The dependencies that check a request's credentials against one `ServerConfig`.

    Dependencies are async: FastAPI would run a plain `def` in a worker thread, one more
    hand-off (and GIL wait behind the step thread) before every request reaches the engine.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config

    async def caller(self, request: Request) -> Caller:
        if self.config.anonymous:
            return Caller(ANONYMOUS, None)
        key = bearer(request)
        if key is None:
            raise APIError(
                401,
                "missing API key: send 'Authorization: Bearer <api key>'",
                "authentication_error",
                code="missing_api_key",
            )
        tenant = self.config.tenant_for_key(key)
        if tenant is None:
            raise APIError(401, "invalid API key", "authentication_error", code="invalid_api_key")
        return Caller(tenant.name, tenant.name)

    async def admin(self, request: Request) -> None:
        guard(request, "the admin API", self.config.admin_key, "--admin-key")

    async def metrics_reader(self, request: Request) -> None:
        guard(request, "/metrics", self.config.metrics_key, "--metrics-key")


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(
            401,
            "Authorization header must be 'Bearer <api key>'",
            "authentication_error",
            code="invalid_api_key",
        )
    return token.strip()


def guard(request: Request, what: str, key: str | None, flag: str) -> None:
    """With a key configured, the bearer must be it; without, the client must be local."""
    if key is None:
        if not is_loopback(request):
            raise APIError(
                403,
                f"{what} answers loopback clients only; start the server with {flag} "
                "to reach it from elsewhere",
                "permission_error",
                code="loopback_only",
            )
        return
    given = bearer(request)
    if given is None or not consteq(given, key):
        raise APIError(
            401,
            f"{what} needs the key given by {flag}",
            "authentication_error",
            code="invalid_api_key",
        )


def is_loopback(request: Request) -> bool:
    # Behind a proxy on this host, uvicorn takes the address from X-Forwarded-For (it trusts
    # 127.0.0.1 by default): a proxied client counts as remote only if the proxy sets it.
    host = request.client.host if request.client else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def consteq(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
