"""Which replicated instance table wins, and who may publish one: pure functions.

The coordinator (the live, settled node with the smallest id) publishes the instance table
to every node; each publication carries an :class:`Epoch`. The rules, and the invariants
they keep:

1. A node adopts a table only if its epoch is newer than the node's own (:func:`newer`),
   and keeps the epoch of what it adopted or published on disk: a node's epoch never
   goes back, across restarts too.
2. A node that becomes coordinator starts a new term (:func:`next_term`), greater than
   every term it has seen (its own, persisted, a minority's it gave up for a majority's
   older one, and its peers'), and publishes only in it.
   Anything a former coordinator publishes afterwards carries an older term and is
   refused, so a paused or restarted coordinator cannot overwrite the newer table; a
   forged state of an older term is refused the same way.
3. A node acts as coordinator only once it is settled (:func:`settled`): since it
   started or resumed from a pause, every peer answered a membership round and every node
   its own table names was among them (:func:`heard_whole_cluster`; a newer table, if a
   peer had one, was adopted in that round) or an election window passed, so a returning
   node first learns (and adopts) the newer term's table.
4. Two sides of a partition may each start a term; when it heals, every node adopts the
   table of the greatest epoch, and the coordinator then starts a term above it: the
   cluster converges on one table. Epochs are ordered by whether their term was
   started by a coordinator that heard a majority of the nodes it knows
   (:func:`heard_majority`), then term, sequence and coordinator id: a total order. A
   node cut off alone starts a newer term (so that it serves on its own, placing again
   what it can), but its table loses to the majority's older term when the partition
   heals (trial 6: the one node's table won, and the two nodes' serving instance was
   dropped). A coordinator in a minority's term that hears a majority again starts a
   term above it. A table loaded from disk after a restart counts as a minority's: the
   nodes that served on while this one was down hold the newer truth.
5. Ranks do not survive their node: a rank whose node restarted since the instance was
   placed (its incarnation, the node's start time, changed) is lost, and the coordinator
   fails and places again every instance with a lost rank (:func:`lost_instances`), when
   it starts a term and whenever it sees a node come back.
6. An instance placed again on other nodes than before (some or all were down)
   remembers the nodes it wanted; when they are all live again, the coordinator places
   it on them again (:func:`rejoinable`), so a returning node gets its share back:
   beside the serving one where both fit (which serves until the new one is ready and
   then, once idle, is deleted: ``state.superseded``), else in its place once it is
   idle.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shardline.node.status import InstanceStatus


@functools.total_ordering
@dataclass(frozen=True)
class Epoch:
    """When a table was published: ``term`` (one per coordinator's tenure), ``seq`` (its
    publications in that term, from 1), the publishing ``coordinator``'s id (which
    orders two tables of one term from two sides of a partition) and whether that
    coordinator heard a ``majority`` of the nodes it knew when it started the term (rule
    4; fixed for the term, so that each publication of a term is newer than the last).
    Ordered by ``(majority, term, seq, coordinator)``."""

    term: int
    seq: int
    coordinator: str
    majority: bool = False

    def key(self) -> tuple[bool, int, int, str]:
        """The order of epochs (rule 4)."""
        return (self.majority, self.term, self.seq, self.coordinator)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Epoch):
            return NotImplemented
        return self.key() < other.key()

    def to_dict(self) -> dict:
        return {"term": self.term, "seq": self.seq, "coordinator": self.coordinator, "majority": self.majority}

    def next(self) -> "Epoch":
        """The next publication in this term."""
        return dataclasses.replace(self, seq=self.seq + 1)

    def from_disk(self) -> "Epoch":
        """This epoch as a restarted node holds it: a minority's (rule 4)."""
        return dataclasses.replace(self, majority=False)


NO_EPOCH = Epoch(0, 0, "")
"""The epoch of a node that has held no published table: older than every one."""


def newer(theirs: Epoch, mine: Epoch) -> bool:
    """Whether a table published at ``theirs`` replaces one held at ``mine``."""
    return theirs > mine


