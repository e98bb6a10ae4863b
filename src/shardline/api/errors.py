"""Error answers in the format of the API a path belongs to, for errors raised outside an
API's own handlers (authentication, Host and origin checks, request bounds, validation,
unexpected exceptions).

Formats, from each API's reference:

- OpenAI (``/v1/*``): ``{"error": {"message", "type", "param", "code"}}``;
- Anthropic (``/v1/messages*``): ``{"type": "error", "error": {"type", "message"}}``;
- Ollama (``/api/*``): ``{"error": message}``;
- everything else (cluster API, ``/internal``, ``/health``): ``{"detail": message}``.
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
    CLUSTER = "cluster"  # the cluster API, /internal, /health, /metrics, the dashboard


def api_of(path: str) -> API:
    """The API that serves ``path`` (an HTTP request path such as ``/v1/messages``)."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return API.ANTHROPIC
    if path.startswith("/v1/"):
        return API.OPENAI
    if path.startswith("/api/"):
        return API.OLLAMA
    return API.CLUSTER


# Error type names by HTTP status, as OpenAI and Anthropic name them.
_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
                 404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                 421: "invalid_request_error", 429: "rate_limit_exceeded"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    421: "invalid_request_error", 429: "rate_limit_error", 529: "overloaded_error"}


def error_body(api: API, status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """The JSON error body ``api`` answers an HTTP ``status`` with (see the module doc)."""
    if api is API.OPENAI:
        kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    if api is API.ANTHROPIC:
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    if api is API.OLLAMA:
        return {"error": message}
    return {"detail": message}


def error_response(path: str, status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """A JSON error answer for a request to ``path``, in that path's API format."""
    return JSONResponse(status_code=status, content=error_body(api_of(path), status, message, param, code),
                        headers=headers)
