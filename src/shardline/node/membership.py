"""A node's membership rounds: polling its peers, settling, and starting a coordinator's
term (the rules: :mod:`shardline.node.epochs`). The role holds the election's
state (the term it acts in, the last round, when it settled, the peers unheard or that
refused the key); it reads the node through :class:`MembershipView` and changes it
through :class:`MembershipEffects` (``shardline.node.node`` wires both)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from shardline.node.epochs import Epoch, heard_majority, heard_whole_cluster, newer, next_term, paused, settled
from shardline.node.peer_client import KeyRefusedError, PeerError
from shardline.node.state import ClusterState, TermStarted
from shardline.node.status import InstanceStatus
from shardline.node.table import Instance, Peer
from shardline.node.wire import NodeInfo

log = logging.getLogger(__name__)

POLL_S = 1.0
"""Seconds between membership rounds (each polls every peer's ``/internal/info``)."""
PEER_SILENT_S = 10.0
"""A peer given by ``--peers`` that has not answered this long after the node started is
warned of, once (a wrong address or port, or no node there)."""
STARTUP_POLL_S = 0.2
"""Seconds between rounds until the node is settled (at most the election window)."""
SPARE_IDLE_S = 3.0
"""A pre-started runner is started again once no rank of the node has loaded or served for
this long (``shardline.node.runner_processes``): not while a load or a request needs the CPU."""


class MembershipView(Protocol):
    """What membership reads of its node (read-only)."""

    @property
    def node_id(self) -> str: ...
    @property
    def started_at(self) -> float: ...
    @property
    def down_after_s(self) -> float: ...
    @property
    def rejoin(self) -> bool: ...
    @property
    def peer_addresses(self) -> list[str]: ...
    @property
    def peers(self) -> Mapping[str, Peer]: ...
    @property
    def epoch(self) -> Epoch: ...
    @property
    def instances(self) -> Mapping[str, Instance]: ...
    def live_node_ids(self) -> list[str]: ...
    def coordinator_id(self) -> str: ...
    def busy_instances(self) -> list[str]: ...


@dataclass(frozen=True)
class MembershipEffects:
    """What membership asks of the node and the other roles."""

    fetch_info: Callable[[str], Awaitable[NodeInfo]]
    """A peer's ``/internal/info`` (raises ``PeerError``, ``KeyRefusedError``)."""
    fetch_state: Callable[[str], Awaitable[ClusterState]]
    """A peer's table (raises ``PeerError``)."""
    record_peer: Callable[[Peer], None]
    """Keep what a peer answered (the node's peers)."""
    add_peer: Callable[[str], None]
    """Poll this address from now on."""
    adopt: Callable[[ClusterState], Awaitable[bool]]
    """Adopt a newer table (``Node.apply_state``)."""
    probe_link: Callable[[str, str], None]
    """Measure the link to this node id at this address, unless measured lately."""
    enter_term: Callable[[TermStarted], None]
    """Apply a term's start to the table (published next)."""
    publish: Callable[[], Awaitable[None]]
    """Publish the table (a coordinator) and reconcile the runners."""
    place_again: Callable[[str], None]
    """Place a failed instance again, in the background (the coordinator)."""
    coordinate: Callable[[], Awaitable[None]]
    """The coordinator's duties of a round (fail lost instances, rejoin, retire)."""
    report_stale: Callable[[], Awaitable[None]]
    """Report again the ranks whose status the table has wrong (the supervisor)."""
    loading: Callable[[], bool]
    """Whether a runner of this node is loading."""
    when_idle: Callable[[], Awaitable[None]]
    """What the node does once idle (warm tokenizers, start a spare runner)."""


class Membership:
    """The membership role of a node: the rounds, and the election's state."""

    def __init__(
        self, view: MembershipView, effects: MembershipEffects, clock: Callable[[], float] = time.time
    ) -> None:
        self.view = view
        self.effects = effects
        self.clock = clock
        self.acting_term: int | None = None  # the term this node coordinates, if it does
        self.left_term = 0  # the greatest term of a table it held and gave up (a minority's)
        self.settled_since = view.started_at  # start, or resumption from a pause
        self.heard_all_at: float | None = None  # the last round every peer answered
        self.last_tick = view.started_at
        self.busy_at = float("-inf")  # when a rank here last loaded or served
        # the given peers that have not answered yet: warned of once (PEER_SILENT_S)
        self.unheard_peers = set(view.peer_addresses)
        self.refused: set[str] = set()  # peer addresses that refused our cluster key

    # -- the election's state, read ------------------------------------------------------

    def is_coordinator(self) -> bool:
        """Whether this node acts as coordinator: the smallest live id, settled, in a term
        it started."""
        return self.view.coordinator_id() == self.view.node_id and self.acting_term is not None

    def is_settled(self) -> bool:
        """Whether this node has heard the cluster for an election window since it
        started or resumed (epochs rule 3)."""
        return settled(self.clock(), self.settled_since, self.view.down_after_s, self.heard_all_at)

    def named_nodes(self) -> set[str]:
        """The nodes the table held names: its instances' and the ones they want."""
        return {n for i in self.view.instances.values() for n in (*i.node_ids(), *i.wanted_nodes)}

    def hears_majority(self) -> bool:
        """Whether the live nodes are a majority of the nodes known: every node heard since
        this one started, those its table names, itself (epochs rule 4)."""
        return heard_majority(self.view.live_node_ids(), {*self.view.peers, *self.named_nodes()})

    def adopted(self, held_term: int, coordinator: str) -> None:
        """The node gave up its table of ``held_term`` for a newer one of ``coordinator``'s
        (``Node.apply_state``)."""
        # a minority's newer term, given up for a majority's older one: never started again
        self.left_term = max(self.left_term, held_term)
        if self.acting_term is not None and coordinator != self.view.node_id:
            # Another coordinator's newer table: this node coordinated out of touch with
            # it (a minority, cut off), and its peers' liveness is as old as the cut.
            # Start over, and hear the whole cluster (or wait the window) before a term
            # of its own: CI saw a returning coordinator fail the majority's serving
            # instance for a node it had not heard again yet.
            self.acting_term = None
            self.settled_since = self.clock()

    # -- the rounds ----------------------------------------------------------------------

    async def run(self) -> None:
        """The membership rounds, until the node stops (:meth:`round`): every second;
        faster until settled, so that a cluster starting together elects its coordinator
        as soon as every peer listens."""
        self.last_tick = self.clock()  # the time since construction (a busy start) is no pause
        while True:
            await self.round()
            await asyncio.sleep(POLL_S if self.is_settled() else STARTUP_POLL_S)

    async def round(self) -> None:
        """One round: poll every peer, settle, start a term where this node should
        coordinate, then the coordinator's and every node's periodic duties."""
        view, effects = self.view, self.effects
        now = self.clock()
        if paused(now, self.last_tick, view.down_after_s):
            log.warning(
                "this node was paused for %.0f s: it hears the cluster again before it acts as coordinator",
                now - self.last_tick,
            )
            self.settled_since, self.acting_term = now, None
        self.last_tick = now
        answered = await asyncio.gather(*(self.poll(a) for a in view.peer_addresses))
        self.last_tick = self.clock()
        if heard_whole_cluster(answered, view.live_node_ids(), self.named_nodes()):
            self.heard_all_at = self.last_tick
        if view.coordinator_id() != view.node_id:
            self.acting_term = None
        elif self.acting_term is None and self.is_settled():
            await self.start_term()
        elif self.is_coordinator() and not view.epoch.majority and self.hears_majority():
            await self.start_term()  # a minority's term, now heard by a majority (rule 4)
        if self.is_coordinator():
            await effects.coordinate()
        await effects.report_stale()
        if view.busy_instances() or effects.loading():
            self.busy_at = self.clock()
        elif self.clock() - self.busy_at >= SPARE_IDLE_S:
            await effects.when_idle()

    async def start_term(self) -> None:
        """Become coordinator: a term above every one seen (epochs rule 2), marked by
        whether it hears a majority (rule 4), then fail the instances whose ranks are
        gone, and publish."""
        view = self.view
        given_up = Epoch(self.left_term, 0, "")
        term = next_term(view.epoch, [given_up, *(p.epoch for p in view.peers.values())])
        majority = self.hears_majority()
        self.effects.enter_term(TermStarted(term, view.node_id, majority))
        self.acting_term = term
        log.info(
            "coordinator for term %d%s",
            term,
            "" if majority else " (heard by a minority of the nodes it knows: a majority's table wins over it)",
        )
        # failed before this term (perhaps while no node coordinated): placed again. Taken
        # before publishing: one that fails while this publishes is placed again by its
        # own failure.
        failed = [i for i in view.instances.values() if i.status == InstanceStatus.FAILED]
        await self.effects.publish()
        for inst in failed:
            self.effects.place_again(inst.instance_id)

    async def poll(self, address: str) -> bool:
        """Ask a peer for its info (and a newer table, when it holds one); whether it
        answered as a member."""
        view, effects = self.view, self.effects
        try:
            info = await effects.fetch_info(address)
        except KeyRefusedError as exc:
            if address not in self.refused:
                self.refused.add(address)
                log.warning("%s: it belongs to another cluster", exc)
            return False
        except PeerError:  # down, or not a node of this version
            if address in self.unheard_peers and self.clock() - view.started_at >= PEER_SILENT_S:
                self.unheard_peers.discard(address)
                log.warning(
                    "peer %s (--peers) has not answered in %.0f s: check its address and "
                    "port, and that a node runs there",
                    address,
                    PEER_SILENT_S,
                )
            return False
        self.unheard_peers.discard(address)
        self.refused.discard(address)
        effects.record_peer(
            Peer(
                info.node_id,
                info.address,
                self.clock(),
                info.available_bytes,
                info.total_bytes,
                info.profile,
                info.links,
                info.models,
                offered_bytes=info.offered_bytes,
                started_at=info.started_at,
                epoch=info.epoch,
                busy=tuple(info.busy),
                served=info.served,
            )
        )
        for member in info.members:  # membership both ways, through any member
            effects.add_peer(member)
        effects.probe_link(info.node_id, address)
        if newer(info.epoch, view.epoch):  # the newest table wins, whoever holds it (rule 4)
            try:
                await effects.adopt(await effects.fetch_state(address))
            except PeerError:
                return False
        return True
