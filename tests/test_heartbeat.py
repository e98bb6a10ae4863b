"""A stream's keep-alive (:mod:`shardline.api.heartbeat`): heartbeats where a token stream
sends nothing, in process with a stream whose pauses are set by the test."""

from __future__ import annotations

import asyncio

import pytest

from shardline.api.heartbeat import Heartbeat, with_heartbeats
from shardline.runner.protocol import PrefillProgress

pytestmark = pytest.mark.fast


async def _events(script: list[tuple[float, object]], closed: list[str]):
    """Yield each item of ``script`` after its pause (seconds); note its closing."""
    try:
        for pause, item in script:
            await asyncio.sleep(pause)
            yield item
    finally:
        closed.append("closed")


def _names(items: list[object]) -> list[str]:
    return [
        "beat" if isinstance(i, Heartbeat) else "progress" if isinstance(i, PrefillProgress) else str(i) for i in items
    ]


def _run(script: list[tuple[float, object]], every_s: float) -> tuple[list[str], list[str]]:
    closed: list[str] = []

    async def collect() -> list[object]:
        return [item async for item in with_heartbeats(_events(script, closed), every_s)]

    return _names(asyncio.run(collect())), closed


PROGRESS = PrefillProgress(task_id=1, done=1, total=2)


@pytest.mark.parametrize(
    "script,names",
    [
        ([(0.0, "a"), (0.0, "b")], ["a", "b"]),  # items as they come: no heartbeat
        ([(0.75, "a")], ["beat", "beat", "a"]),  # a long wait: a heartbeat each 0.3 s
        # prefill progress does not count as sent: the heartbeat comes 0.3 s after the start
        ([(0.2, PROGRESS), (0.2, PROGRESS), (0.0, "a")], ["progress", "beat", "progress", "a"]),
        ([(0.0, "a"), (0.45, "b"), (0.05, "c")], ["a", "beat", "b", "c"]),  # an item resets the clock
    ],
)
def test_heartbeats_fill_the_pauses(script, names):
    got, closed = _run(script, every_s=0.3)  # the pauses 0.1 s or more from a heartbeat's time
    assert got == names and closed == ["closed"]


def test_closing_cancels_the_item_awaited():
    """A client that leaves mid-wait closes the stream: the item being awaited is
    cancelled and the token stream closed (which cancels the request on every rank)."""
    closed: list[str] = []

    async def leave_after_a_beat() -> list[object]:
        stream = with_heartbeats(_events([(30.0, "never")], closed), 0.05)
        first = await anext(stream)
        await stream.aclose()
        return [first]

    assert _names(asyncio.run(asyncio.wait_for(leave_after_a_beat(), 5))) == ["beat"]
    assert closed == ["closed"]


def test_an_error_reaches_the_reader():
    async def failing():
        await asyncio.sleep(0.12)
        raise RuntimeError("lost a rank")
        yield  # an async generator

    async def read() -> list[object]:
        return [item async for item in with_heartbeats(failing(), 0.05)]

    with pytest.raises(RuntimeError, match="lost a rank"):
        asyncio.run(read())
