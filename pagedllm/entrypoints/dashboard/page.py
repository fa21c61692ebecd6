"""The dashboard page (``GET /dashboard``) shared by the server and the router: one HTML file with
its script and styles inlined from ``static/`` (shipped as package data: no CDN, works offline).

The page is public, like ``/docs``: it holds no data. Everything it shows comes from
``/v1/kv_snapshot`` and ``/v1/kv_events``, which need the API key when the server has one; the
page asks for the key, keeps it in the tab's ``sessionStorage`` and sends it as ``Authorization:
Bearer`` (it reads the event stream with ``fetch``, because ``EventSource`` cannot send headers).
"""
from __future__ import annotations

import functools
import json
from importlib import resources

from fastapi.responses import HTMLResponse

PAGE_PATH = "/dashboard"


@functools.cache
def _asset(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def render_page(title: str, panels: list[dict]) -> HTMLResponse:
    """The page with one panel per entry of ``panels``: ``{"name": shown, "base": URL prefix of
    that replica's /v1/kv_* routes, relative to the page}`` (``""`` on a server)."""
    config = json.dumps({"title": title, "panels": panels}).replace("</", "<\\/")
    html = (_asset("index.html").replace("{{title}}", _escape(title)).replace("{{style}}", _asset("dashboard.css"))
            .replace("{{config}}", config).replace("{{script}}", _asset("dashboard.js")))
    return HTMLResponse(html, headers={"Cache-Control": "no-store"})


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
