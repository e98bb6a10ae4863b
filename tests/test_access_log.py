"""The node's access log keeps the lines of error responses only
(:func:`shardline.cli.error_response_line` on uvicorn's ``uvicorn.access`` logger)."""

from __future__ import annotations

import logging

import pytest

from shardline.cli import error_response_line

pytestmark = pytest.mark.fast

FORMAT = '%s - "%s %s HTTP/%s" %d'  # uvicorn's access line


@pytest.mark.parametrize(
    "args, kept",
    [
        (("127.0.0.1:5000", "POST", "/v1/chat/completions", "1.1", 200), False),
        (("127.0.0.1:5000", "GET", "/cluster/instances", "1.1", 200), False),  # the dashboard's polls
        (("127.0.0.1:5000", "POST", "/v1/messages", "1.1", 400), True),
        (("127.0.0.1:5000", "POST", "/v1/responses", "1.1", 503), True),
        ((), False),  # another line of that logger's
    ],
)
def test_an_access_line_is_kept_for_an_error_response(args, kept):
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, FORMAT if args else "x", args, None)
    assert error_response_line(record) == kept
