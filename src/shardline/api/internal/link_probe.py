"""The routes :func:`shardline.node.link_probe.measure_link` times, which every node
serves: ``GET /internal/ping`` and ``POST /internal/echo-bytes``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from shardline.node.link_probe import UPLOAD_PATH


def router() -> APIRouter:
    """The link probe's two routes:

    - ``GET /internal/ping`` -> ``{"ok": true}``
    - ``POST /internal/echo-bytes``: reads the request body as it arrives, discards it,
      and returns ``{"bytes": n}``, the number of bytes read.
    """
    routes = APIRouter()

    @routes.get("/internal/ping")
    async def ping() -> dict:
        return {"ok": True}

    @routes.post(UPLOAD_PATH)
    async def echo_bytes(request: Request) -> dict:
        n = 0
        async for chunk in request.stream():
            n += len(chunk)
        return {"bytes": n}

    return routes
