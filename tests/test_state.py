"""The cluster state machine: tables over shardline.node.state's pure ``apply`` and the
plans read off the state (no processes; milliseconds each)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from shardline.models.config import RankShare, Sharding
from shardline.node.epochs import Epoch
from shardline.node.state import (
    REPLACED_KEPT,
    Adopted,
    ClusterState,
    Deleted,
    InstanceFailed,
    KeptAlive,
    NotPlacedAgain,
    Placed,
    Published,
    RankReported,
    RejoinDropped,
    RunnerPlan,
    TermStarted,
    apply,
    down_rank_failure,
    instance_named,
    lost_rank_failures,
    plan_runners,
    replaced_ids,
    sharding_again,
    stale_ranks,
    stand_in_not_needed,
    standing_in,
    superseded,
    why_ended,
)
from shardline.node.status import InstanceStatus as I
from shardline.node.status import RankStatus as R
from shardline.node.table import DELETED, EndCode, Instance, RankPlacement
from shardline.node.wire import StateMessage

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]


def inst(instance_id="i1", nodes=("a", "b", "c"), status=I.LOADING, ranks=None, **kw) -> Instance:
    """An instance of pipeline ranks on ``nodes`` (statuses ``ranks``, default loading)."""
    ranks = ranks or [R.LOADING] * len(nodes)
    return Instance(
        instance_id,
        "m",
        Sharding.PIPELINE,
        tuple(RankPlacement(n, f"{n}:1", RankShare(0, 1), status=s, incarnation=1.0) for n, s in zip(nodes, ranks)),
        "a",
        1,
        256,
        1,
        status=status,
        **{"created_at": 0.0, **kw},
    )


def state(*instances: Instance, epoch=Epoch(3, 2, "a")) -> ClusterState:
    return ClusterState(epoch, {i.instance_id: i for i in instances})


def summary(s: ClusterState) -> dict:
    """Each instance's status and its ranks' statuses, in short."""
    return {k: (v.status, tuple(r.status for r in v.ranks)) for k, v in s.instances.items()}


LOADING = (I.LOADING, (R.LOADING,) * 3)

# (before, event, after: summary of the state after the event)
TRANSITIONS = [
    ("place", state(), Placed(inst()), {"i1": LOADING}),
    ("place a second", state(inst()), Placed(inst("i2")), {"i1": LOADING, "i2": LOADING}),
    ("delete", state(inst(), inst("i2")), Deleted("i1"), {"i2": LOADING}),
    ("delete what is not there", state(inst()), Deleted("zz"), {"i1": LOADING}),
    ("delete a failed instance", state(inst(status=I.FAILED)), Deleted("i1"), {}),
    (
        "a rank fetches",
        state(inst()),
        RankReported("i1", "b", R.FETCHING),
        {"i1": (I.LOADING, (R.LOADING, R.FETCHING, R.LOADING))},
    ),
    (
        "a late fetch report after ready",
        state(inst(ranks=[R.READY] * 2 + [R.LOADING])),
        RankReported("i1", "b", R.FETCHING),
        {"i1": (I.LOADING, (R.READY, R.READY, R.LOADING))},
    ),
    (
        "one rank ready",
        state(inst()),
        RankReported("i1", "a", R.READY),
        {"i1": (I.LOADING, (R.READY, R.LOADING, R.LOADING))},
    ),
    (
        "the last rank ready: the instance is",
        state(inst(ranks=[R.READY, R.READY, R.LOADING])),
        RankReported("i1", "c", R.READY, at=5.0),
        {"i1": (I.READY, (R.READY,) * 3)},
    ),
    (
        "a rank fails: the others stop",
        state(inst(ranks=[R.READY, R.READY, R.LOADING])),
        RankReported("i1", "b", R.FAILED, "boom"),
        {"i1": (I.FAILED, (R.STOPPED, R.FAILED, R.STOPPED))},
    ),
    (
        "a rank of a ready instance fails",
        state(inst(status=I.READY, ranks=[R.READY] * 3)),
        RankReported("i1", "c", R.FAILED, "oom"),
        {"i1": (I.FAILED, (R.STOPPED, R.STOPPED, R.FAILED))},
    ),
    (
        "a rank that lost a peer stops",
        state(inst(status=I.READY, ranks=[R.READY] * 3)),
        RankReported("i1", "a", R.FAILED, "lost", peer_lost=True),
        {"i1": (I.READY, (R.STOPPED, R.READY, R.READY))},
    ),
    (
        "a report on a failed instance",
        state(inst(status=I.FAILED, ranks=[R.FAILED] + [R.STOPPED] * 2)),
        RankReported("i1", "b", R.READY),
        {"i1": (I.FAILED, (R.FAILED, R.STOPPED, R.STOPPED))},
    ),
    ("a report on an unknown instance", state(inst()), RankReported("zz", "a", R.READY), {"i1": LOADING}),
    ("a report from a node without a rank", state(inst()), RankReported("i1", "x", R.FAILED), {"i1": LOADING}),
    (
        "the coordinator fails an instance: down node failed",
        state(inst(ranks=[R.READY] * 3)),
        InstanceFailed("i1", "down", ("b",)),
        {"i1": (I.FAILED, (R.STOPPED, R.FAILED, R.STOPPED))},
    ),
    (
        "failed with no node named: all stop",
        state(inst(ranks=[R.READY] * 3)),
        InstanceFailed("i1", "restarted"),
        {"i1": (I.FAILED, (R.STOPPED,) * 3)},
    ),
    (
        "a failed rank stays failed",
        state(inst(ranks=[R.FAILED, R.READY, R.READY])),
        InstanceFailed("i1", "x"),
        {"i1": (I.FAILED, (R.FAILED, R.STOPPED, R.STOPPED))},
    ),
    ("failing an unknown instance", state(inst()), InstanceFailed("zz", "x"), {"i1": LOADING}),
    ("rejoin dropped", state(inst()), RejoinDropped("i1"), {"i1": LOADING}),
]


@pytest.mark.parametrize("before, event, after", [t[1:] for t in TRANSITIONS], ids=[t[0] for t in TRANSITIONS])
def test_apply(before, event, after):
    kept = copy.deepcopy(before)
    assert summary(apply(before, event)) == after
    assert before == kept  # apply never changes its input


def test_the_instance_is_ready_at_the_last_report_and_once():
    s = state(inst(ranks=[R.READY, R.READY, R.LOADING]))
    s = apply(s, RankReported("i1", "c", R.READY, at=5.0))
    assert s.instances["i1"].ready_at == 5.0
    s = apply(s, RankReported("i1", "c", R.READY, at=9.0))  # reported again
    assert s.instances["i1"].ready_at == 5.0


def test_a_failed_rank_is_named_in_the_instance_error_and_keeps_its_own():
    s = apply(state(inst()), RankReported("i1", "b", R.FAILED, "out of memory"))
    assert s.instances["i1"].error == "rank 1 on node b failed: out of memory"
    assert s.instances["i1"].ranks[1].error == "out of memory"


def test_the_first_failure_is_the_one_kept():
    s = apply(state(inst()), InstanceFailed("i1", "first"))
    assert apply(s, InstanceFailed("i1", "second")).instances["i1"].error == "first"


def test_a_report_carries_what_the_rank_loaded_and_fetched():
    s = apply(state(inst()), RankReported("i1", "a", R.FETCHING, fetched={"done_bytes": 5}))
    s = apply(s, RankReported("i1", "a", R.READY, loaded={"param_bytes": 9}))
    rank = s.instances["i1"].ranks[0]
    assert (rank.fetched, rank.loaded) == ({"done_bytes": 5}, {"param_bytes": 9})


def test_not_placed_again_says_why_and_rejoin_dropped_forgets_the_nodes():
    s = apply(state(inst(status=I.FAILED, error="node b down")), NotPlacedAgain("i1", "no memory"))
    assert s.instances["i1"].error == "node b down; not placed again: no memory"
    assert s.instances["i1"].given_up  # requests stop waiting for it
    s = apply(state(inst(wanted_nodes=("a", "b", "c", "d"))), RejoinDropped("i1"))
    assert s.instances["i1"].wanted_nodes == ()


def test_kept_alive_sets_and_clears_the_deadline_of_a_live_instance():
    s = apply(state(inst()), KeptAlive("i1", 1060.0))
    assert s.instances["i1"].keep_until == 1060.0
    assert apply(s, KeptAlive("i1", None)).instances["i1"].keep_until is None  # for ever
    assert apply(s, KeptAlive("zz", 5.0)) == s  # unknown: nothing
    failed = state(inst(status=I.FAILED))
    assert apply(failed, KeptAlive("i1", 5.0)) == failed  # a failed one is placed again, or not


@pytest.mark.parametrize(
    "before, event, epoch",
    [
        (Epoch(3, 2, "a"), TermStarted(5, "b", True), Epoch(5, 0, "b", True)),
        (Epoch(3, 2, "a", True), TermStarted(5, "b", False), Epoch(5, 0, "b", False)),
        (Epoch(3, 2, "a"), TermStarted(3, "b", True), Epoch(3, 2, "a")),
        (Epoch(3, 2, "a"), Published(), Epoch(3, 3, "a")),
        (Epoch(3, 2, "a", True), Published(), Epoch(3, 3, "a", True)),
        (Epoch(0, 0, ""), Published(), Epoch(0, 1, "")),
    ],
    ids=[
        "a term starts at sequence 0",
        "a minority's term: below the majority's table",
        "not above the table's term",
        "publishing is the next sequence",
        "a majority's term",
        "from nothing",
    ],
)
def test_epochs(before, event, epoch):
    assert apply(state(inst(), epoch=before), event).epoch == epoch


@pytest.mark.parametrize(
    "theirs, adopted",
    [
        (Epoch(4, 1, "b"), True),
        (Epoch(3, 3, "a"), True),
        (Epoch(3, 2, "a"), False),
        (Epoch(3, 1, "a"), False),
        (Epoch(2, 9, "c"), False),
    ],
    ids=["newer term", "next sequence", "a replay", "older sequence", "older term"],
)
def test_only_a_newer_table_is_adopted(theirs, adopted):
    mine = state(inst())
    theirs_state = state(inst("other"), epoch=theirs)
    assert (apply(mine, Adopted(theirs_state)) == theirs_state) is adopted
    if not adopted:
        assert apply(mine, Adopted(theirs_state)) is mine


def test_a_state_round_trips_through_its_wire_form():
    s = apply(state(inst(ranks=[R.READY] * 3, replaced=("i0",))), InstanceFailed("i1", "x", ("b",)))
    back = StateMessage.model_validate_json(StateMessage.of(s).model_dump_json()).state()
    assert back == s
    assert isinstance(back.instances["i1"].status, I) and isinstance(back.instances["i1"].ranks[0].status, R)


# -- decisions --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "instances, asked, named",
    [
        ([inst("i1")], "i1", "i1"),
        ([inst("i1")], "i0", None),
        ([inst("i2", replaced=("i0", "i1"))], "i1", "i2"),
        ([inst("i2", replaced=("i0", "i1"))], "i0", "i2"),
        ([inst("i1", status=I.FAILED), inst("i2", replaced=("i1",))], "i1", "i1"),
        ([inst("i2", replaced=("i1",)), inst("i3", replaced=("i1",), created_at=5.0)], "i1", "i3"),
    ],
    ids=[
        "itself",
        "unknown",
        "placed again for it",
        "for the one before it",
        "the failed one while its successor loads",
        "the newest successor",
    ],
)
def test_an_id_names_its_instance_or_the_one_placed_again_in_its_place(instances, asked, named):
    found = instance_named({i.instance_id: i for i in instances}, asked)
    assert (found.instance_id if found else None) == named


@pytest.mark.parametrize(
    "instances, code, error",
    [
        (
            [inst("old", status=I.FAILED, error="rank 1 on node b: node down")],
            EndCode.INSTANCE_FAILED,
            "rank 1 on node b: node down",
        ),
        # a node that missed the table in which it failed sees only its replacement
        ([inst("new", replaced=("old",))], EndCode.INSTANCE_FAILED, "gone; instance new was placed in its place"),
        (
            [inst("newer", replaced=("older", "old"))],
            EndCode.INSTANCE_FAILED,
            "gone; instance newer was placed in its place",
        ),
        ([], EndCode.INSTANCE_DELETED, DELETED),
        ([inst("other", replaced=("another",))], EndCode.INSTANCE_DELETED, DELETED),
    ],
    ids=["failed", "placed again", "placed again twice", "deleted", "another's replacement"],
)
def test_requests_on_an_instance_gone_from_the_table_end_failed_where_it_was_placed_again(instances, code, error):
    assert why_ended({i.instance_id: i for i in instances}, "old") == (code, error)


@pytest.mark.parametrize(
    "instances, standing, handed_over",
    [
        # a ready instance on two nodes; the one placed beside it on three loads: it serves on
        ([inst("old", status=I.READY), inst("new", replaced=("old",), created_at=1.0)], {"old": "new"}, set()),
        # the new one is ready: requests go to it, and the old is deleted once idle
        (
            [inst("old", status=I.READY), inst("new", status=I.READY, replaced=("old",), created_at=1.0)],
            {"old": "new"},
            {"old"},
        ),
        # the new one failed: the old keeps serving
        ([inst("old", status=I.READY), inst("new", status=I.FAILED, replaced=("old",), created_at=1.0)], {}, set()),
        # a failed instance's replacement: it deletes the failed one itself
        ([inst("old", status=I.FAILED), inst("new", status=I.READY, replaced=("old",), created_at=1.0)], {}, set()),
        # the newest of two standing in
        (
            [
                inst("old", status=I.READY),
                inst("a", replaced=("old",), created_at=1.0),
                inst("b", status=I.READY, replaced=("old",), created_at=2.0),
            ],
            {"old": "b"},
            {"old"},
        ),
        # replaced ids no longer in the table
        ([inst("new", status=I.READY, replaced=("gone",))], {}, set()),
    ],
    ids=["loading beside", "ready beside", "failed beside", "a failure's replacement", "the newest", "gone"],
)
def test_an_instance_placed_beside_another_takes_over_once_ready(instances, standing, handed_over):
    table = {i.instance_id: i for i in instances}
    assert {old: new.instance_id for old, new in standing_in(table).items()} == standing
    assert superseded(table) == handed_over


def test_an_instance_placed_again_answers_for_the_newest_ids_before_it():
    assert replaced_ids(inst("i1")) == ("i1",)
    assert replaced_ids(inst("i2", replaced=("i0", "i1"))) == ("i0", "i1", "i2")
    long = inst("new", replaced=tuple(f"x{k}" for k in range(REPLACED_KEPT)))
    assert replaced_ids(long) == (*long.replaced[1:], "new")


@pytest.mark.parametrize(
    "sharding, nodes, again",
    [
        (Sharding.RING, ["a", "b"], Sharding.RING),
        (Sharding.RING, ["a"], Sharding.PIPELINE),  # a ring needs two nodes
        (Sharding.RING, None, Sharding.RING),  # none of its own live: any nodes, a ring
        (Sharding.TENSOR, ["a"], Sharding.TENSOR),
        (Sharding.PIPELINE, ["a"], Sharding.PIPELINE),
    ],
)
def test_a_ring_left_one_node_is_placed_again_as_a_pipeline(sharding, nodes, again):
    assert sharding_again(dataclasses.replace(inst(), sharding=sharding), nodes) == again


@pytest.mark.parametrize(
    "instances, live, incarnations, failed",
    [
        ([inst()], {"a", "b", "c"}, {"a": 1.0, "b": 1.0, "c": 1.0}, []),
        ([inst()], {"a", "c"}, {"a": 1.0, "b": 1.0, "c": 1.0}, [("i1", ("b",), False)]),
        ([inst()], {"a", "b", "c"}, {"a": 1.0, "b": 2.0, "c": 1.0}, [("i1", (), True)]),
        ([inst()], {"a", "b"}, {"a": 1.0, "b": 2.0, "c": 1.0}, [("i1", ("c",), False)]),
        ([inst(status=I.FAILED)], {"a"}, {"a": 1.0}, []),
        ([inst(), inst("i2", nodes=("a",))], {"a"}, {"a": 1.0, "b": 1.0, "c": 1.0}, [("i1", ("b", "c"), False)]),
    ],
    ids=[
        "all there",
        "a node down",
        "a node restarted",
        "one restarted, one down",
        "already failed",
        "only the instance with a lost rank",
    ],
)
def test_lost_ranks_fail_their_instances(instances, live, incarnations, failed):
    """A restart (every node live) is placed again at once; a node down waits to be sure."""
    events = lost_rank_failures(state(*instances), live, incarnations)
    assert [(e.instance_id, e.failed_nodes, e.at_once) for e in events] == failed


def test_down_ranks_are_named_by_rank_and_node():
    event = down_rank_failure(inst(), {"a", "c"})
    assert event == InstanceFailed("i1", "rank 1 on node b: node down", ("b",))
    assert down_rank_failure(inst(), {"a", "b", "c"}) is None


@pytest.mark.parametrize(
    "instances, node, running, preparing, plan",
    [
        ([inst()], "b", set(), set(), RunnerPlan(start=(("i1", 1),))),
        ([inst()], "b", {"i1"}, set(), RunnerPlan()),
        ([inst()], "b", set(), {"i1"}, RunnerPlan()),
        ([inst(status=I.FAILED)], "b", {"i1"}, set(), RunnerPlan(stop=("i1",))),
        ([], "b", {"i1"}, {"i2"}, RunnerPlan(stop=("i1",), cancel=("i2",))),
        ([inst()], "x", set(), set(), RunnerPlan()),
        ([inst(), inst("i2", nodes=("c", "b"))], "b", {"i1"}, set(), RunnerPlan(start=(("i2", 1),))),
    ],
    ids=[
        "start its rank",
        "already running",
        "getting its files",
        "failed: stop",
        "deleted: stop and cancel",
        "no rank here",
        "a second instance",
    ],
)
def test_a_node_plans_its_runners_from_the_table(instances, node, running, preparing, plan):
    assert plan_runners(state(*instances), node, frozenset(running), frozenset(preparing)) == plan


@pytest.mark.parametrize(
    "ranks, status, runner, stale",
    [
        ([R.LOADING] * 3, I.LOADING, R.READY, True),  # ready, not yet in the table
        ([R.READY] * 3, I.READY, R.READY, False),
        ([R.READY] * 3, I.READY, R.FAILED, True),
        ([R.FAILED] + [R.STOPPED] * 2, I.FAILED, R.FAILED, False),  # failed: nothing to say
        ([R.LOADING] * 3, I.LOADING, R.LOADING, False),  # still loading: nothing to say
    ],
    ids=["ready unknown", "agreed", "failed unknown", "instance failed", "loading"],
)
def test_a_rank_the_table_shows_otherwise_is_reported_again(ranks, status, runner, stale):
    s = state(inst(status=status, ranks=ranks))
    assert stale_ranks(s, "a", {"i1": runner}) == (("i1",) if stale else ())


# -- the invariants over random event sequences ------------------------------------------


def random_event(rng, s: ClusterState, fresh: list[int]):
    """One event a cluster could see next, of every kind, about known or unknown
    instances and nodes."""
    ids = list(s.instances) + ["gone"]
    kind = rng.randrange(9)
    if kind == 0:
        fresh[0] += 1
        return Placed(inst(f"i{fresh[0]}", nodes=tuple(rng.sample("abcd", rng.randint(1, 3)))))
    if kind == 1:
        return Deleted(rng.choice(ids))
    if kind in (2, 3, 4):
        return RankReported(
            rng.choice(ids),
            rng.choice("abcd"),
            rng.choice(list(R)),
            error=rng.choice([None, "boom"]),
            peer_lost=rng.random() < 0.2,
            at=float(rng.randint(1, 100)),
        )
    if kind == 5:
        return InstanceFailed(rng.choice(ids), "lost", tuple(rng.sample("abcd", rng.randint(0, 2))))
    if kind == 6:
        return rng.choice(
            [
                NotPlacedAgain(rng.choice(ids), "no room"),
                RejoinDropped(rng.choice(ids)),
                KeptAlive(rng.choice(ids), 9.0),
            ]
        )
    if kind == 7:
        return rng.choice([Published(), TermStarted(rng.randint(0, 6), rng.choice("abcd"), rng.random() < 0.7)])
    theirs = state(epoch=Epoch(rng.randint(0, 6), rng.randint(0, 5), rng.choice("abcd"), rng.random() < 0.7))
    return Adopted(theirs)


@pytest.mark.parametrize("seed", range(20))
def test_the_invariants_hold_over_random_event_sequences(seed):
    """state.py's invariants 1-5 after every one of 300 random events (apply never changes
    its input, either)."""
    import random

    rng = random.Random(seed)
    s, fresh = state(), [0]
    for _ in range(300):
        event = random_event(rng, s, fresh)
        before = copy.deepcopy(s)
        after = apply(s, event)
        assert s == before  # the input is unchanged
        if isinstance(event, TermStarted) and not event.majority:  # 5: a minority's term ...
            assert after.epoch.term >= s.epoch.term  # ... only goes up in term
        else:
            assert after.epoch >= s.epoch  # 5: the epoch never goes back
        for instance_id, new in after.instances.items():
            old = s.instances.get(instance_id)
            if isinstance(event, Adopted) and after is event.state:
                continue  # another coordinator's table, taken whole
            if old is not None and old.status == I.FAILED:
                assert new.status == I.FAILED  # 1: a failed instance stays failed
            if new.status == I.READY:
                assert all(r.status == R.READY for r in new.ranks) or old.status == I.READY  # 2
                assert new.ready_at is not None
                if old is not None and old.ready_at is not None:
                    assert new.ready_at == old.ready_at  # 2: ready_at set once
            if new.status == I.FAILED and (old is None or old.status != I.FAILED):
                assert all(r.status in (R.FAILED, R.STOPPED) for r in new.ranks)  # 4
        s = after


OLD = inst("old", ("a", "b"), I.READY, replaced=("first",))
STAND_IN = inst("new", ("a", "b", "c"), I.FAILED, replaced=("first", "old"), stands_in_for="old")


@pytest.mark.parametrize(
    "others, deleted",
    [
        ([OLD], True),  # the serving one serves on: the rejoin tries again from it
        ([dataclasses.replace(OLD, status=I.FAILED)], True),  # both failed: the old one is placed again
        ([inst("again", ("a", "b"), I.LOADING, replaced=("first", "old"))], True),  # ... and was already
        ([], False),  # the handover had deleted the old one: the stand-in was the only line
        ([inst("other", ("c",), I.READY, replaced=("elsewhere",))], False),
    ],
    ids=["old-serving", "old-failed-too", "old-placed-again", "handed-over", "unrelated"],
)
def test_a_failed_stand_in_is_deleted_while_the_line_it_stood_in_for_goes_on(others, deleted):
    """Trial 7: a node killed during a rejoin's handover failed both instances and both were
    placed again, then both rejoined: two copies of the model for good."""
    instances = {i.instance_id: i for i in (*others, STAND_IN)}
    assert stand_in_not_needed(instances, STAND_IN) is deleted
    assert stand_in_not_needed(instances, OLD) is False  # not a stand-in: placed again as any
