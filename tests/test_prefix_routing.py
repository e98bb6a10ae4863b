"""Routing by cached prefix (:mod:`shardline.node.prefix_routing`): the choice by table,
the record's memory, and the router sending a conversation's next turn where its last
one went, in process (no cluster)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from shardline.models.config import RankShare, Sharding
from shardline.node.prefix_routing import ROUTE_BLOCK, Candidate, PrefixRecord, choose, route_hashes
from shardline.node.routing import RequestStream, Router
from shardline.node.status import InstanceStatus, RankStatus
from shardline.node.table import Instance, RankPlacement
from shardline.runner.protocol import SamplingParams, TokenEvent, TokenRequest

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]


def c(name: str, matched: int = 0, local: bool = False, load: int = 0, created: float = 0.0) -> Candidate:
    return Candidate(name, matched, local, load, created)


@pytest.mark.parametrize(
    "candidates, chosen",
    [
        ([], None),
        ([c("a")], "a"),
        ([c("a", matched=2, local=True), c("b", matched=5)], "b"),  # the longest prefix first
        ([c("a", matched=5, load=9), c("b", matched=5, local=True, load=9)], "b"),  # then a local one
        ([c("a", local=True, load=3), c("b", local=True, load=1)], "b"),  # then the least loaded
        ([c("a", load=1, created=2.0), c("b", load=1, created=1.0)], "b"),  # then the oldest
        ([c("a", matched=1, load=50), c("b", local=True)], "a"),  # a hit outweighs the load
    ],
)
def test_the_choice(candidates, chosen):
    assert choose(candidates) == chosen


def test_hashes_name_every_token_before_them():
    prompt = list(range(3 * ROUTE_BLOCK + 5))
    hashes = route_hashes(prompt)
    assert len(hashes) == 3
    other = route_hashes([7, *prompt[1:]])  # the first token differs: every block does
    assert all(h != o for h, o in zip(hashes, other))
    assert route_hashes(prompt[: 2 * ROUTE_BLOCK]) == hashes[:2]


def test_the_record_matches_leading_blocks_and_forgets_the_least_recently_used():
    record = PrefixRecord()
    record.record("x", [1, 2, 3], capacity=4)
    assert record.matched("x", [1, 2, 3, 4]) == 3 and record.matched("x", [1, 5, 3]) == 1
    assert record.matched("y", [1]) == 0
    record.record("x", [1, 9], capacity=4)  # 1 used again: 2 is now the least recent
    assert record.matched("x", [1, 2]) == 2 and record.matched("x", [1, 9]) == 2
    record.record("x", [1, 9, 8], capacity=4)  # a fifth block: 2 forgotten
    assert record.matched("x", [1, 2]) == 1 and record.matched("x", [3]) == 1
    record.keep_only({"z"})
    assert record.matched("x", [1]) == 0


def _instance(
    instance_id: str, node: str, created_at: float, context: int = 4096, prefix_cache: bool = True
) -> Instance:
    return Instance(
        instance_id,
        "m",
        Sharding.PIPELINE,
        (RankPlacement(node, f"{node}:1", RankShare(0, 1), status=RankStatus.READY),),
        node,
        1,
        context,
        8,
        status=InstanceStatus.READY,
        created_at=created_at,
        prefix_cache=prefix_cache,
    )


def _router(*instances: Instance) -> Router:
    node = SimpleNamespace(
        node_id="a",
        streams={},
        is_stopping=lambda: False,
        down_after_s=5.0,
        instances={i.instance_id: i for i in instances},
    )

    async def generate(address, request, ran_on=None):
        yield TokenEvent(1, 42, "length")

    node.peer_client = SimpleNamespace(generate=generate)
    return Router(node)


def _run(router: Router, prompt: tuple[int, ...], on: Instance) -> None:
    async def consume() -> None:
        async for _ in router.generate(TokenRequest("m", prompt, 4, SamplingParams(), ()), None, None, on):
            pass

    asyncio.run(consume())


SYSTEM = tuple(range(1000, 1000 + 4 * ROUTE_BLOCK))


def test_a_conversations_next_turn_goes_where_its_last_one_went():
    """Two remote instances: the first turn goes to the oldest (nothing matched); a second
    conversation, loading that one, goes to the other; each next turn follows its own."""
    old, new = _instance("old", "b", 1.0), _instance("new", "c", 2.0)
    router = _router(old, new)
    one, two = SYSTEM + (1,) * ROUTE_BLOCK, SYSTEM[:ROUTE_BLOCK] + (2,) * (3 * ROUTE_BLOCK)
    first = router.route(one, old)
    assert first.instance_id == "old"
    _run(router, one, first)
    router.node.streams[7] = RequestStream("old", asyncio.Queue())  # a request in flight there
    # the second shares one block with the first: a hit of 1 block outweighs the load
    assert router.route(two, old).instance_id == "old"
    _run(router, two, new)  # it went to "new" all the same (the API chose it)
    assert router.route(one + (3,) * ROUTE_BLOCK, old).instance_id == "old"
    assert router.route(two + (4,) * ROUTE_BLOCK, old).instance_id == "new"


def test_routing_keeps_to_instances_as_long_and_to_caching_ones():
    """Only instances of at least the checked one's context are candidates; one without
    a prefix cache matches nothing; a forwarded request keeps to this node's instances."""
    short, long_, plain = (
        _instance("short", "b", 1.0, context=2048),
        _instance("long", "c", 2.0),
        _instance("plain", "d", 0.5, prefix_cache=False),
    )
    router = _router(short, long_, plain)
    prompt = SYSTEM
    _run(router, prompt, short)
    _run(router, prompt, plain)
    assert router.prefixes.matched("plain", route_hashes(prompt)) == 0  # not recorded
    assert router.route(prompt, short).instance_id == "short"  # its record
    assert router.route(prompt, long_).instance_id == "plain"  # short is too short: the oldest next
    assert router.route(prompt, long_, local_only=True).instance_id == "long"  # none here: as checked
