"""A time limit on reading a request's headers, against clients that open connections and
never finish a request (slowloris).

uvicorn 0.54 has none: its ``timeout_keep_alive`` closes a connection idle *between*
requests, and only until the first byte of the next one arrives; a new connection, or one
that sends half a request line and stops, is held for ever (``h11_max_incomplete_event_size``
bounds the headers' size, not their time). So this is uvicorn's h11 protocol with a timer:
armed when a connection opens and when a response completes, stopped when a request's
headers are complete; when it fires the connection is closed. The body's time is not
bounded here.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0


def header_timeout_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol class (for ``uvicorn.run(http=...)``) that closes a connection
    whose request headers are not complete ``timeout_s`` seconds after it opened or after
    its previous response.

    Raises:
        ValueError: ``timeout_s`` is not positive.
    """
    if not timeout_s > 0:
        raise ValueError(f"the header timeout must be positive, not {timeout_s}")
    from uvicorn.protocols.http.h11_impl import H11Protocol  # not for the CLI's parser

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _timed_cycle: object = None  # the request-response cycle in progress when armed

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self._header_timer is not None and self.cycle is not self._timed_cycle:
                self._disarm()  # a new request's headers are in: it has a cycle of its own

        def on_response_complete(self) -> None:
            self._arm()  # before super(), which may take in a pipelined request at once
            super().on_response_complete()

        def _arm(self) -> None:
            self._disarm()
            self._timed_cycle = self.cycle
            self._header_timer = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                log.info("closing a connection from %s: no complete request headers in %.0f s", self.client, timeout_s)
                self.transport.close()

    return HeaderTimeoutH11Protocol
