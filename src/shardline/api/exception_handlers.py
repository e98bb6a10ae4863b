"""The app's answers to exceptions its routes leave unhandled, each in the format of the
API the path belongs to (:mod:`shardline.api.errors`): a body that does not validate
(400), Starlette's HTTP errors (a 405 with every method the path takes in ``Allow``), a
full queue (429 with ``Retry-After``), a client gone before its request was read (499,
which nobody reads), and anything else (500, the traceback logged)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from shardline.api import errors
from shardline.api.http_extras import SCOPE_KEY, allowed_methods
from shardline.node.queue_bound import QueueFullError

log = logging.getLogger(__name__)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The message and parameter of a 400 for a body that does not validate: its first
    error, in plain words."""
    problems = exc.errors()
    if not problems:
        return "invalid request", None
    first = problems[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") == "value_error" and param is None:  # a model validator's own words
        return str(first.get("msg")).removeprefix("Value error, "), None
    return f"{param or 'body'}: {first.get('msg')}", param


def add_exception_handlers(app: FastAPI) -> None:
    """Install the handlers on ``app`` (a 405's ``Allow`` reads its routes)."""

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return errors.error_response(request.url.path, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # every method the path takes, not the first route's
            headers["Allow"] = allowed_methods(app.router.routes, request.scope) or headers.get("Allow", "")
        return errors.error_response(request.url.path, exc.status_code, str(exc.detail), headers=headers)

    @app.exception_handler(QueueFullError)
    async def on_queue_full(request: Request, exc: QueueFullError):
        return errors.error_response(
            request.url.path, 429, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after_s)}
        )

    @app.exception_handler(ClientDisconnect)
    async def on_client_gone(request: Request, exc: ClientDisconnect):
        """A client that left before its request was read: one line, not a traceback."""
        log.info("%s %s: the client disconnected before its request was read", request.method, request.url.path)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        """A JSON 500 in the API's format; the traceback goes to the log (uvicorn's)."""
        log.error("%s %s failed: %r", request.method, request.url.path, exc)
        # Answered outside the middleware (Starlette's ServerErrorMiddleware): its id here.
        rid = request.scope.get(SCOPE_KEY)
        return errors.error_response(
            request.url.path,
            500,
            "internal error: the node's log has the details",
            headers={"X-Request-Id": rid} if rid else None,
        )
