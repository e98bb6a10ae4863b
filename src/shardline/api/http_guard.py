"""Who may use a node's HTTP server: node signatures on ``/internal``, the Host allow-list,
cross-origin refusal, and API keys.

Two plain ASGI middlewares (Starlette's ``BaseHTTPMiddleware`` hides a client's disconnect
from the endpoint, and an abandoned non-streamed request then ran on for seconds):

- :class:`SignatureMiddleware` checks a node's signature (:mod:`shardline.node.signing`) on
  every ``/internal`` request, and on any other request that carries one (a cluster-API
  request another node forwards to the coordinator), and signs its answers.
- :class:`GuardMiddleware` applies :func:`check`'s two halves, pure decisions over the
  request's facts. Outermost, :func:`check_place`: the Host header must name this node (DNS
  rebinding), an ``Origin`` other than the node's own must be one of ``--cors-origin``
  whatever the content type (a page elsewhere cannot drive the node from a browser). Inside
  the signature check, :func:`check_key`: with an API key every route but the public ones
  (:data:`PUBLIC_PATHS`) needs it, as ``Authorization: Bearer`` (OpenAI, Ollama) or
  ``x-api-key`` (Anthropic), unless a cluster member signed the request.

Allowed origins get their CORS headers and preflight answers from Starlette's
``CORSMiddleware`` (between the two, so a 401 carries them). Refusals are JSON in the path's API format
(:mod:`shardline.api.errors`).
"""

from __future__ import annotations

import hmac
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from shardline.api import errors
from shardline.node import signing

log = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/", "/favicon.svg", "/favicon.ico", "/health", "/metrics"})
"""Served without an API key: the dashboard page (it asks for the key) and its icon, the
health check and the Prometheus metrics, as vLLM and llama.cpp's server leave them open."""

MEMBER_SCOPE_KEY = "shardline.member"
"""Set in the ASGI scope of a request a cluster member signed."""

ANY = "*"


@dataclass(frozen=True)
class GuardConfig:
    """What a node allows.

    Attributes:
        api_key: the key clients must send, or None for none.
        allowed_hosts: host names and addresses (lower case, no port) the Host header may
            name; :data:`ANY` allows every Host.
        cors_origins: origins (``scheme://host[:port]``) allowed to call from a browser
            besides the node's own; :data:`ANY` allows all.
    """

    allowed_hosts: frozenset[str]
    api_key: str | None = None
    cors_origins: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RequestFacts:
    """What :func:`check` looks at in a request (header values as sent, None if absent)."""

    method: str
    path: str
    host: str | None = None
    origin: str | None = None
    authorization: str | None = None
    x_api_key: str | None = None
    member: bool = False  # a cluster member signed it


@dataclass(frozen=True)
class Refusal:
    """An HTTP answer refusing a request: status, message, extra headers."""

    status: int
    message: str
    headers: dict[str, str] = field(default_factory=dict)
    code: str | None = None  # the error's machine-readable code (OpenAI's ``code``)


