"""The coordinator role (:mod:`shardline.node.coordinator`) built alone: a plain view of
the node holding a table, callbacks that apply and record what it commits, no cluster and
no node. Deleting, failing lost instances, rank reports, handing over to an instance
placed beside another, and the limit on placing again."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass, field

import pytest

from shardline.models.config import RankShare, Sharding
from shardline.node.coordinator import HANDOVER_S, Coordinator, CoordinatorEffects
from shardline.node.epochs import Epoch
from shardline.node.state import ClusterState, Deleted, InstanceFailed, NotPlacedAgain, RankReported, apply
from shardline.node.status import InstanceStatus, RankStatus
from shardline.node.table import Instance, Peer, RankPlacement

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]

READY, LOADING, FAILED = InstanceStatus.READY, InstanceStatus.LOADING, InstanceStatus.FAILED


@dataclass
class View:
    """What the coordinator reads: a table and plain values."""

    state: ClusterState = field(default_factory=lambda: ClusterState(Epoch(1, 1, "a", True)))
    node_id: str = "a"
    started_at: float = 100.0
    down_after_s: float = 5.0
    max_replacements: int = 3
    default_context: int = 256
    default_max_batch: int = 2
    peers: dict[str, Peer] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)
    acting: bool = True
    busy: list[str] = field(default_factory=list)

    @property
    def cluster_state(self) -> ClusterState:
        return self.state

    @property
    def instances(self):
        return self.state.instances

    def live_node_ids(self) -> list[str]:
        return sorted([*self.live, self.node_id])

    def live_peers(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.node_id in self.live]

    def address_of(self, node_id: str) -> str:
        return f"{node_id}:1"

    def profile_of(self, node_id: str) -> dict:
        return {}

    def incarnation_of(self, node_id: str) -> float:
        return self.started_at if node_id == self.node_id else self.peers[node_id].started_at

    def is_coordinator(self) -> bool:
        return self.acting

    def busy_instances(self) -> list[str]:
        return self.busy


class Recorder:
    def __init__(self, view: View) -> None:
        self.view = view
        self.committed: list[object] = []
        self.background: list[str] = []

    def effects(self) -> CoordinatorEffects:
        async def commit(*events) -> None:
            for event in events:
                self.committed.append(event)
                self.view.state = apply(self.view.state, event)

        def background(coroutine) -> None:
            self.background.append(coroutine.__qualname__)
            coroutine.close()

        async def unused(*args, **kwargs):
            raise AssertionError("not expected")

        def drop(instance_id: str) -> None:
            self.view.state = apply(self.view.state, Deleted(instance_id))

        return CoordinatorEffects(
            commit=commit,
            drop_unpublished=drop,
            background=background,
            poll=unused,
            model_card=unused,
            adopt=unused,
            check_whole=unused,
            node_profiles=lambda node_ids: ([], {}),
            served_speeds=lambda: {},
            free_bytes=lambda node_id: 0,
            runtime_baseline=lambda node_ids: 0,
            free_port=unused,
            tokenizer=unused,
        )


def instance(
    instance_id: str,
    status: InstanceStatus = READY,
    nodes: tuple[str, ...] = ("a",),
    created_at: float = 0.0,
    replaced: tuple[str, ...] = (),
    ready_at: float | None = None,
    incarnation: float = 0.0,
    retries: int = 0,
    stands_in_for: str | None = None,
    rank_status: RankStatus = RankStatus.READY,
) -> Instance:
    ranks = tuple(
        RankPlacement(n, f"{n}:1", RankShare(i, i + 1), status=rank_status, incarnation=incarnation)
        for i, n in enumerate(nodes)
    )
    return Instance(
        instance_id,
        "m",
        Sharding.PIPELINE,
        ranks,
        nodes[0],
        1,
        256,
        1,
        status=status,
        created_at=created_at,
        replaced=replaced,
        ready_at=ready_at,
        retries=retries,
        stands_in_for=stands_in_for,
    )


def build(view: View) -> tuple[Coordinator, Recorder]:
    recorder = Recorder(view)
    return Coordinator(view, recorder.effects()), recorder


def table(*instances: Instance) -> ClusterState:
    return ClusterState(Epoch(1, 1, "a", True), {i.instance_id: i for i in instances})


# -- deleting ----------------------------------------------------------------------------


def test_deleting_an_instance_deletes_the_one_placed_beside_it():
    view = View(
        table(
            instance("old", READY, created_at=0.0),
            instance("new", LOADING, created_at=1.0, replaced=("old",)),
            instance("other", READY, created_at=2.0),
        )
    )
    coordinator, _ = build(view)
    assert asyncio.run(coordinator.delete_instance("old")) == "old"
    assert set(view.instances) == {"other"}


@pytest.mark.parametrize(
    "named, deleted, left",
    [
        ("x", "x", set()),
        ("gone", "y", set()),  # an old id names the instance placed again in its place
        ("nothing", None, {"y"}),
    ],
)
def test_what_a_deletion_names(named, deleted, left):
    view = View(table(instance("y", replaced=("gone",))) if named != "x" else table(instance("x")))
    coordinator, _ = build(view)
    assert asyncio.run(coordinator.delete_instance(named)) == deleted
    assert set(view.instances) == (left if named != "x" else set())


# -- keep_alive ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seconds, acting, until",
    [
        (60.0, True, 1060.0),
        (0.0, True, 1000.0),  # unloaded once idle
        (math.inf, True, None),  # for ever
        (60.0, False, 5.0),  # not the coordinator: nothing changes
    ],
)
def test_keep_alive_records_the_deadline_in_the_table(seconds, acting, until):
    view = View(table(dataclasses.replace(instance("x"), keep_until=5.0)), acting=acting)
    coordinator, recorder = build(view)
    assert asyncio.run(coordinator.keep_alive(["x", "gone"], seconds, now=1000.0)) is acting
    assert view.instances["x"].keep_until == until and set(view.instances) == {"x"}
    assert len(recorder.committed) == (1 if acting else 0)  # none for the id the table lacks


# -- lost instances ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodes, live, incarnations, failed, at_once",
    [
        (("a", "b"), {"b"}, {"b": 7.0}, False, None),  # every node live, the same start
        (("a", "b"), set(), {"b": 7.0}, True, False),  # b is down
        (("a", "b"), {"b"}, {"b": 9.0}, True, True),  # b restarted since the placement: at once
    ],
)
def test_instances_with_a_rank_on_a_lost_node_fail(nodes, live, incarnations, failed, at_once):
    view = View(
        table(instance("x", nodes=nodes, incarnation=7.0)),
        live=live,
        peers={n: Peer(n, f"{n}:1", 0.0, started_at=s) for n, s in incarnations.items()},
    )
    view.started_at = 7.0
    coordinator, recorder = build(view)
    asyncio.run(coordinator.fail_lost_instances())
    assert (view.instances["x"].status == FAILED) is failed
    if failed:
        (event,) = recorder.committed
        assert isinstance(event, InstanceFailed) and event.at_once is at_once
        assert recorder.background == ["Coordinator.replace"]


# -- rank reports ------------------------------------------------------------------------


def test_a_node_that_does_not_coordinate_changes_nothing():
    view = View(table(instance("x", LOADING, rank_status=RankStatus.LOADING)), acting=False)
    coordinator, recorder = build(view)
    assert asyncio.run(coordinator.runner_status(RankReported("x", "a", RankStatus.READY, at=5.0))) is False
    assert recorder.committed == []


def test_a_ready_report_readies_the_instance():
    view = View(table(instance("x", LOADING, rank_status=RankStatus.LOADING)))
    coordinator, recorder = build(view)
    assert asyncio.run(coordinator.runner_status(RankReported("x", "a", RankStatus.READY, at=5.0))) is True
    assert view.instances["x"].status == READY and recorder.background == []


def test_a_rank_that_failed_on_its_own_fails_the_instance_and_places_it_again_once():
    view = View(table(instance("x", LOADING, nodes=("a", "b"), rank_status=RankStatus.LOADING)), live={"b"})
    coordinator, recorder = build(view)
    report = RankReported("x", "b", RankStatus.FAILED, error="out of memory")
    asyncio.run(coordinator.runner_status(report))
    asyncio.run(coordinator.runner_status(report))
    assert view.instances["x"].status == FAILED and "out of memory" in (view.instances["x"].error or "")
    assert recorder.background == ["Coordinator.replace"]


def test_a_rank_that_only_lost_a_peer_waits_for_the_rank_that_failed():
    view = View(table(instance("x", READY, nodes=("a", "b"))), live={"b"})
    coordinator, recorder = build(view)
    report = RankReported("x", "b", RankStatus.FAILED, error="lost contact", peer_lost=True)
    asyncio.run(coordinator.runner_status(report))
    assert recorder.background == ["Coordinator._fail_after_grace"]
    assert view.instances["x"].status != FAILED


# -- handing over ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ready_for_s, busy, retired",
    [
        (HANDOVER_S + 1, [], True),
        (HANDOVER_S - 1, [], False),  # not every node routes to the new one yet
        (HANDOVER_S + 1, ["old"], False),  # the old one still has requests
        (None, [], False),  # the new one is not ready
    ],
)
def test_an_instance_stood_in_for_is_deleted_once_idle(ready_for_s, busy, retired):
    now = time.time()
    new = instance(
        "new",
        READY if ready_for_s is not None else LOADING,
        created_at=1.0,
        replaced=("old",),
        ready_at=None if ready_for_s is None else now - ready_for_s,
        stands_in_for="old",
    )
    view = View(table(instance("old", READY), new), busy=busy)
    coordinator, _ = build(view)
    asyncio.run(coordinator.retire_superseded())
    assert ("old" not in view.instances) is retired


# -- placing again -----------------------------------------------------------------------


def test_an_instance_that_failed_too_often_is_not_placed_again():
    view = View(table(instance("x", FAILED, retries=4)), max_replacements=3)
    coordinator, recorder = build(view)
    asyncio.run(coordinator.replace("x", wait=False))
    assert any(isinstance(e, NotPlacedAgain) for e in recorder.committed)
    assert view.instances["x"].given_up


def test_a_node_that_stopped_coordinating_places_nothing_again():
    view = View(table(instance("x", FAILED)), acting=False)
    coordinator, recorder = build(view)
    asyncio.run(coordinator.replace("x", wait=False))
    assert recorder.committed == [] and coordinator.replacing == set()
