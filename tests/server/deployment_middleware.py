"""Middlewares for ``--middleware`` tests, imported by path like a user's would be."""
from __future__ import annotations


class TagMiddleware:
    """A pure ASGI middleware class: adds ``x-tag: class`` to every response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        async def tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), (b"x-tag", b"class")])
            await send(message)
        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


async def tag_function(request, call_next):
    """An ``http`` middleware function: adds ``x-tag-function: yes``."""
    response = await call_next(request)
    response.headers["x-tag-function"] = "yes"
    return response
