"""``GET /``: the web dashboard (``static/dashboard.html``), never inside another site's
frame."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

DASHBOARD = Path(__file__).resolve().parent / "static" / "dashboard.html"


def router() -> APIRouter:
    """The dashboard's route."""
    routes = APIRouter()

    @routes.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def dashboard():
        """The web dashboard: nodes, instances and their shards, placing, a chat panel."""
        # Not inside another site's frame: a framed dashboard is same-origin to the node,
        # and a click there (say on Delete) would be the node's own page's (clickjacking).
        return FileResponse(
            DASHBOARD,
            media_type="text/html",
            headers={"X-Frame-Options": "DENY", "Content-Security-Policy": "frame-ancestors 'none'"},
        )

    return routes
