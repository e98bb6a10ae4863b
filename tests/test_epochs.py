"""Which instance table wins and who may publish: tables over the pure rules of
shardline.node.epochs (no processes)."""

import pytest

from shardline.node.epochs import (
    NO_EPOCH,
    Epoch,
    RejoinView,
    heard_majority,
    heard_whole_cluster,
    lost_instances,
    newer,
    next_term,
    paused,
    rejoinable,
    settled,
)
from shardline.node.wire import StateMessage

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]


@pytest.mark.parametrize(
    "theirs, mine, adopted",
    [
        (Epoch(2, 1, "b"), Epoch(1, 9, "a"), True),  # a newer term wins over any sequence
        (Epoch(1, 9, "a"), Epoch(2, 1, "b"), False),  # an older term is refused (a paused coordinator)
        (Epoch(2, 4, "b"), Epoch(2, 3, "b"), True),  # the next publication of the term
        (Epoch(2, 3, "b"), Epoch(2, 3, "b"), False),  # a replay
        (Epoch(2, 3, "c"), Epoch(2, 3, "b"), True),  # one term from two sides: a total order
        (Epoch(2, 3, "b"), Epoch(2, 3, "c"), False),
        (Epoch(1, 1, "a"), NO_EPOCH, True),  # a new node takes the first table it hears
        (NO_EPOCH, Epoch(1, 1, "a"), False),
        # a partition heals: a node cut off alone started term 3; the majority served on in 2
        (Epoch(2, 9, "a", majority=True), Epoch(3, 4, "c"), True),
        (Epoch(3, 4, "c"), Epoch(2, 9, "a", majority=True), False),
        (Epoch(3, 1, "b", majority=True), Epoch(2, 9, "a", majority=True), True),  # two majorities: term
        (Epoch(3, 1, "b"), Epoch(2, 9, "a"), True),  # two minorities (a 2-node cluster cut): term
    ],
)
def test_only_a_newer_epoch_replaces_a_table(theirs, mine, adopted):
    assert newer(theirs, mine) is adopted


@pytest.mark.parametrize(
    "own, seen, term",
    [
        (NO_EPOCH, [], 1),
        (Epoch(3, 7, "a"), [Epoch(1, 2, "b")], 4),
        (Epoch(1, 2, "a"), [Epoch(5, 1, "b"), Epoch(2, 9, "c")], 6),  # above every term seen
    ],
)
def test_a_new_coordinator_starts_a_term_above_every_term_seen(own, seen, term):
    assert next_term(own, seen) == term


@pytest.mark.parametrize(
    "heard, known, result",
    [
        ("a", "a", True),  # a cluster of one
        ("ab", "abc", True),  # two of three
        ("c", "abc", False),  # one of three, cut off
        ("a", "ab", False),  # one of two: half is not a majority
        ("ab", "abcd", False),
        ("abc", "abcd", True),
        ("ab", "a", True),  # a node heard for the first time counts as known
    ],
)
def test_a_majority_is_more_than_half_of_the_nodes_known(heard, known, result):
    assert heard_majority(list(heard), list(known)) is result


def test_a_table_kept_on_disk_counts_as_a_minority_s():
    kept = Epoch(4, 7, "a", majority=True).from_disk()
    assert kept == Epoch(4, 7, "a") and newer(Epoch(4, 7, "a", majority=True), kept)
    assert kept.next() == Epoch(4, 8, "a")


@pytest.mark.parametrize(
    "now, since, heard_all_at, result",
    [
        (100.0, 99.0, None, False),  # just started, no round heard every peer yet
        (100.0, 99.0, 99.5, True),  # every peer answered a round since the start
        (100.0, 99.0, 98.0, False),  # ... but that round was before the pause
        (100.0, 94.0, None, True),  # the window passed: a peer that is down is not waited for
    ],
)
def test_a_node_coordinates_only_once_it_has_heard_the_cluster(now, since, heard_all_at, result):
    assert settled(now, since, 5.0, heard_all_at) is result


