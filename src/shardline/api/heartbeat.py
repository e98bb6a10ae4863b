"""A stream's keep-alive: :class:`Heartbeat` items put into a token stream where it has
sent nothing for a while (a long prompt's prefill, a wait in the queue), so each API's
stream can send its own keep-alive and no client's idle timeout fires."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from shardline.cancelling import cancel_and_wait
from shardline.runner.protocol import PrefillProgress

HEARTBEAT_S = 5.0
"""Seconds a stream waits with nothing to send (a long prompt's prefill, a queue) before
it sends its API's keep-alive (:class:`Heartbeat`): well under the idle timeouts of the
clients that wait longest for a first token (Claude Code's 5 minutes; proxies' 60 s)."""


@dataclass(frozen=True)
class Heartbeat:
    """An item of :meth:`Generation.texts`: nothing was sent for the heartbeat's interval;
    a stream sends its API's keep-alive (an Anthropic ``ping`` event, an SSE comment, an
    empty Ollama chunk)."""


async def with_heartbeats(events: AsyncGenerator[Any, None], every_s: float) -> AsyncGenerator[Any, None]:
    """``events`` with a :class:`Heartbeat` wherever ``every_s`` seconds pass without an
    item other than :class:`PrefillProgress` or a heartbeat. Closing it closes ``events``
    (an item being awaited is cancelled first)."""
    last = time.monotonic()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=max(0.0, last + every_s - time.monotonic()))
            if not done:
                last = time.monotonic()
                yield Heartbeat()
                continue
            ready, pending = pending, None
            try:
                item = ready.result()
            except StopAsyncIteration:
                return
            if not isinstance(item, PrefillProgress):
                last = time.monotonic()
            yield item
    finally:
        if pending is not None:  # its cleanup (the request's cancel, a forwarded stream's
            await cancel_and_wait(pending)  # close) runs to its end, whatever cancels this
        await events.aclose()
