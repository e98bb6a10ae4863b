"""Request bounds checked as a request's body arrives, before any handler parses it: its
size (413), the nesting depth of its JSON (400) and the time between its chunks (408: a
client that sends headers and part of a body, then nothing, is not held for ever; nginx's
``client_body_timeout`` bounds the same), each answered in the format of the API the path
belongs to (:mod:`shardline.api.errors`).

A plain ASGI middleware, not Starlette's ``BaseHTTPMiddleware`` (which hides a client's
disconnect from the endpoint). It keeps no copy of the body: it counts the bytes of each
``http.request`` message as the handler receives it and scans them for brackets
(:class:`JsonDepthScanner`), so a refused body is never read past the chunk that crossed
a limit.

Starlette 1.10 has a ``RequestBodyLimitMiddleware`` (FastAPI's ``max_body_size``); it is
not used because it answers a ``Content-Length`` over the limit only once a handler reads
the body, in ``text/plain`` where no handler does.
"""

from __future__ import annotations

import asyncio
import logging
from itertools import accumulate
from typing import TYPE_CHECKING

from shardline.node.link_probe import UPLOAD_PATH

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_JSON_DEPTH = 64
DEFAULT_BODY_TIMEOUT_S = 30.0
"""Longest wait for the next chunk of a request's body, seconds (nginx's default is 60)."""
DEFAULT_MAX_JSON_OBJECTS = 65_536
"""Objects (``{``) a body may hold: parsing and validating a million tiny ones (16 MiB of
empty chat messages) held the GIL, and so the node's event loop, for about 5 s; a chat
that fits any context has far fewer (each message takes a token at least)."""

# The one route whose body is not JSON (the link probe's upload) is only counted; every
# other body is scanned whatever its Content-Type (the APIs parse JSON sent as any type).
_NOT_JSON_PATHS = frozenset({UPLOAD_PATH})
# JSON other than UTF-8 (RFC 8259 asks UTF-8 between systems): UTF-16/32 put a NUL in the
# first bytes of any JSON text, or start with a byte order mark; the scan would misread it.
_NOT_UTF8_STARTS = (b"\xfe\xff", b"\xff\xfe", b"\x00")

_BRACKETS_ONLY = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
for _b in b"[{":
    _STEP[_b] = 1
for _b in b"]}":
    _STEP[_b] = -1


