"""Small HTTP conventions every answer of the node follows: ``X-Request-Id`` echoed (or
made) on each response, a 503 says when to retry (``Retry-After``), and a 405's ``Allow``
header lists every method the path takes.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "X-Request-Id"
UNAVAILABLE_RETRY_S = 2
"""``Retry-After`` of a 503 that gives none (a model loading, placed again, no coordinator
yet): seconds, about a re-placement's poll and load on a small model."""
MAX_REQUEST_ID_CHARS = 128
SCOPE_KEY = "shardline.request_id"
"""Where the middleware leaves the request's id in the ASGI scope (for handlers that answer
outside it, such as the app's handler of unexpected exceptions)."""


def request_id(given: str | None, new: Callable[[], str] = lambda: uuid.uuid4().hex) -> str:
    """The id a response carries: the client's ``X-Request-Id`` when it is 1 to
    :data:`MAX_REQUEST_ID_CHARS` printable ASCII characters (space to ``~``) without
    leading or trailing spaces, else a new one (``new()``, by default a uuid4's 32 hex
    digits), so that a header a client made cannot inject anything into logs or answers."""
    if given and len(given) <= MAX_REQUEST_ID_CHARS and given == given.strip() and all(" " <= c <= "~" for c in given):
        return given
    return new()


class RequestIdMiddleware:
    """Echo the request's ``X-Request-Id`` (or a new one, see :func:`request_id`) on every
    HTTP response, and leave it in the scope under :data:`SCOPE_KEY`; add
    ``Retry-After: UNAVAILABLE_RETRY_S`` to a 503 without one (RFC 9110 section 10.2.3)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"x-request-id"), None)
        rid = request_id(given)
        scope[SCOPE_KEY] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", rid.encode("latin-1")))
                if message.get("status") == 503 and not any(k.lower() == b"retry-after" for k, _ in headers):
                    headers.append((b"retry-after", str(UNAVAILABLE_RETRY_S).encode()))
                message = dict(message, headers=headers)
            await send(message)

        await self.app(scope, receive, send_with_id)


def allow_value(method_sets: Iterable[Iterable[str]]) -> str:
    """An ``Allow`` header's value: the union of the methods of every route that matches a
    path (RFC 9110 section 10.2.1), sorted, comma-separated."""
    return ", ".join(sorted({m.upper() for methods in method_sets for m in methods}))


def allowed_methods(routes: Iterable, scope: Scope) -> str:
    """``Allow`` for a request that met a 405: the methods of every route of ``routes``
    (Starlette's, and those of the routers included among them) whose path matches the
    request's. Starlette's own header names only the first such route's methods (``GET``
    for a path served by a GET and a POST route)."""
    sets = []
    for route in _flattened(routes):
        methods = getattr(route, "methods", None)
        if methods and route.matches(scope)[0] != Match.NONE:
            sets.append(methods)
    return allow_value(sets)


def _flattened(routes: Iterable) -> Iterator:
    """``routes`` with each included router replaced by its own routes (FastAPI 0.165
    keeps a router included without a prefix, as the app's are, as one route that holds
    it: ``original_router``)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is None:
            yield route
        else:
            yield from _flattened(included.routes)
