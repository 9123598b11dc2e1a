"""What the server allows: where it listens, who may call it (an API key, browser origins), how
many may wait and how large a body may be. Off this machine only with a key (or `--insecure`)."""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from localspec.apps.serve.requests import error_response
from localspec.base.errors import LocalspecError


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    """When set, every endpoint but /health needs `Authorization: Bearer <key>`."""
    insecure: bool = False
    """Allow a non-local host without an API key."""
    cors: tuple[str, ...] = ()
    """Browser origins allowed to call the API; none by default."""
    queue: int = 8
    """Requests that may wait while one generates; the next gets 429."""
    max_body: int = 4 << 20
    """Largest request body in bytes (413 beyond)."""
    keep_alive: float | None = None
    """Idle seconds after which the model is unloaded (the next request loads it again); None: never."""
    exit_when_idle: bool = False
    """Stop the server when the keep-alive unloads the model (a resident engine `run --daemon` started)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise LocalspecError(f"--port must be between 0 and 65535, got {self.port}")
        if self.queue < 0:
            raise LocalspecError(f"--queue must be 0 or more, got {self.queue}")
        if not is_local(self.host) and not self.api_key and not self.insecure:
            raise LocalspecError(
                f"refusing to listen on {self.host} without --api-key: anyone who can reach this machine could use "
                "the model; pass --api-key KEY (or set LOCALSPEC_API_KEY), or --insecure"
            )


def is_local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False


def has_key(authorization: str, key: str) -> bool:
    """Whether an Authorization header is `Bearer <key>` (compared in constant time)."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


class RequireKey:
    """Bearer-key check for every path but /health (plain ASGI, so streaming is untouched)."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send) -> None:
        # /localspec/ is the resident engine's own, behind its own key (apps/serve/resident.py)
        if scope["type"] == "http" and scope["path"] != "/health" and not scope["path"].startswith("/localspec/"):
            if not has_key(Headers(scope=scope).get("authorization", ""), self.key):
                response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def middleware(config: ServeConfig) -> list[Middleware]:
    """CORS and the key check, as `config` asks."""
    stack = []
    if config.cors:  # outermost, so a browser's preflight is answered without a key
        stack.append(Middleware(CORSMiddleware, allow_origins=list(config.cors), allow_methods=["GET", "POST"],
                                allow_headers=["Authorization", "Content-Type"]))
    if config.api_key:
        stack.append(Middleware(RequireKey, key=config.api_key))
    return stack