class JsonDepthScanner:
    """The deepest nesting of ``[`` and ``{`` outside strings in JSON text fed in pieces
    (a linear scan; nothing is parsed or kept). Text that is not JSON gives some depth
    too; the parser refuses such text anyway.

    Attributes:
        depth: the nesting depth at the end of the data fed so far.
        max_depth: the deepest nesting seen so far (``[]`` is 1, ``[[]]`` 2).
        objects: the objects (``{``) opened so far.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.max_depth = 0
        self.objects = 0
        self._in_string = False
        self._escape = False  # the last piece ended inside a string, just after a backslash

    def feed(self, data: bytes) -> int:
        """Scan the next piece of the text; return :attr:`max_depth` so far.

        Byte-string operations (C speed) do the per-byte work: escaped backslashes, then
        escaped quotes are dropped, so every quote left opens or closes a string; the
        pieces between quotes are, by turns, structure and string contents.
        """
        if self._escape and data:  # the last piece ended just after a backslash in a string
            data, self._escape = data[1:], False
        if not data:
            return self.max_depth
        text = data.replace(b"\\\\", b"").replace(b'\\"', b"")
        parts = text.split(b'"')
        self._structure(b"".join(parts[1::2] if self._in_string else parts[0::2]))
        if len(parts) % 2 == 0:  # an odd number of quotes: in a string now, or out of one
            self._in_string = not self._in_string
        self._escape = self._in_string and text.endswith(b"\\")
        return self.max_depth

    def _structure(self, segment: bytes) -> None:
        """Brackets of a segment outside strings (C-speed counts where they cannot go deeper)."""
        objects = segment.count(b"{")
        self.objects += objects
        opens = segment.count(b"[") + objects
        if opens == 0:
            self.depth -= segment.count(b"]") + segment.count(b"}")
            return
        if self.depth + opens <= self.max_depth:
            self.depth += opens - segment.count(b"]") - segment.count(b"}")
            return
        brackets = segment.translate(None, _BRACKETS_ONLY)
        deepest = max(accumulate(map(_STEP.__getitem__, brackets), initial=self.depth))
        self.max_depth = max(self.max_depth, deepest)
        self.depth += 2 * opens - len(brackets)


def json_depth(text: bytes, piece_bytes: int = 65536) -> int:
    """The deepest nesting of arrays and objects in JSON ``text`` (0 for a scalar), fed to
    a :class:`JsonDepthScanner` in pieces of ``piece_bytes`` (the scan's scratch is a few
    times a piece)."""
    scanner = JsonDepthScanner()
    for start in range(0, len(text), piece_bytes):
        scanner.feed(text[start : start + piece_bytes])
    return scanner.max_depth


class _Refused(Exception):
    """Raised to the handler from ``receive`` once the body crossed a limit."""


class RequestBoundsMiddleware:
    """Refuse a request whose body is over ``max_body_bytes`` (413) or whose JSON nests
    deeper than ``max_json_depth`` or holds more than ``max_json_objects`` objects (400).

    A ``Content-Length`` over the limit is answered at once, unread. Otherwise the body's
    chunks are counted and scanned as the handler receives them; at the first chunk over
    a limit the handler's ``receive`` raises, whatever it answers is dropped, and the
    refusal goes out instead (unless the handler already began its answer; then the
    connection is closed).

    Args:
        app: the ASGI app.
        max_body_bytes: the most bytes of body a request may carry.
        max_json_depth: the deepest nesting of ``[``/``{`` a body may have (every body
            but the link probe's upload is scanned, whatever its Content-Type; JSON in
            UTF-16 or UTF-32 is refused).
        max_json_objects: the most objects (``{``) a body may hold.
        body_timeout_s: the longest wait for the next chunk of a body still arriving
            (408 after it); none once the body is complete (a handler then waits on
            ``receive`` for the client's disconnect, for as long as it streams).
    """

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
        max_json_objects: int = DEFAULT_MAX_JSON_OBJECTS,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        if max_body_bytes < 0 or max_json_depth < 1 or not body_timeout_s > 0:
            raise ValueError(
                f"bounds must be positive: max_body_bytes {max_body_bytes}, "
                f"max_json_depth {max_json_depth}, body_timeout_s {body_timeout_s}"
            )
        self.body_timeout_s = body_timeout_s
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth
        self.max_json_objects = max_json_objects

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body_bytes:
            await self._refuse(scope, 413, self._too_large(), "request_too_large", send)
            return
        scanner = None if path in _NOT_JSON_PATHS else JsonDepthScanner()
        received = 0
        refusal: tuple[int, str, str] | None = None  # status, message, code
        started = False
        body_done = False  # the last body chunk (more_body false) or a disconnect came

        async def bounded_receive() -> Message:
            nonlocal received, refusal, body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except TimeoutError:
                refusal = (408, f"no more of the request body came in {self.body_timeout_s:g} s", "request_timeout")
                raise _Refused(refusal[1]) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                received += len(chunk)
                if received > self.max_body_bytes:
                    refusal = (413, self._too_large(), "request_too_large")
                elif scanner is not None and received == len(chunk) and _not_utf8(chunk):
                    refusal = (400, "the request body is not UTF-8 JSON", "not_utf8")
                elif scanner is not None and scanner.feed(chunk) > self.max_json_depth:
                    refusal = (
                        400,
                        f"the request's JSON nests deeper than {self.max_json_depth} levels",
                        "json_too_deep",
                    )
                elif scanner is not None and scanner.objects > self.max_json_objects:
                    refusal = (
                        400,
                        f"the request's JSON holds more than {self.max_json_objects} objects",
                        "json_too_many_objects",
                    )
                if refusal is not None:
                    raise _Refused(refusal[1])
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refusal is not None:
                return  # the handler's answer to a refused body: the refusal goes out instead
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, guarded_send)
        except Exception:
            if refusal is None:
                raise
            log.debug("refused %s %s: %s", scope["method"], path, refusal[1], exc_info=True)
        if refusal is not None:
            if started:
                raise _Refused(refusal[1])  # too late to answer: the server closes the connection
            await self._refuse(scope, *refusal, send)

    def _too_large(self) -> str:
        return f"the request body is over this node's limit of {self.max_body_bytes} bytes"

    @staticmethod
    async def _refuse(scope: Scope, status: int, message: str, code: str, send: Send) -> None:
        """Send the refusal; ``Connection: close``, as the rest of the body stays unread."""
        from shardline.api import errors  # not for the CLI's parser

        response = errors.error_response(scope["path"], status, message, code=code, headers={"Connection": "close"})
        await response(scope, _no_receive, send)


def _not_utf8(first: bytes) -> bool:
    """Whether a body's first chunk shows JSON in UTF-16 or UTF-32 (RFC 8259 section 8.1)."""
    return first.startswith(_NOT_UTF8_STARTS) or b"\x00" in first[1:4]


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
