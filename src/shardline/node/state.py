"""The replicated cluster state as one immutable value, the events that change it, the one
function that applies them, and the decisions read off it: pure code, no I/O.

A node holds a :class:`ClusterState` (the instance table and the :class:`Epoch` it was
published at). Every change is an event; :func:`apply` returns the next state and never
changes its input. Only the acting coordinator applies table events and publishes the
result; every other node adopts what it publishes (:class:`Adopted`, which keeps
``cluster_state``'s rule 1: only a newer epoch replaces a table). Effects (runners,
HTTP, timers) live in the roles that act on these values: the coordinator turns reports
and timeouts into events, and each node's supervisor starts and stops runners by
:func:`plan_runners`.

Invariants :func:`apply` keeps (tested by tables in tests/test_state.py):

1. A failed instance stays failed: no later report changes it (it is deleted when placed
   again).
2. An instance is ready only when every rank is ready, and ``ready_at`` is set once.
3. A rank that only lost contact with another (``peer_lost``) is stopped, not failed; the
   rank that failed is the one named in the instance's error.
4. When an instance fails, each rank is failed (its own failure, or its node down) or
   stopped: none is left loading or ready.
5. The epoch never goes back, but for a minority's term: a new term starts at sequence 0
   above the table's term, each publication is the next sequence, and an adopted table
   is newer; a term a minority starts ranks below a majority's table
   (``cluster_state`` rule 4), so that the majority's wins when a partition heals.

This follows the shape of exo's ``shared/apply.py`` (state in, event in, state out) and
``worker/plan.py`` (a node's plan read off the state), written for shardline's table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from shardline.models.config import Sharding
from shardline.node.epochs import NO_EPOCH, Epoch, lost_instances, newer
from shardline.node.status import InstanceStatus, RankStatus
from shardline.node.table import DELETED, EndCode, Instance


@dataclass(frozen=True)
class ClusterState:
    """The instance table (instance id -> :class:`Instance`) and the epoch it was
    published at. Treated as immutable: :func:`apply` builds a new one."""

    epoch: Epoch = NO_EPOCH
    instances: Mapping[str, Instance] = field(default_factory=dict)


REPLACED_KEPT = 16
"""How many ids of the instances it stands in for an instance keeps (the newest)."""


def replaced_ids(failed: Instance) -> tuple[str, ...]:
    """The ``replaced`` of an instance placed again for ``failed``: ``failed``'s own and
    those it stood in for, oldest first, the newest :data:`REPLACED_KEPT`."""
    return (*failed.replaced, failed.instance_id)[-REPLACED_KEPT:]


def sharding_again(failed: Instance, nodes: list[str] | None) -> Sharding:
    """The sharding ``failed`` is placed again under on ``nodes`` (its nodes still live;
    None: none is, any may be taken): its own, but a pipeline where a ring is left one
    node (a ring needs two; on one node a pipeline of one rank computes what a ring of
    one would), so its model, and the streams continued on it, go on."""
    if failed.sharding == Sharding.RING and nodes is not None and len(nodes) < 2:
        return Sharding.PIPELINE
    return Sharding(failed.sharding)


def standing_in(instances: Mapping[str, Instance]) -> dict[str, Instance]:
    """The instances still in the table, not failed, that another one stands in for (their
    id in its ``replaced``; that one not failed), each with the newest that does: an
    instance placed again on its returning nodes beside the one serving
    (make-before-break). (A failed instance's replacement deletes it itself.)"""
    successors: dict[str, Instance] = {}
    for inst in instances.values():
        if inst.status == InstanceStatus.FAILED:
            continue
        for old in inst.replaced:
            if (
                old in instances
                and old != inst.instance_id
                and instances[old].status != InstanceStatus.FAILED
                and (old not in successors or successors[old].created_at < inst.created_at)
            ):
                successors[old] = inst
    return successors


def stand_in_not_needed(instances: Mapping[str, Instance], failed: Instance) -> bool:
    """Whether ``failed``, a rejoin's instance placed beside a serving one
    (``stands_in_for``), is deleted rather than placed again: the one it stood in for is
    still in the table (serving, or failed and about to be placed again) or has been
    placed again already (its id in another's ``replaced``). Once the handover deleted
    the old one, the stand-in is the model's only line and is placed again as any."""
    old = failed.stands_in_for
    return old is not None and any(
        other.instance_id != failed.instance_id and (other.instance_id == old or old in other.replaced)
        for other in instances.values()
    )


def superseded(instances: Mapping[str, Instance]) -> set[str]:
    """The ids of the instances a ready one stands in for (:func:`standing_in`): requests
    go to the new one, and the coordinator deletes the old once it is idle."""
    return {old for old, new in standing_in(instances).items() if new.status == InstanceStatus.READY}


def instance_named(instances: Mapping[str, Instance], instance_id: str) -> Instance | None:
    """The instance ``instance_id`` names in a table: itself, else the newest instance
    placed again in its place (so an id a client was given when it placed a model keeps
    answering after its instance failed and was placed again under a new id); None
    when neither is in the table."""
    if instance_id in instances:
        return instances[instance_id]
    successors = [i for i in instances.values() if instance_id in i.replaced]
    return max(successors, key=lambda i: i.created_at, default=None)


def why_ended(instances: Mapping[str, Instance], instance_id: str) -> tuple[EndCode, str]:
    """Why the requests on ``instance_id`` end, read from a table in which it failed or
    is gone, and the error they are given: failed, its error
    (:attr:`EndCode.INSTANCE_FAILED`); gone, where another instance is in its place (its
    id in that one's ``replaced``: :func:`instance_named`), failed too (a node that missed
    the table in which it failed sees it gone; or handed over, deleted once idle, to one
    placed beside it; a request that had no output runs again, on a ready instance:
    :meth:`~shardline.node.routing.Router.generate`); gone, with none in its place,
    deleted (:attr:`EndCode.INSTANCE_DELETED`; a user's deletion deletes what stands in
    for it too)."""
    inst = instance_named(instances, instance_id)
    if inst is None:
        return EndCode.INSTANCE_DELETED, DELETED
    if inst.instance_id == instance_id:
        return EndCode.INSTANCE_FAILED, inst.error or "failed"
    return EndCode.INSTANCE_FAILED, f"gone; instance {inst.instance_id} was placed in its place"


# -- events ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placed:
    """A new instance (or one placed again under a new id)."""

    instance: Instance


@dataclass(frozen=True)
class Deleted:
    """An instance removed (by the user, or replaced by a new placement)."""

    instance_id: str


@dataclass(frozen=True)
class RankReported:
    """A node reports its rank of an instance: fetching files, ready or failed
    (``peer_lost``: it failed only because another rank went away). ``at``: when the
    report was taken (seconds since the epoch), the instance's ``ready_at``."""

    instance_id: str
    node_id: str
    status: RankStatus
    error: str | None = None
    loaded: dict | None = None
    fetched: dict | None = None
    peer_lost: bool = False
    at: float = 0.0


@dataclass(frozen=True)
class InstanceFailed:
    """The coordinator fails an instance: ranks on ``failed_nodes`` (down, restarted) are
    failed, the others stopped. ``at_once``: every node of the instance is live and its
    lost ranks died with a restart (heard since), so it is placed again at once rather
    than after a node may have been found down (``Coordinator._replace``)."""

    instance_id: str
    error: str
    failed_nodes: tuple[str, ...] = ()
    at_once: bool = False


@dataclass(frozen=True)
class NotPlacedAgain:
    """A failed instance could not be placed again, or the coordinator gave up on it after
    failed placements: its error says why, and it is marked ``given_up`` (requests stop
    waiting for it to be placed again; a later coordinator's term may still try)."""

    instance_id: str
    reason: str


@dataclass(frozen=True)
class RejoinDropped:
    """Placing an instance on its returning nodes was refused: it stops wanting them."""

    instance_id: str


@dataclass(frozen=True)
class KeptAlive:
    """Ollama's ``keep_alive`` set the instance's deadline: deleted once idle after
    ``until`` (``time.time()`` seconds, the coordinator's clock); None: kept for ever."""

    instance_id: str
    until: float | None


@dataclass(frozen=True)
class TermStarted:
    """``coordinator`` coordinates from now on, in ``term``, having heard a ``majority``
    of the nodes it knows, or not (``cluster_state`` rule 4)."""

    term: int
    coordinator: str
    majority: bool


@dataclass(frozen=True)
class Published:
    """The coordinator publishes the table: the next epoch of its term."""


@dataclass(frozen=True)
class Adopted:
    """A table another node published (adopted only if newer)."""

    state: ClusterState


Event = (
    Placed
    | Deleted
    | RankReported
    | InstanceFailed
    | NotPlacedAgain
    | RejoinDropped
    | KeptAlive
    | TermStarted
    | Published
    | Adopted
)


# -- apply -------------------------------------------------------------------------------


def _with(state: ClusterState, instance: Instance) -> ClusterState:
    return dataclasses.replace(state, instances={**state.instances, instance.instance_id: instance})


def _fail(inst: Instance, error: str, failed_nodes: tuple[str, ...]) -> Instance:
    """``inst`` failed with ``error`` (invariant 4)."""
    ranks = tuple(
        dataclasses.replace(r, status=RankStatus.FAILED)
        if r.node_id in failed_nodes
        else r
        if r.status == RankStatus.FAILED
        else dataclasses.replace(r, status=RankStatus.STOPPED)
        for r in inst.ranks
    )
    return dataclasses.replace(inst, status=InstanceStatus.FAILED, error=error, ranks=ranks)


def _reported(inst: Instance, event: RankReported) -> Instance:
    """``inst`` after its rank on ``event.node_id`` reported (invariants 2 and 3)."""
    ranks = []
    for rank in inst.ranks:
        if rank.node_id == event.node_id and not (
            event.status == RankStatus.FETCHING and rank.status == RankStatus.READY
        ):
            rank = dataclasses.replace(
                rank,
                status=RankStatus.STOPPED if event.peer_lost else event.status,
                error=event.error,
                loaded=event.loaded,
                fetched=event.fetched or rank.fetched,
            )
        ranks.append(rank)
    inst = dataclasses.replace(inst, ranks=tuple(ranks))
    if event.status == RankStatus.FAILED and not event.peer_lost:
        r = inst.node_ids().index(event.node_id)
        return _fail(inst, f"rank {r} on node {event.node_id} failed: {event.error}", ())
    if inst.status == InstanceStatus.LOADING and all(r.status == RankStatus.READY for r in ranks):
        return dataclasses.replace(inst, status=InstanceStatus.READY, ready_at=event.at)
    return inst


def apply(state: ClusterState, event: Event) -> ClusterState:
    """The state after ``event``; ``state`` itself is unchanged. An event about an
    instance the table does not hold (or, but for deletion, one that failed) changes
    nothing; so do a report from a node that holds none of its ranks, ``NotPlacedAgain``
    about an instance that has not failed, and a term not above the table's."""
    if isinstance(event, Placed):
        return _with(state, event.instance)
    if isinstance(event, Deleted):
        return dataclasses.replace(
            state, instances={k: v for k, v in state.instances.items() if k != event.instance_id}
        )
    if isinstance(event, TermStarted):  # only a term above the table's (invariant 5)
        if event.term <= state.epoch.term:
            return state
        return dataclasses.replace(state, epoch=Epoch(event.term, 0, event.coordinator, event.majority))
    if isinstance(event, Published):
        return dataclasses.replace(state, epoch=state.epoch.next())
    if isinstance(event, Adopted):
        return event.state if newer(event.state.epoch, state.epoch) else state
    inst = state.instances.get(event.instance_id)
    if inst is None or (inst.status == InstanceStatus.FAILED) != isinstance(event, NotPlacedAgain):
        return state  # NotPlacedAgain is about a failed instance; every other event about a live one
    if isinstance(event, RankReported):
        if event.node_id not in inst.node_ids():
            return state
        return _with(state, _reported(inst, event))
    if isinstance(event, InstanceFailed):
        return _with(state, _fail(inst, event.error, event.failed_nodes))
    if isinstance(event, NotPlacedAgain):
        return _with(
            state, dataclasses.replace(inst, error=f"{inst.error}; not placed again: {event.reason}", given_up=True)
        )
    if isinstance(event, RejoinDropped):
        return _with(state, dataclasses.replace(inst, wanted_nodes=()))
    if isinstance(event, KeptAlive):
        return _with(state, dataclasses.replace(inst, keep_until=event.until))
    raise TypeError(f"not an event: {event!r}")


# -- decisions read off the state ----------------------------------------------------------


def lost_rank_failures(state: ClusterState, live: set[str], incarnations: Mapping[str, float]) -> list[InstanceFailed]:
    """The coordinator's failures of instances with a rank on a node that is down (not in
    ``live``), or that restarted since the placement (``incarnations``: each node's start
    time as last heard; ``cluster_state`` rule 5)."""
    active = [i for i in state.instances.values() if i.status != InstanceStatus.FAILED]
    restarted = lost_instances(
        {i.instance_id: [(r.node_id, r.incarnation) for r in i.ranks] for i in active}, incarnations
    )
    events = []
    for inst in active:
        down = tuple(n for n in inst.node_ids() if n not in live)
        if down:
            events.append(InstanceFailed(inst.instance_id, f"node(s) {', '.join(down)} are down", down))
        elif inst.instance_id in restarted:
            gone = ", ".join(restarted[inst.instance_id])
            events.append(
                InstanceFailed(inst.instance_id, f"node(s) {gone} restarted: their ranks are gone", at_once=True)
            )
    return events


def down_rank_failure(inst: Instance, live: set[str]) -> InstanceFailed | None:
    """The failure naming ``inst``'s ranks whose nodes are not in ``live``, or None."""
    down = [(r, p.node_id) for r, p in enumerate(inst.ranks) if p.node_id not in live]
    if not down:
        return None
    named = ", ".join(f"rank {r} on node {n}" for r, n in down)
    return InstanceFailed(inst.instance_id, f"{named}: node down", tuple(n for _, n in down))


@dataclass(frozen=True)
class RunnerPlan:
    """What a node does to its runners: ``start`` (instance id, rank) pairs placed here
    with no runner yet, ``stop`` runners of instances no longer placed here (deleted or
    failed), ``cancel`` file copies for those."""

    start: tuple[tuple[str, int], ...] = ()
    stop: tuple[str, ...] = ()
    cancel: tuple[str, ...] = ()


def plan_runners(state: ClusterState, node_id: str, running: frozenset[str], preparing: frozenset[str]) -> RunnerPlan:
    """The plan of node ``node_id``, which has runners for the instance ids ``running``
    and is getting the files of ``preparing``."""
    wanted = {}
    for inst in state.instances.values():
        if inst.status != InstanceStatus.FAILED and node_id in inst.node_ids():
            wanted[inst.instance_id] = inst.node_ids().index(node_id)
    return RunnerPlan(
        start=tuple(sorted((i, r) for i, r in wanted.items() if i not in running and i not in preparing)),
        stop=tuple(sorted(running - wanted.keys())),
        cancel=tuple(sorted(preparing - wanted.keys())),
    )


def stale_ranks(state: ClusterState, node_id: str, runners: Mapping[str, RankStatus]) -> tuple[str, ...]:
    """Instances whose rank on ``node_id`` the table shows otherwise than its runner
    (``runners``: instance id -> the runner's status), where the runner is ready or
    failed: its report went to a coordinator that has since changed, or to none while one
    took over; the node reports it again."""
    out = []
    for inst in state.instances.values():
        status = runners.get(inst.instance_id)
        if inst.status == InstanceStatus.FAILED or status not in (RankStatus.READY, RankStatus.FAILED):
            continue
        mine = [r for r in inst.ranks if r.node_id == node_id]
        if mine and mine[0].status != status:
            out.append(inst.instance_id)
    return tuple(out)
