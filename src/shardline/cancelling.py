"""Cancelling a task whose cleanup must run to its end (a stream's close)."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Future) -> None:
    """Cancel ``task`` once and wait until it has ended, its outcome dropped.

    A cancellation of the caller meanwhile ends the wait (it is raised) but is not passed
    on to ``task``, as ``asyncio.gather`` would pass it on: the task's cleanup runs to its
    end. Starlette ends a streamed answer whose client left by cancelling it within an
    anyio cancel scope, which cancels each ``await`` of the task again; passed on, the
    second cancellation cut short the close of a forwarded request's stream to the node
    that ran it (httpcore marks the stream closed before it closes the connection), the
    connection stayed open, and that node decoded the request to its ``max_tokens``.
    """
    if not task.done():
        task.cancel()
    task.add_done_callback(_drop_outcome)
    await asyncio.wait({task})


def _drop_outcome(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" in the log
