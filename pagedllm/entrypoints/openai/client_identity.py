"""Who sent a request, for the fairness rules that are per client rather than per request (today the
grammar compile queue: one client's many big schemas take one queue turn at a time, not one each).

The rule, first that applies:

1. ``key:<hash>`` - the API key, when the server checks keys (``--api-key``): a checked key cannot be
   forged, so it is the one identity a hostile client cannot multiply. Only a SHA-256 prefix of it
   is kept; the key itself is never stored or logged.
2. ``user:<hash>`` - OpenAI's ``user`` field, when the request has one (hashed too: it often names a
   person). It is self-declared, so it is trusted only where keys are not checked, e.g. behind a
   gateway that sets it; an open server facing hostile clients should check keys.
3. ``peer:<host>`` - the address of the connection (uvicorn puts a trusted proxy's
   ``X-Forwarded-For`` there: ``$FORWARDED_ALLOW_IPS``); the port is left out, it changes per connection.

A pure ASGI middleware reads the connection part (key or peer) once per HTTP request into a context
variable, which the handler's task inherits; ``client_id(user)`` then applies the rule where the
request body is known (``ServingBase.start``).
"""
from __future__ import annotations

import hashlib
from contextvars import ContextVar

# the connection's identity: "key:..." or "peer:..." (None outside an HTTP request)
_CONNECTION: ContextVar[str | None] = ContextVar("pagedllm_client_connection", default=None)
_BEARER = b"bearer "


def _hashed(kind: str, secret: str | bytes) -> str:
    data = secret.encode() if isinstance(secret, str) else secret
    return f"{kind}:{hashlib.sha256(data).hexdigest()[:16]}"


def connection_identity(scope: dict, keys_checked: bool) -> str:
    """``key:<hash>`` for a checked API key, else ``peer:<host>`` (``peer:unknown`` without one)."""
    if keys_checked:
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        if auth[:len(_BEARER)].lower() == _BEARER and len(auth) > len(_BEARER):
            return _hashed("key", auth[len(_BEARER):])
    client = scope.get("client")
    return f"peer:{client[0] if client else 'unknown'}"


def client_id(user: str | None) -> str | None:
    """The current request's client under the rule above (None outside an HTTP request: the engine
    then charges the request to itself)."""
    connection = _CONNECTION.get()
    if connection is None or connection.startswith("key:") or not user:
        return connection
    return _hashed("user", user)


class ClientIdentityMiddleware:
    """Sets the connection identity for the request's handler (pure ASGI: streaming and disconnects
    pass untouched). ``keys_checked``: the server refuses requests without a valid key, so a
    ``Bearer`` header that reaches a handler carries one."""

    def __init__(self, app, keys_checked: bool):
        self.app, self.keys_checked = app, keys_checked

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = _CONNECTION.set(connection_identity(scope, self.keys_checked))
        try:
            await self.app(scope, receive, send)
        finally:
            _CONNECTION.reset(token)