def host_name(host: str) -> str:
    """The name or address in a Host header, without its port, lower case
    (``[::1]:80`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    name, _, port = host.rpartition(":")
    return name if name and port.isdigit() and ":" not in name else host


def _same_origin(origin: str, host: str | None) -> bool:
    parts = urlsplit(origin)
    return host is not None and parts.scheme in ("http", "https") and parts.netloc.lower() == host.strip().lower()


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The API key a request presents: ``Authorization: Bearer KEY``'s, else its
    ``x-api-key`` header's (None: neither)."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return x_api_key


def check(config: GuardConfig, facts: RequestFacts) -> Refusal | None:
    """Whether a request may go on (None) or how it is refused: :func:`check_place`, then
    :func:`check_key`."""
    return check_place(config, facts) or check_key(config, facts)


def check_place(config: GuardConfig, facts: RequestFacts) -> Refusal | None:
    """Where a request comes from: its Host must name this node (403), its Origin be the
    node's own or an allowed one (403; a preflight too). ``/internal`` routes are left to
    the signature check."""
    if facts.path.startswith("/internal/"):
        return None
    if facts.host is not None and ANY not in config.allowed_hosts and host_name(facts.host) not in config.allowed_hosts:
        name = host_name(facts.host)
        return Refusal(
            403,
            f"Host {facts.host!r} is not a name of this node; start it with --allowed-host {name} to allow that name"
            if name
            else "an empty Host header names no node: send this node's address or name",
        )
    if (
        facts.origin is not None
        and not _same_origin(facts.origin, facts.host)
        and ANY not in config.cors_origins
        and facts.origin not in config.cors_origins
    ):
        return Refusal(
            403,
            f"cross-origin request from {facts.origin} refused; start the node with "
            f"--cors-origin {facts.origin} to allow that origin",
        )
    return None


def check_key(config: GuardConfig, facts: RequestFacts) -> Refusal | None:
    """The API key, when the node has one (401, with ``WWW-Authenticate: Bearer``): not on
    :data:`PUBLIC_PATHS`, ``/internal`` or a request a cluster member signed."""
    if config.api_key is None or facts.member or facts.path in PUBLIC_PATHS or facts.path.startswith("/internal/"):
        return None
    presented = presented_key(facts.authorization, facts.x_api_key)
    if not presented:
        return Refusal(
            401,
            "no API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            {"WWW-Authenticate": "Bearer"},
        )
    if not hmac.compare_digest(presented.encode(), config.api_key.encode()):
        return Refusal(401, "wrong API key", {"WWW-Authenticate": "Bearer"}, "invalid_api_key")
    return None


def names_this_node(host: str | None, names: frozenset[str], port: int | None) -> bool:
    """Whether a Host header names this node: one of its ``names`` and its ``port`` (a
    signed request for another node, replayed here, names that one)."""
    if host is None:
        return False
    _, _, given_port = host.rpartition(":")
    return host_name(host) in names and (port is None or given_port == str(port))


def local_names(extra: list[str] | tuple[str, ...] = ()) -> frozenset[str]:
    """This machine's names and addresses for the Host allow-list: ``localhost``, the
    loopback addresses, the host name (and ``.local``, for mDNS), every interface's
    addresses, and ``extra`` (``--allowed-host``; ``*`` allows any)."""
    import psutil

    names = {"localhost", "127.0.0.1", "::1"}
    hostname = socket.gethostname().lower()
    names.update({hostname, f"{hostname}.local", socket.getfqdn().lower()})
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                names.add(a.address.split("%")[0].lower())
    names.update(host_name(e) if e != ANY else ANY for e in extra)
    return frozenset(names)


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


class GuardMiddleware:
    """ASGI middleware applying ``decide`` (:func:`check_place` or :func:`check_key`) to
    every HTTP request."""

    def __init__(self, app, config: GuardConfig, decide: Callable[[GuardConfig, RequestFacts], Refusal | None]) -> None:
        self.app = app
        self.config = config
        self.decide = decide

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = _headers(scope)
            facts = RequestFacts(
                scope["method"],
                scope["path"],
                headers.get("host"),
                headers.get("origin"),
                headers.get("authorization"),
                headers.get("x-api-key"),
                bool(scope.get(MEMBER_SCOPE_KEY)),
            )
            refusal = self.decide(self.config, facts)
            if refusal is not None:
                response = errors.error_response(
                    scope["path"], refusal.status, refusal.message, code=refusal.code, headers=refusal.headers
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


STREAMED_TYPES = ("application/x-ndjson", "application/octet-stream")
"""Answers signed as a stream (their body is not hashed): tokens and model file bytes."""


class SignatureMiddleware:
    """ASGI middleware: check node signatures (always on ``/internal``), sign the answers.

    Args:
        key: the cluster's signing key.
        names: this node's names and addresses (the Host of a request for it).

    The checks that need no body (Host, time, nonce: :func:`~shardline.node.signing.check_fresh`)
    come first, so a request without a fresh signature is refused unread; then the body is
    read whole (node-to-node bodies are small: tables, tasks, a prompt's token ids), the MAC
    checked, and the body handed on unchanged. The link probe's upload
    (:data:`~shardline.node.signing.UNHASHED_PATHS`) is not hashed, and streams through.
    """

    def __init__(self, app, key: bytes, names: frozenset[str]) -> None:
        self.app = app
        self.key = key
        self.names = names - {ANY}
        self.nonces = signing.NonceCache(not_before=time.time())  # nothing signed before this start
        self._warned: set[str] = set()  # client addresses whose refusal was logged as a warning

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        header = headers.get(signing.AUTH_HEADER.lower())
        internal = scope["path"].startswith("/internal/")
        if header is None and not internal:
            await self.app(scope, receive, send)
            return
        host = headers.get("host")
        try:  # what needs no body first: a stranger's request is refused unread
            if not names_this_node(host, self.names, (scope.get("server") or (None, None))[1]):
                raise signing.SignatureError(f"a request for {host!r}, not this node")
            fresh = signing.check_fresh(header, time.time(), self.nonces)
            body: bytes | None = None  # not read for a route whose body is not signed
            if scope["path"] not in signing.UNHASHED_PATHS:
                body = await _read_body(receive)
                if body is None:
                    return  # the client left
            target = scope.get("raw_path") or scope["path"].encode()
            if scope.get("query_string"):
                target += b"?" + scope["query_string"]
            request = signing.SignedRequest(
                scope["method"],
                target.decode("latin-1"),
                host or "",
                headers.get(signing.MEMBER_HEADER.lower(), ""),
                body,
            )
            signature = signing.check_mac(self.key, fresh, request, time.time(), self.nonces)
        except signing.SignatureError as exc:
            client = (scope.get("client") or ("?",))[0]
            first = client not in self._warned and len(self._warned) < 1024  # a stranger polls each second
            self._warned.add(client)
            log.log(
                logging.WARNING if first else logging.DEBUG,
                "refused %s %s from %s: %s%s",
                scope["method"],
                scope["path"],
                client,
                exc,
                " (further refusals of it: debug log)" if first else "",
            )
            response = errors.error_response(scope["path"], 401, str(exc))
            await response(scope, receive, send)
            return
        scope = dict(scope, **{MEMBER_SCOPE_KEY: True})
        replayed = body is None

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, self._signing_send(send, signature.nonce))

    def _signing_send(self, send, nonce: str):
        start: dict | None = None
        buffered: list[bytes] = []

        async def signed_send(message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                content_type = dict(message.get("headers", [])).get(b"content-type", b"").decode("latin-1")
                if content_type.startswith(STREAMED_TYPES):
                    await send(self._with_signature(message, nonce, content_type, signing.STREAM_BODY))
                else:
                    start = message
                return
            if message["type"] == "http.response.body" and start is not None:
                buffered.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                body = b"".join(buffered)
                content_type = dict(start.get("headers", [])).get(b"content-type", b"").decode("latin-1")
                await send(self._with_signature(start, nonce, content_type, signing.body_hash(body)))
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
            await send(message)

        return signed_send

    def _with_signature(self, start: dict, nonce: str, content_type: str, digest: str) -> dict:
        signature = signing.sign_response(self.key, nonce, start["status"], content_type, digest)
        headers = list(start.get("headers", [])) + [(signing.AUTH_HEADER.lower().encode(), signature.header().encode())]
        return dict(start, headers=headers)


async def _read_body(receive) -> bytes | None:
    """A request's whole body from an ASGI ``receive``; None if the client left first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)
