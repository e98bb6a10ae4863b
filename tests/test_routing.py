"""The router's lookups, in process (no cluster): a request whose instance went away
between the API's check and its start; an instance placed beside another (a rejoin's
handover); deleting one deletes what stands in for it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from shardline.models.config import RankShare, Sharding
from shardline.node.cluster_state import Epoch
from shardline.node.coordinator import Coordinator
from shardline.node.routing import RequestStream, Router
from shardline.node.state import ClusterState, apply
from shardline.node.status import InstanceStatus, RankStatus
from shardline.node.table import Instance, InstanceFailedError, RankPlacement
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


def _instance(instance_id: str, status: InstanceStatus, created_at: float, replaced=()) -> Instance:
    return Instance(instance_id, "m", Sharding.PIPELINE,
                    (RankPlacement("a", "a:1", RankShare(0, 1), status=RankStatus.READY),),
                    "a", 1, 256, 1, status=status, created_at=created_at, replaced=replaced)


@pytest.mark.parametrize("new_status, chosen", [
    (InstanceStatus.LOADING, "old"), (InstanceStatus.READY, "new"), (InstanceStatus.FAILED, "old")])
def test_requests_go_to_an_instance_placed_beside_another_once_it_is_ready(new_status, chosen):
    """A rejoin places the new instance beside the serving one (state.superseded)."""
    table = {"old": _instance("old", InstanceStatus.READY, 0.0),
             "new": _instance("new", new_status, 1.0, replaced=("old",))}
    node = SimpleNamespace(node_id="a", instances=table)
    assert Router(node).ready_instance("m").instance_id == chosen


def test_deleting_an_instance_deletes_the_one_placed_beside_it():
    class FakeNode:
        def __init__(self) -> None:
            self.state = ClusterState(Epoch(1, 1, "a"), {
                "old": _instance("old", InstanceStatus.READY, 0.0),
                "new": _instance("new", InstanceStatus.LOADING, 1.0, replaced=("old",)),
                "other": _instance("other", InstanceStatus.READY, 2.0)})

        @property
        def instances(self):
            return self.state.instances

        async def commit(self, *events) -> None:
            for event in events:
                self.state = apply(self.state, event)

    node = FakeNode()
    assert asyncio.run(Coordinator(node).delete_instance("old")) == "old"  # type: ignore[arg-type]
    assert set(node.instances) == {"other"}
