"""The router's lookups, in process (no cluster): a request whose instance went away
between the API's check and its start."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from shardline.node.routing import RequestStream, Router
from shardline.node.table import InstanceFailedError
from shardline.runner.protocol import SamplingParams, TokenRequest

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]


def run_to_end(router: Router, task_id: int | None) -> None:
    async def consume() -> None:
        async for _ in router.generate(TokenRequest("m", (1, 2), 4, SamplingParams(), ()), task_id):
            pass

    asyncio.run(consume())


@pytest.mark.parametrize("reserved", [True, False])
def test_a_request_whose_instance_is_gone_fails_as_a_failed_instance(reserved):
    """The API found a ready instance, then the nodes restarted before the request ran:
    an InstanceFailedError (the APIs' 503 to retry), not a NoInstanceError (a 500), and
    the request's place is given up."""
    node = SimpleNamespace(node_id="n0", instances={}, streams={})
    if reserved:
        node.streams[7] = RequestStream("gone", asyncio.Queue())
    with pytest.raises(InstanceFailedError, match="retry later"):
        run_to_end(Router(node), 7 if reserved else None)
    assert node.streams == {}