def heard_majority(heard: Iterable[str], known: Iterable[str]) -> bool:
    """Whether the nodes a coordinator hears (``heard``: live peers' ids and its own) are
    more than half of the nodes it knows (``known``: every node heard since it started,
    those its table names, itself). Two nodes cut apart are each a minority: the newer
    term wins, as before this rule (rule 4)."""
    members = set(known) | set(heard)
    return 2 * len(set(heard)) > len(members)


def next_term(own: Epoch, seen: Iterable[Epoch]) -> int:
    """The term a new coordinator starts: above its own and every term it has seen."""
    return max([own.term, *(e.term for e in seen)]) + 1


def settled(now: float, since: float, window_s: float, heard_all_at: float | None) -> bool:
    """Whether a node that started (or resumed from a pause) at ``since`` has heard the
    cluster by ``now`` (seconds): a whole membership round in which every peer answered
    (at ``heard_all_at``; None: none yet) after ``since``, or else the election window
    ``window_s`` (a peer that does not answer may be restarting)."""
    return now - since >= window_s or (heard_all_at is not None and heard_all_at > since)


def heard_whole_cluster(answered: Iterable[bool], heard: Iterable[str], named: Iterable[str]) -> bool:
    """Whether a membership round heard the whole cluster (rule 3): every peer address
    polled ``answered`` as a member, and the nodes heard (``heard``: live peers' ids, this
    node's own) include every node its own table names (``named``: the nodes of its
    instances, wanted ones too). A node restarted with an empty peer list (mDNS finds its
    peers a moment later) has heard nobody: its table names the nodes it waits for (trial
    5: such a node became coordinator with its old table and failed the cluster's serving
    instance). A node whose table names no other node (a new cluster) waits for nobody.
    """
    return all(answered) and set(named) <= set(heard)


def paused(now: float, last_tick: float, window_s: float) -> bool:
    """Whether the gap since the node's last membership round (``last_tick``) means it
    was paused (a stopped process, a sleeping laptop): longer than the window."""
    return now - last_tick > window_s


def lost_instances(
    ranks: Mapping[str, Iterable[tuple[str, float]]], incarnations: Mapping[str, float]
) -> dict[str, list[str]]:
    """Instances with a rank whose node restarted since the placement, and those nodes.

    Args:
        ranks: instance id -> ``(node id, the node's incarnation when placed)`` per rank
            (0.0: not recorded, never lost by this rule).
        incarnations: node id -> its incarnation now (its start time), for the nodes
            heard from; a node not heard from is judged by liveness elsewhere.

    Returns:
        instance id -> the ids of its restarted nodes, for the lost instances, in
        ``ranks``' order.
    """
    lost = {}
    for instance_id, placed in ranks.items():
        gone = [node for node, then in placed if then and node in incarnations and incarnations[node] != then]
        if gone:
            lost[instance_id] = gone
    return lost


@dataclass(frozen=True)
class RejoinView:
    """What :func:`rejoinable` needs of an instance: its ``status``, the nodes its ranks
    are on, the nodes it wanted (placed on before some were lost; empty: as placed),
    whether any node reports a request running or waiting on it, and whether an instance
    placed on its wanted nodes already stands in for it (``state.standing_in``)."""

    status: str
    nodes: tuple[str, ...]
    wanted: tuple[str, ...]
    busy: bool
    stood_in_for: bool = False


def rejoinable(instances: Mapping[str, RejoinView], live: Iterable[str]) -> list[str]:
    """The instances to place again on their wanted nodes (rule 6): ready, on other nodes
    than they wanted (fewer of them; or others, placed while none of them was live: an
    instance pinned to a node goes back to it), with every wanted node live, not already
    stood in for; busy ones too (the new one goes beside it; only where both do not fit does the coordinator
    wait until it is idle: trial 6 saw steady traffic keep a returned node out for as
    long as it lasted). In ``instances``' order."""
    up = set(live)
    return [
        instance_id
        for instance_id, view in instances.items()
        if view.status == InstanceStatus.READY
        and not view.stood_in_for
        and view.wanted
        and set(view.nodes) != set(view.wanted)
        and set(view.wanted) <= up
    ]