@pytest.mark.parametrize(
    "answered, heard, named, result",
    [
        ([], ["a"], [], True),  # a new cluster of one: nobody to wait for
        ([True, True], ["a", "b", "c"], ["b", "c"], True),  # every peer answered, all named heard
        ([True, False], ["a", "b"], [], False),  # a peer address did not answer
        # restarted with no peer address yet (mDNS finds them later): its table names b and c
        ([], ["a"], ["a", "b", "c"], False),
        ([True], ["a", "b"], ["b", "c"], False),  # c, named, not heard yet
    ],
)
def test_a_round_hears_the_whole_cluster_only_with_every_node_the_table_names(answered, heard, named, result):
    assert heard_whole_cluster(answered, heard, named) is result


@pytest.mark.parametrize("now, last_tick, result", [(100.0, 99.0, False), (100.0, 94.9, True)])
def test_a_long_gap_between_rounds_is_a_pause(now, last_tick, result):
    assert paused(now, last_tick, 5.0) is result


def test_ranks_on_a_node_that_restarted_are_lost():
    ranks = {
        "i1": [("a", 10.0), ("b", 20.0)],
        "i2": [("b", 20.0), ("c", 30.0)],
        "i3": [("a", 0.0)],  # placed before incarnations were recorded
        "i4": [("d", 40.0)],  # d not heard from: liveness decides, not this rule
    }
    assert lost_instances(ranks, {"a": 10.0, "b": 20.0, "c": 31.0}) == {"i2": ["c"]}
    assert lost_instances(ranks, {"a": 11.0, "b": 20.0, "c": 30.0}) == {"i1": ["a"]}
    assert lost_instances(ranks, {"a": 10.0, "b": 21.0, "c": 31.0}) == {"i1": ["b"], "i2": ["b", "c"]}
    assert lost_instances(ranks, {"a": 10.0, "b": 20.0, "c": 30.0, "d": 40.0}) == {}


def test_an_epoch_round_trips_and_a_malformed_one_is_refused():
    for epoch in (Epoch(3, 4, "node-a"), Epoch(3, 4, "node-a", majority=True)):
        wire = StateMessage(epoch=epoch, instances=[])
        assert StateMessage.model_validate_json(wire.model_dump_json()).epoch == epoch
        assert epoch.next() == Epoch(3, 5, "node-a", epoch.majority)
    for bad in (
        {},
        {"term": "x", "seq": 1, "coordinator": "a"},
        {"term": 1},
        {"term": 1, "seq": 1, "coordinator": "a", "version": 10**6},
    ):
        with pytest.raises(ValueError):
            StateMessage.model_validate({"epoch": bad, "instances": []})


@pytest.mark.parametrize(
    "view, live, rejoins",
    [
        # a returning node: placed on a, b after c was lost; all three live, idle
        (RejoinView("ready", ("a", "b"), ("a", "b", "c"), False), "abc", True),
        # busy: the new one goes beside it (the coordinator waits for idle only where both
        # do not fit)
        (RejoinView("ready", ("a", "b"), ("a", "b", "c"), True), "abc", True),
        (RejoinView("ready", ("a", "b"), ("a", "b", "c"), False), "ab", False),  # c still down
        (RejoinView("loading", ("a", "b"), ("a", "b", "c"), False), "abc", False),
        (RejoinView("failed", ("a", "b"), ("a", "b", "c"), False), "abc", False),
        (RejoinView("ready", ("a", "b", "c"), (), False), "abc", False),  # never reduced
        (RejoinView("ready", ("a", "b", "c"), ("a", "b", "c"), False), "abc", False),  # back already
        (RejoinView("ready", ("a",), ("a", "c"), False), "abcd", True),
        # placed on others while its one node was down (pinned there): back onto it
        (RejoinView("ready", ("b", "d"), ("c",), False), "abcd", True),
        (RejoinView("ready", ("b", "d"), ("c",), False), "abd", False),
        # an instance on a, b, c already stands in for it (loading beside it): not again
        (RejoinView("ready", ("a", "b"), ("a", "b", "c"), False, True), "abc", False),
    ],
)
def test_an_idle_instance_placed_on_fewer_nodes_rejoins_them_when_all_are_back(view, live, rejoins):
    assert rejoinable({"i": view}, live) == (["i"] if rejoins else [])
