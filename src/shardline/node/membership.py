"""A node's membership rounds: polling its peers, settling, and starting a coordinator's
term (the rules: :mod:`shardline.node.cluster_state`; what a node knows of its peers and
whom it takes for coordinator: :class:`shardline.node.node.Node`)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from shardline.node.cluster_state import Epoch, heard_whole_cluster, newer, next_term, paused
from shardline.node.peer_client import KeyRefusedError, PeerError
from shardline.node.state import TermStarted, apply
from shardline.node.status import InstanceStatus
from shardline.node.table import Peer

if TYPE_CHECKING:
    from shardline.node.node import Node

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
this long (``shardline.node.worker``): not while a load or a request needs the CPU."""


class Membership:
    """The membership role of ``node`` (its state stays on the node)."""

    def __init__(self, node: "Node") -> None:
        self.node = node

    async def run(self) -> None:
        """The membership rounds, until the node stops: poll every peer, settle, start a
        term where this node should coordinate, then the coordinator's and every node's
        periodic duties."""
        node = self.node
        while True:
            now = time.time()
            if paused(now, node._last_tick, node.down_after_s):
                log.warning("this node was paused for %.0f s: it hears the cluster again "
                            "before it acts as coordinator", now - node._last_tick)
                node._settled_since, node._acting_term = now, None
            node._last_tick = now
            answered = await asyncio.gather(*(self.poll(a) for a in node.peer_addresses))
            node._last_tick = time.time()
            named = node._named_nodes()
            if heard_whole_cluster(answered, node.live_node_ids(), named):
                node._heard_all_at = node._last_tick
            if node.coordinator_id() != node.node_id:
                node._acting_term = None
            elif node._acting_term is None and node.is_settled():
                await self.start_term()
            elif node.is_coordinator() and not node.epoch.majority and node.hears_majority():
                await self.start_term()  # a minority's term, now heard by a majority (rule 4)
            if node.is_coordinator():
                await node.coordinator._fail_lost_instances()
                if node.rejoin:
                    await node.coordinator._rejoin_returned_nodes()
                await node.coordinator._retire_superseded()
            await node.supervisor._report_unknown_statuses()
            if node.busy_instances() or node.worker.loading():
                node._busy_at = time.time()
            elif time.time() - node._busy_at >= SPARE_IDLE_S:
                for model_id in {i.model_id for i in node.instances.values() if node.node_id in i.node_ids()}:
                    node.logistics.warm_tokenizer(model_id)
                await asyncio.to_thread(node.worker.start_spare)
            # every second; faster until settled, so that a cluster starting together
            # elects its coordinator as soon as every peer listens
            await asyncio.sleep(POLL_S if node.is_settled() else STARTUP_POLL_S)

    async def start_term(self) -> None:
        """Become coordinator: a term above every one seen (cluster_state rule 2), marked by
        whether it hears a majority (rule 4), then fail the instances whose ranks are
        gone, and publish."""
        node = self.node
        given_up = Epoch(node._left_term, 0, "")
        term = next_term(node.epoch, [given_up, *(p.epoch for p in node.peers.values())])
        majority = node.hears_majority()
        node.cluster_state = apply(node.cluster_state, TermStarted(term, node.node_id, majority))
        node._acting_term = term
        log.info("coordinator for term %d%s", term, "" if majority else
                 " (heard by a minority of the nodes it knows: a majority's table wins over it)")
        # failed before this term (perhaps while no node coordinated): placed again. Taken
        # before publishing: one that fails while this publishes is placed again by its
        # own failure.
        failed = [i for i in node.instances.values() if i.status == InstanceStatus.FAILED]
        await node._publish()
        for inst in failed:
            node.background(node.coordinator._replace(inst.instance_id))

    async def poll(self, address: str) -> bool:
        """Ask a peer for its info (and a newer table, when it holds one); whether it
        answered as a member."""
        node = self.node
        try:
            info = await node.peer_client.info(address)
        except KeyRefusedError as exc:
            if address not in node._refused:
                node._refused.add(address)
                log.warning("%s: it belongs to another cluster", exc)
            return False
        except PeerError:  # down, or not a node of this version
            if address in node._unheard_peers and time.time() - node.started_at >= PEER_SILENT_S:
                node._unheard_peers.discard(address)
                log.warning("peer %s (--peers) has not answered in %.0f s: check its address and "
                            "port, and that a node runs there", address, PEER_SILENT_S)
            return False
        node._unheard_peers.discard(address)
        node._refused.discard(address)
        node.peers[info.node_id] = Peer(
            info.node_id, info.address, time.time(), info.available_bytes, info.total_bytes,
            info.profile, info.links, info.models, offered_bytes=info.offered_bytes,
            started_at=info.started_at, epoch=info.epoch, busy=tuple(info.busy),
            served=info.served,
        )
        for member in info.members:  # membership both ways, through any member
            node.add_peer(member)
        if node.link_meter.claim(info.node_id, time.time()):
            node.background(node.link_meter.measure(info.node_id, address))
        if newer(info.epoch, node.epoch):  # the newest table wins, whoever holds it (rule 4)
            try:
                await node.apply_state(await node.peer_client.state(address))
            except PeerError:
                return False
        return True
