"""The membership role (:mod:`shardline.node.membership`) built alone: a plain view of the
node and recording callbacks, no cluster and no node. A poll's outcome, a round's
election (pause, settling, terms) and the election's state, by table."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from shardline.models.config import RankShare, Sharding
from shardline.node.epochs import NO_EPOCH, Epoch
from shardline.node.membership import PEER_SILENT_S, SPARE_IDLE_S, Membership, MembershipEffects
from shardline.node.peer_client import KeyRefusedError, PeerError
from shardline.node.state import ClusterState, TermStarted
from shardline.node.status import InstanceStatus
from shardline.node.table import Instance, Peer, RankPlacement
from shardline.node.wire import NodeInfo

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]

T0 = 1000.0  # the node's start


@dataclass
class View:
    """What membership reads: plain values."""

    node_id: str = "b"
    started_at: float = T0
    down_after_s: float = 5.0
    rejoin: bool = True
    peer_addresses: list[str] = field(default_factory=list)
    peers: dict[str, Peer] = field(default_factory=dict)
    epoch: Epoch = NO_EPOCH
    instances: dict[str, Instance] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)  # the live peers' ids
    busy: list[str] = field(default_factory=list)

    def live_node_ids(self) -> list[str]:
        return sorted([*self.live, self.node_id])

    def coordinator_id(self) -> str:
        return self.live_node_ids()[0]

    def busy_instances(self) -> list[str]:
        return self.busy


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Recorder:
    """Callbacks that record what membership asks, answering from ``answers``."""

    def __init__(
        self,
        view: View,
        answers: dict[str, object] | None = None,
        theirs: ClusterState | None = None,
        loading: bool = False,
    ) -> None:
        self.view, self.answers, self.theirs, self.is_loading = view, answers or {}, theirs, loading
        self.calls: list[tuple] = []

    def effects(self) -> MembershipEffects:
        async def fetch_info(address: str) -> NodeInfo:
            answer = self.answers[address]
            if isinstance(answer, BaseException):
                raise answer
            assert isinstance(answer, NodeInfo)
            return answer

        async def fetch_state(address: str) -> ClusterState:
            self.calls.append(("fetch_state", address))
            if self.theirs is None:
                raise PeerError("gone")
            return self.theirs

        async def adopt(state: ClusterState) -> bool:
            self.calls.append(("adopt", state.epoch))
            return True

        def record_peer(peer: Peer) -> None:
            self.view.peers[peer.node_id] = peer
            self.calls.append(("record_peer", peer.node_id))

        def enter_term(event: TermStarted) -> None:
            self.view.epoch = Epoch(event.term, 0, event.coordinator, event.majority)
            self.calls.append(("enter_term", event.term, event.majority))

        async def publish() -> None:
            self.calls.append(("publish",))

        async def coordinate() -> None:
            self.calls.append(("coordinate",))

        async def report_stale() -> None:
            self.calls.append(("report_stale",))

        async def when_idle() -> None:
            self.calls.append(("when_idle",))

        return MembershipEffects(
            fetch_info=fetch_info,
            fetch_state=fetch_state,
            record_peer=record_peer,
            add_peer=lambda address: self.calls.append(("add_peer", address)),
            adopt=adopt,
            probe_link=lambda node_id, address: self.calls.append(("probe_link", node_id)),
            enter_term=enter_term,
            publish=publish,
            place_again=lambda instance_id: self.calls.append(("place_again", instance_id)),
            coordinate=coordinate,
            report_stale=report_stale,
            loading=lambda: self.is_loading,
            when_idle=when_idle,
        )

    def named(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


def info(node_id: str, address: str, epoch: Epoch = NO_EPOCH, members: tuple[str, ...] = ()) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        address=address,
        started_at=T0,
        available_bytes=1,
        offered_bytes=1,
        committed_bytes=0,
        free_bytes=1,
        total_bytes=2,
        memory_limit_bytes=None,
        models={},
        epoch=epoch,
        coordinator=node_id,
        settled=True,
        profile=None,
        links={},
        members=list(members),
        busy=[],
    )


def instance(
    instance_id: str,
    nodes: tuple[str, ...],
    status: InstanceStatus = InstanceStatus.READY,
    wanted: tuple[str, ...] = (),
) -> Instance:
    ranks = tuple(RankPlacement(n, f"{n}:1", RankShare(i, i + 1)) for i, n in enumerate(nodes))
    return Instance(instance_id, "m", Sharding.PIPELINE, ranks, nodes[0], 1, 64, 1, status=status, wanted_nodes=wanted)


def peer(node_id: str, epoch: Epoch = NO_EPOCH) -> Peer:
    return Peer(node_id, f"{node_id}:1", T0, epoch=epoch)


def build(
    view: View, recorder: Recorder | None = None, clock: Clock | None = None
) -> tuple[Membership, Recorder, Clock]:
    recorder = recorder or Recorder(view)
    clock = clock or Clock()
    return Membership(view, recorder.effects(), clock=clock), recorder, clock


# -- a poll ------------------------------------------------------------------------------


def test_a_peer_that_answers_is_recorded_its_members_added_and_its_link_probed():
    view = View(peer_addresses=["a:1"])
    membership, recorder, _ = build(view, Recorder(view, {"a:1": info("a", "a:1", members=("c:1", "b:1"))}))
    assert asyncio.run(membership.poll("a:1")) is True
    assert recorder.calls == [("record_peer", "a"), ("add_peer", "c:1"), ("add_peer", "b:1"), ("probe_link", "a")]
    assert view.peers["a"].last_seen == T0 and "a:1" not in membership.unheard_peers


@pytest.mark.parametrize(
    "theirs, mine, fetched, answered",
    [
        (Epoch(2, 1, "a", True), Epoch(1, 5, "b", True), True, True),  # newer: fetched and adopted
        (Epoch(1, 5, "b", True), Epoch(1, 5, "b", True), False, True),  # the same: not fetched
        (Epoch(3, 1, "a", False), Epoch(1, 1, "b", True), False, True),  # a minority's: older
        (Epoch(2, 1, "a", True), NO_EPOCH, True, True),
    ],
)
def test_a_newer_table_is_fetched_and_adopted(theirs, mine, fetched, answered):
    view = View(peer_addresses=["a:1"], epoch=mine)
    state = ClusterState(epoch=theirs)
    membership, recorder, _ = build(view, Recorder(view, {"a:1": info("a", "a:1", epoch=theirs)}, theirs=state))
    assert asyncio.run(membership.poll("a:1")) is answered
    assert recorder.named("adopt") == ([("adopt", theirs)] if fetched else [])


def test_a_peer_whose_table_cannot_be_fetched_did_not_answer():
    view = View(peer_addresses=["a:1"])
    membership, recorder, _ = build(view, Recorder(view, {"a:1": info("a", "a:1", epoch=Epoch(1, 1, "a"))}))
    assert asyncio.run(membership.poll("a:1")) is False
    assert recorder.named("fetch_state") == [("fetch_state", "a:1")] and not recorder.named("adopt")


def test_a_peer_of_another_cluster_is_warned_of_once_until_it_answers(caplog):
    view = View(peer_addresses=["a:1"])
    membership, recorder, _ = build(view, Recorder(view, {"a:1": KeyRefusedError("a:1: 401")}))
    for _ in range(3):
        assert asyncio.run(membership.poll("a:1")) is False
    assert membership.refused == {"a:1"}
    assert sum("another cluster" in r.message for r in caplog.records) == 1
    recorder.answers["a:1"] = info("a", "a:1")
    assert asyncio.run(membership.poll("a:1")) is True and membership.refused == set()


@pytest.mark.parametrize("after_s, warned", [(PEER_SILENT_S - 1, False), (PEER_SILENT_S, True)])
def test_a_given_peer_silent_since_the_start_is_warned_of_once(caplog, after_s, warned):
    view = View(peer_addresses=["a:1"])
    membership, _, clock = build(view, Recorder(view, {"a:1": PeerError("down")}))
    clock.now = T0 + after_s
    assert asyncio.run(membership.poll("a:1")) is False
    asyncio.run(membership.poll("a:1"))
    assert sum("has not answered" in r.message for r in caplog.records) == (1 if warned else 0)
    assert ("a:1" in membership.unheard_peers) is not warned


# -- the election's state ----------------------------------------------------------------


@pytest.mark.parametrize(
    "node_id, live, acting, coordinator",
    [
        ("a", {"b"}, 1, True),
        ("a", {"b"}, None, False),  # the smallest id, but no term started
        ("b", {"a"}, 1, False),  # a smaller id is live
        ("b", set(), 3, True),  # alone
    ],
)
def test_who_acts_as_coordinator(node_id, live, acting, coordinator):
    membership, _, _ = build(View(node_id=node_id, live=live))
    membership.acting_term = acting
    assert membership.is_coordinator() is coordinator


@pytest.mark.parametrize(
    "now, heard_all_at, is_settled",
    [
        (T0 + 1, None, False),
        (T0 + 5, None, True),  # the election window passed
        (T0 + 1, T0 + 0.5, True),  # heard the whole cluster since it started
        (T0 + 1, T0, False),  # not since: heard before (at) the start
    ],
)
def test_settled(now, heard_all_at, is_settled):
    membership, _, clock = build(View())
    clock.now, membership.heard_all_at = now, heard_all_at
    assert membership.is_settled() is is_settled


@pytest.mark.parametrize(
    "live, peers, instances, majority",
    [
        (set(), (), {}, True),  # alone, knowing nobody
        ({"a"}, ("a", "c"), {}, True),  # 2 of 3
        (set(), ("a",), {}, False),  # 1 of 2
        ({"a"}, ("a",), {"x": instance("x", ("a", "c", "d"))}, False),  # the table names c, d: 2 of 4
        ({"a"}, ("a",), {"x": instance("x", ("a",), wanted=("e", "f", "g"))}, False),  # wanted too
    ],
)
def test_hears_a_majority(live, peers, instances, majority):
    view = View(live=live, peers={p: peer(p) for p in peers}, instances=instances)
    membership, _, _ = build(view)
    assert membership.hears_majority() is majority


@pytest.mark.parametrize(
    "acting, coordinator, held, left_before, acting_after, left_after, resettled",
    [
        (4, "a", 4, 0, None, 4, True),  # its own term given up for another's: settles again
        (4, "b", 4, 0, 4, 4, False),  # its own table (published by itself): goes on
        (None, "a", 2, 3, None, 3, False),  # not coordinating: the greatest term given up kept
        (None, "a", 5, 3, None, 5, False),
    ],
)
def test_adopting_a_table(acting, coordinator, held, left_before, acting_after, left_after, resettled):
    membership, _, clock = build(View(node_id="b"))
    membership.acting_term, membership.left_term = acting, left_before
    clock.now = T0 + 50
    membership.adopted(held, coordinator)
    assert (membership.acting_term, membership.left_term) == (acting_after, left_after)
    assert membership.settled_since == (T0 + 50 if resettled else T0)


# -- terms -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mine, left, peer_terms, term",
    [
        (NO_EPOCH, 0, (), 1),
        (Epoch(3, 7, "a", True), 0, (1,), 4),  # above its own
        (Epoch(1, 1, "a", True), 0, (5, 2), 6),  # above every peer's
        (Epoch(1, 1, "a", True), 8, (5,), 9),  # above a minority's term it gave up
    ],
)
def test_a_term_starts_above_every_term_seen(mine, left, peer_terms, term):
    view = View(
        node_id="a", epoch=mine, peers={f"p{i}": peer(f"p{i}", Epoch(t, 1, f"p{i}")) for i, t in enumerate(peer_terms)}
    )
    membership, recorder, _ = build(view)
    membership.left_term = left
    asyncio.run(membership.start_term())
    assert membership.acting_term == term
    assert recorder.calls[0][:2] == ("enter_term", term) and recorder.calls[1] == ("publish",)


def test_a_new_term_places_the_failed_instances_again_after_publishing():
    view = View(node_id="a", instances={"x": instance("x", ("a",), InstanceStatus.FAILED), "y": instance("y", ("a",))})
    membership, recorder, _ = build(view)
    asyncio.run(membership.start_term())
    assert [c[0] for c in recorder.calls] == ["enter_term", "publish", "place_again"]
    assert recorder.named("place_again") == [("place_again", "x")]


# -- a round -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "node_id, live, answers, acting, settled_since, started, coordinates",
    [
        ("a", set(), {}, None, T0 - 10, True, True),  # alone and settled: a term, then its duties
        ("a", set(), {}, None, T0, True, True),  # no peer to hear: settles at once
        ("b", {"a"}, {"a:1": "a"}, None, T0 - 10, False, False),  # a smaller id is live
        ("b", {"a"}, {"a:1": "a"}, 2, T0 - 10, False, False),  # ... and it stops acting
        ("a", {"b"}, {"b:1": "b"}, None, T0, True, True),  # heard the whole cluster: settles at once
        ("a", {"b"}, {"b:1": PeerError("down")}, None, T0, False, False),  # a peer did not answer
    ],
)
def test_a_rounds_election(node_id, live, answers, acting, settled_since, started, coordinates):
    view = View(node_id=node_id, live=live, peer_addresses=list(answers))
    answers = {a: info(n, a) if isinstance(n, str) else n for a, n in answers.items()}
    membership, recorder, clock = build(view, Recorder(view, answers))
    membership.acting_term, membership.settled_since = acting, settled_since
    clock.now = T0 + 1
    membership.last_tick = T0 + 0.5
    asyncio.run(membership.round())
    assert bool(recorder.named("enter_term")) is started
    assert bool(recorder.named("coordinate")) is coordinates
    if node_id != view.coordinator_id():
        assert membership.acting_term is None
    assert recorder.calls[-2:] == [("report_stale",), ("when_idle",)]


def test_a_minoritys_term_heard_by_a_majority_starts_again():
    view = View(
        node_id="a",
        live={"b"},
        peer_addresses=["b:1"],
        epoch=Epoch(3, 2, "a", False),
        peers={"b": peer("b"), "c": peer("c")},
    )
    membership, recorder, clock = build(view, Recorder(view, {"b:1": info("b", "b:1")}))
    membership.acting_term, membership.last_tick, clock.now = 3, T0, T0 + 1
    asyncio.run(membership.round())
    assert recorder.named("enter_term") == [("enter_term", 4, True)] and membership.acting_term == 4


@pytest.mark.parametrize("gap_s, resettled", [(4.0, False), (6.0, True)])
def test_a_pause_longer_than_the_window_gives_up_coordinating(gap_s, resettled):
    view = View(node_id="b", live={"a"}, peer_addresses=["a:1"])
    membership, _, clock = build(view, Recorder(view, {"a:1": PeerError("down")}))
    membership.acting_term, membership.last_tick = 2, T0
    clock.now = T0 + gap_s
    asyncio.run(membership.round())
    assert (membership.settled_since == T0 + gap_s) is resettled
    assert membership.last_tick == T0 + gap_s


@pytest.mark.parametrize(
    "busy, loading, idle_for_s, idle",
    [
        ([], False, SPARE_IDLE_S, True),
        ([], False, SPARE_IDLE_S - 1, False),  # not idle long enough
        (["x"], False, 100.0, False),  # requests on a rank here
        ([], True, 100.0, False),  # a runner loading
    ],
)
def test_idle_work_waits_for_an_idle_node(busy, loading, idle_for_s, idle):
    view = View(node_id="b", live={"a"}, busy=busy)
    membership, recorder, clock = build(view, Recorder(view, loading=loading))
    clock.now = T0 + 100
    membership.last_tick, membership.busy_at = clock.now, clock.now - idle_for_s
    asyncio.run(membership.round())
    assert bool(recorder.named("when_idle")) is idle
    assert (membership.busy_at == clock.now) is (bool(busy) or loading)
