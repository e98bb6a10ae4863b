"""The node's HTTP server: :func:`create_app` composes the guards, the exception handlers
and a router for each thing the node serves (the public APIs, metrics, the dashboard,
``/health``, the cluster API and the node-to-node ``/internal`` routes)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from shardline.api import anthropic, cluster, completions, dashboard, health, metrics, ollama, openai, responses
from shardline.api.bounds import DEFAULT_MAX_BODY_BYTES, RequestBoundsMiddleware
from shardline.api.exception_handlers import add_exception_handlers
from shardline.api.heartbeat import HEARTBEAT_S
from shardline.api.http_extras import RequestIdMiddleware
from shardline.api.http_guard import GuardConfig, GuardMiddleware, SignatureMiddleware, check_key, check_place
from shardline.api.internal import link_probe, peer_server, transfer
from shardline.api.keep_alive import KeepAlive
from shardline.api.response_store import ResponseStore
from shardline.node.node import Node


def create_app(
    node: Node, guard: GuardConfig, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, heartbeat_s: float = HEARTBEAT_S
) -> FastAPI:
    """The node's FastAPI app. ``guard``: the API key, Host allow-list and CORS origins
    (:mod:`shardline.api.http_guard`); request bodies over ``max_body_bytes`` are refused
    (413, :mod:`shardline.api.bounds`); streams send their API's keep-alive after
    ``heartbeat_s`` seconds with nothing else to send. The node starts and stops with the
    app (its lifespan)."""
    keep_alive = KeepAlive()
    app = FastAPI(title="shardline", lifespan=_lifespan(node, keep_alive))
    add_exception_handlers(app)
    add_guards(app, guard, node.signing_key, max_body_bytes)
    request_metrics = metrics.RequestMetrics(node)
    stored = ResponseStore()  # the Responses API's, this node's and those its peers share
    for router in (
        openai.router(node, request_metrics, heartbeat_s),
        completions.router(node, request_metrics, heartbeat_s),
        responses.router(node, request_metrics, stored, heartbeat_s=heartbeat_s),
        anthropic.router(node, request_metrics, heartbeat_s),
        ollama.router(node, request_metrics, keep_alive, heartbeat_s),
        metrics.router(request_metrics),
        link_probe.router(),
        transfer.router(node.store),
        dashboard.router(),
        health.router(node),
        cluster.router(node),
        peer_server.router(node, stored),
    ):
        app.include_router(router)
    return app


def _lifespan(node: Node, keep_alive: KeepAlive):
    """The app's lifespan: the node started, and Ollama's ``keep_alive`` expiry run, while
    the app serves."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await node.start()
        expiry = asyncio.create_task(keep_alive.run(node))
        try:
            yield
        finally:
            expiry.cancel()
            await node.stop()

    return lifespan


def add_guards(app: FastAPI, guard: GuardConfig, signing_key: bytes, max_body_bytes: int) -> None:
    """The middlewares every request passes before a route. The last added runs first:
    Host and origin (a disallowed origin's preflight too), CORS (preflight and headers
    for allowed origins, refusals included), the body bounds, node signatures (which read
    a body within them), the API key."""
    app.add_middleware(GuardMiddleware, config=guard, decide=check_key)
    app.add_middleware(SignatureMiddleware, key=signing_key, names=guard.allowed_hosts)
    app.add_middleware(RequestBoundsMiddleware, max_body_bytes=max_body_bytes)
    if guard.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=sorted(guard.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["Retry-After", "X-Request-Id"],
            max_age=600,
        )
    app.add_middleware(GuardMiddleware, config=guard, decide=check_place)
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer carries the id
