"""Node-to-node authentication that never sends the cluster key.

Every request a node sends to another carries one header, :data:`AUTH_HEADER`::

    X-Shardline-Auth: t=<unix seconds>,n=<nonce, 32 hex>,s=<HMAC-SHA-256, 64 hex>

where the HMAC (RFC 2104, stdlib ``hmac``) is taken with the cluster's *signing key* over
``shardline-v1 request``, the method, the path with its query string, the Host header (the
node it is for), the :data:`MEMBER_HEADER` (the sender's address, when it names one), the
time, the nonce and the SHA-256 of the body, one per line. The receiver checks the MAC, that
the Host names itself (``shardline.api.http_guard``), that the time lies within
:data:`CLOCK_SKEW_S` of its own clock and not before the receiver started, and that it has
not seen the nonce in that window (:class:`NonceCache`): a recorded request can be replayed
neither to its node (also not after a restart, which empties the cache) nor to another. The
answer carries the same header, a MAC over ``shardline-v1 response``, the request's nonce, the status, the
content type and the body's SHA-256 (``stream`` for a streamed body: the tokens of
``/internal/generate`` and model file bytes; file bytes are checked against the SHA-256 in
the signed manifest), so a node without the key cannot answer as a member either.

The signing key is derived from the cluster key with scrypt (RFC 7914; N=2^14, r=8, p=1,
about 16 MiB and tens of milliseconds once per process): a node that collects signed
requests (say by advertising itself on mDNS) can test guesses of a weak cluster key only at
that cost per guess. mDNS advertises nothing derived from the key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Generator
from dataclasses import dataclass

import httpx

from shardline.node.link_probe import UPLOAD_PATH

AUTH_HEADER = "X-Shardline-Auth"
MEMBER_HEADER = "X-Shardline-Node"
"""The header a node's poll carries its own address in: the polled member adds it to its
peers (a node that knows one member becomes known to all). Signed."""
CLOCK_SKEW_S = 60.0
"""How far a request's time may be from the receiver's clock, seconds (either way)."""

STREAM_BODY = "stream"
"""The body hash an answer with a streamed body is signed with, and a request to one of
:data:`UNHASHED_PATHS`."""

UNHASHED_PATHS = frozenset({UPLOAD_PATH})
"""Routes whose request body is not hashed: the link probe's upload, bytes the receiver
discards, whose hashing (about 2 ms a MiB on each side) would count as link time."""

_SALT = b"shardline-v1 signing key"


def signing_key(cluster_key: str) -> bytes:
    """The 32-byte HMAC key for ``cluster_key`` (scrypt, RFC 7914; see the module doc)."""
    return hashlib.scrypt(cluster_key.encode(), salt=_SALT, n=2**14, r=8, p=1, dklen=32)


class SignatureError(ValueError):
    """A request or answer whose signature is missing, malformed, stale, replayed or wrong."""


@dataclass(frozen=True)
class Signature:
    """The parts of an :data:`AUTH_HEADER` value: time (unix seconds), nonce and MAC (hex)."""

    time: int
    nonce: str
    mac: str

    def header(self) -> str:
        return f"t={self.time},n={self.nonce},s={self.mac}"

    @classmethod
    def parse(cls, value: str | None) -> "Signature":
        """Raises SignatureError: no header, or not ``t=..,n=..,s=..``."""
        if not value:
            raise SignatureError("no signature: not a node of this cluster")
        try:
            parts = dict(item.split("=", 1) for item in value.split(","))
            signature = cls(int(parts["t"]), parts["n"], parts["s"])
        except (KeyError, ValueError):
            raise SignatureError("a malformed signature header") from None
        if not (0 < len(signature.nonce) <= 64 and len(signature.mac) == 64):
            raise SignatureError("a malformed signature header")
        return signature


def _mac(key: bytes, *fields: str) -> str:
    return hmac.new(key, "\n".join(fields).encode(), hashlib.sha256).hexdigest()


def body_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


@dataclass(frozen=True)
class SignedRequest:
    """The parts of a request a signature covers.

    Attributes:
        method: ``GET``, ``POST``, ...
        target: the path with its query string (``/internal/x?a=b``).
        host: the Host header (``address:port`` of the node it is for).
        member: the :data:`MEMBER_HEADER` value, or "".
        body: the body's bytes; None for a route in :data:`UNHASHED_PATHS`.
    """

    method: str
    target: str
    host: str
    member: str = ""
    body: bytes | None = b""


def sign_request(key: bytes, request: SignedRequest, now: float, nonce: str | None = None) -> Signature:
    """The signature of ``request`` at ``now`` (unix seconds)."""
    nonce = nonce or secrets.token_hex(16)
    t = int(now)
    return Signature(
        t,
        nonce,
        _mac(
            key,
            "shardline-v1 request",
            request.method.upper(),
            request.target,
            request.host.lower(),
            request.member,
            str(t),
            nonce,
            STREAM_BODY if request.body is None else body_hash(request.body),
        ),
    )


def sign_response(key: bytes, request_nonce: str, status: int, content_type: str, body_digest: str) -> Signature:
    """The signature of an answer to the request with ``request_nonce``; ``body_digest`` is
    :func:`body_hash` of the body, or :data:`STREAM_BODY`."""
    return Signature(
        0, request_nonce, _mac(key, "shardline-v1 response", request_nonce, str(status), content_type, body_digest)
    )


class NonceCache:
    """Nonces seen within the clock-skew window (a replay cache), bounded in size.

    Args:
        window_s: how long a nonce is remembered, seconds (twice the skew window covers
            every time a request could still be accepted).
        max_entries: the most nonces held; when full, the oldest are dropped first (a
            flood of valid requests, which only a key holder can send).
        not_before: unix seconds; requests signed earlier are refused (the time the cache
            started empty: what it saw before a restart it no longer holds). A peer whose
            clock lags this one's by d seconds is refused for the first d seconds.
    """

    def __init__(self, window_s: float = 2 * CLOCK_SKEW_S, max_entries: int = 200_000, not_before: float = 0.0) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self.not_before = int(not_before)
        self._seen: dict[str, float] = {}  # nonce -> when seen; insertion order is time order

    def seen(self, nonce: str) -> bool:
        """Whether ``nonce`` is held (seen within the window)."""
        return nonce in self._seen

    def add(self, nonce: str, now: float) -> bool:
        """Remember ``nonce`` seen at ``now``; False when it was seen within the window."""
        while self._seen:
            oldest, at = next(iter(self._seen.items()))
            if at >= now - self.window_s and len(self._seen) < self.max_entries:
                break
            del self._seen[oldest]
        if nonce in self._seen:
            return False
        self._seen[nonce] = now
        return True


def check_fresh(header: str | None, now: float, nonces: NonceCache) -> Signature:
    """The checks of :func:`verify_request` that need no body: the header's form, its time
    (within :data:`CLOCK_SKEW_S` of ``now``, not before ``nonces.not_before``) and a nonce not
    seen; a receiver makes them before it reads the body.

    Raises:
        SignatureError: see :func:`verify_request`.
    """
    signature = Signature.parse(header)
    offset = signature.time - now
    if abs(offset) > CLOCK_SKEW_S:
        raise SignatureError(
            f"the request's time is {offset:+.0f} s from this node's clock "
            f"(allowed: {CLOCK_SKEW_S:.0f} s): set the clocks right (NTP)"
        )
    if signature.time < nonces.not_before:
        raise SignatureError("signed before this node started: a replayed request")
    if nonces.seen(signature.nonce):
        raise SignatureError("a replayed request (nonce seen before)")
    return signature


def verify_request(key: bytes, header: str | None, request: SignedRequest, now: float, nonces: NonceCache) -> Signature:
    """Check a request's signature; the parsed signature when good.

    Raises:
        SignatureError: missing or malformed, the time outside :data:`CLOCK_SKEW_S` of
            ``now`` (the message gives the offset) or before ``nonces.not_before``, a wrong
            MAC, or a nonce seen before.
    """
    return check_mac(key, check_fresh(header, now, nonces), request, now, nonces)


def check_mac(key: bytes, signature: Signature, request: SignedRequest, now: float, nonces: NonceCache) -> Signature:
    """The rest of :func:`verify_request` for a ``signature`` :func:`check_fresh` passed:
    its MAC over ``request``, then its nonce recorded; ``signature`` when good.

    Raises:
        SignatureError: a wrong MAC, or the nonce seen meanwhile.
    """
    expected = sign_request(key, request, signature.time, signature.nonce)
    if not hmac.compare_digest(expected.mac, signature.mac):
        raise SignatureError("wrong signature: another cluster key")
    if not nonces.add(signature.nonce, now):
        raise SignatureError("a replayed request (nonce seen before)")
    return signature


def verify_response(
    key: bytes,
    request_header: str | None,
    response_header: str | None,
    status: int,
    content_type: str,
    body: bytes | None,
) -> None:
    """Check an answer's signature against the request it answers (``body`` None: a
    streamed body, signed as :data:`STREAM_BODY`).

    Raises:
        SignatureError: unsigned, or signed for another request, status or body.
    """
    sent = Signature.parse(request_header)
    got = Signature.parse(response_header)
    digest = STREAM_BODY if body is None else body_hash(body)
    expected = sign_response(key, sent.nonce, status, content_type, digest)
    if got.nonce != sent.nonce or not hmac.compare_digest(expected.mac, got.mac):
        raise SignatureError("the answer is not signed with this cluster's key")


def request_target(url: httpx.URL) -> str:
    """The path and query a request is signed over (``/internal/x?a=b``)."""
    return url.raw_path.decode("ascii")


class SignedAuth(httpx.Auth):
    """An httpx auth that signs every request with ``key`` (a :func:`signing_key`).

    Answers are checked by the caller with :func:`verify_response` (it holds the body).
    """

    requires_request_body = True

    def __init__(self, key: bytes) -> None:
        self.key = key

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        body = None if request.url.path in UNHASHED_PATHS else request.content
        signed = SignedRequest(
            request.method,
            request_target(request.url),
            request.headers.get("host", ""),
            request.headers.get(MEMBER_HEADER, ""),
            body,
        )
        signature = sign_request(self.key, signed, time.time())
        request.headers[AUTH_HEADER] = signature.header()
        yield request


def check_answer(key: bytes, response: httpx.Response, streamed: bool = False) -> None:
    """:func:`verify_response` for an httpx answer to a :class:`SignedAuth` request (its
    body read unless ``streamed``).

    Raises:
        SignatureError: see :func:`verify_response`.
    """
    verify_response(
        key,
        response.request.headers.get(AUTH_HEADER),
        response.headers.get(AUTH_HEADER),
        response.status_code,
        response.headers.get("content-type", ""),
        None if streamed else response.content,
    )
