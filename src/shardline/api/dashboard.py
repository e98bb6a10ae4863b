"""``GET /``: the web dashboard (``static/dashboard.html``), never inside another site's
frame; ``GET /favicon.svg`` and ``/favicon.ico``: its icon (``static/favicon.svg``)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC = Path(__file__).resolve().parent / "static"
DASHBOARD = STATIC / "dashboard.html"
FAVICON = STATIC / "favicon.svg"
ICON_MAX_AGE_S = 86400
"""How long a browser keeps the icon (a day): it asks for it with every page otherwise."""


def router() -> APIRouter:
    """The dashboard's routes: the page and its icon."""
    routes = APIRouter()

    @routes.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def dashboard():
        """The web dashboard: the cluster's topology, what each node holds, placing with a
        preview, a chat panel and the settings that connect a coding agent."""
        # Not inside another site's frame: a framed dashboard is same-origin to the node,
        # and a click there (say on Delete) would be the node's own page's (clickjacking).
        return FileResponse(
            DASHBOARD,
            media_type="text/html",
            headers={"X-Frame-Options": "DENY", "Content-Security-Policy": "frame-ancestors 'none'"},
        )

    @routes.api_route("/favicon.svg", methods=["GET", "HEAD"], include_in_schema=False)
    @routes.api_route("/favicon.ico", methods=["GET", "HEAD"], include_in_schema=False)
    async def favicon():
        """The dashboard's icon, an SVG (at ``/favicon.ico`` too: the path a browser asks
        for by itself, which would otherwise be a 404 in its console)."""
        return FileResponse(FAVICON, media_type="image/svg+xml", headers={"Cache-Control": f"max-age={ICON_MAX_AGE_S}"})

    return routes
