"""Error answers in the format of the API a path belongs to, for errors raised outside an
API's own handlers (authentication, Host and origin checks, request bounds, validation,
unexpected exceptions).

Formats, from each API's reference:

- OpenAI (``/v1/*``): ``{"error": {"message", "type", "param", "code"}}``;
- Anthropic (``/v1/messages*``): ``{"type": "error", "error": {"type", "message"}}``;
- Ollama (``/api/*``): ``{"error": message}``;
- the node-to-node endpoints (``/internal/*``): ``{"detail": message}`` (what every node
  version reads from a peer);
- everything else (the cluster API ``/cluster/*``, ``/health``, ``/metrics``, the dashboard,
  unknown paths): OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from starlette.responses import JSONResponse


class API(enum.Enum):
    """Which API a request path belongs to (decides the error body's shape)."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"
    OLLAMA = "ollama"
    INTERNAL = "internal"  # node to node: /internal/*
    CLUSTER = "cluster"  # the cluster API, /health, /metrics, the dashboard, unknown paths


def api_of(path: str) -> API:
    """The API that serves ``path`` (an HTTP request path such as ``/v1/messages``)."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return API.ANTHROPIC
    if path.startswith("/v1/"):
        return API.OPENAI
    if path.startswith("/api/"):
        return API.OLLAMA
    if path.startswith("/internal/"):
        return API.INTERNAL
    return API.CLUSTER


# Error type names by HTTP status, as OpenAI and Anthropic name them.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    421: "invalid_request_error",
    429: "rate_limit_exceeded",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    421: "invalid_request_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def error_body(api: API, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON error body ``api`` answers an HTTP ``status`` with (see the module doc);
    ``param`` names the offending request field, ``code`` a machine-readable reason."""
    if api in (API.OPENAI, API.CLUSTER):
        kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    if api is API.ANTHROPIC:
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    if api is API.OLLAMA:
        return {"error": message}
    return {"detail": message}


def error_message(body: object) -> str | None:
    """The message in an error body of any of the shapes above (for clients of the
    cluster API: the CLI, the launcher, the benchmark), or None when it has none."""
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict) and error.get("message") is not None:
        return str(error["message"])
    if isinstance(error, str):
        return error
    detail = body.get("detail")
    return None if detail is None else str(detail)


def error_response(
    path: str,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """A JSON error answer for a request to ``path``, in that path's API format."""
    return JSONResponse(
        status_code=status, content=error_body(api_of(path), status, message, param, code), headers=headers
    )
