"""The router's lookups, in process (no cluster): a request whose instance went away
between the API's check and its start, and what it does next (waits for the model to be
served again, or fails); an instance placed beside another (a rejoin's handover); deleting
one deletes what stands in for it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
from conftest import one_rank_instance

from shardline.node import routing
from shardline.node.peer_client import PeerError
from shardline.node.queue_bound import QueueFullError
from shardline.node.routing import (
    READY_RECHECK_S,
    AfterFailure,
    ReadyWait,
    RequestStream,
    Router,
    after_failure,
    continuation,
    next_look_s,
    ready_wait,
)
from shardline.node.status import InstanceStatus
from shardline.node.table import EndCode, Instance, InstanceFailedError
from shardline.runner.protocol import PrefillProgress, SamplingParams, TokenEvent, TokenRequest

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]

# what the router asks of its node (a table that never changes: a wait looks again on its clock)
LIVE = {"is_stopping": lambda: False, "down_after_s": 5.0, "table_changed": asyncio.sleep}


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
    node = SimpleNamespace(node_id="n0", instances={}, streams={}, **LIVE)
    if reserved:
        node.streams[7] = RequestStream("gone", asyncio.Queue())
    with pytest.raises(InstanceFailedError, match="retry later"):
        run_to_end(Router(node), 7 if reserved else None)
    assert node.streams == {}


def _instance(instance_id: str, status: InstanceStatus, created_at: float, replaced=(), **fields) -> Instance:
    return one_rank_instance(instance_id, status, created_at, replaced=replaced, **fields)


READY, LOADING, FAILED = InstanceStatus.READY, InstanceStatus.LOADING, InstanceStatus.FAILED


GAVE_UP = "given up"  # failed, and the coordinator will not place it again


@pytest.mark.parametrize(
    "table, failed, waited_s, step",
    [
        ({"new": READY}, ["old"], 0.0, ReadyWait.RUN),  # placed again and ready
        ({"new": READY}, ["old"], 99.0, ReadyWait.RUN),  # ready is ready, however late
        ({"old": READY}, ["old"], 1.0, ReadyWait.WAIT),  # not found failed yet: not run on again
        ({"old": READY}, ["old"], 7.0, ReadyWait.RUN),  # still ready after the verdict: a lost link
        ({"old": FAILED}, ["old"], 1.0, ReadyWait.WAIT),  # the coordinator places it again
        ({"old": FAILED, "new": LOADING}, ["old"], 20.0, ReadyWait.WAIT),
        ({"new": LOADING}, ["old"], 30.0, ReadyWait.GIVE_UP),
        ({"old": GAVE_UP}, ["old"], 0.0, ReadyWait.GIVE_UP),  # could not be placed again
        ({}, ["old"], 0.0, ReadyWait.GIVE_UP),  # deleted: nothing to wait for
        ({"other": READY}, ["old"], 0.0, ReadyWait.GIVE_UP),  # another model's
        # a request that comes while no instance is ready
        ({"new": LOADING}, [], 5.0, ReadyWait.WAIT),  # placed, loading
        ({"new": LOADING}, [], 30.0, ReadyWait.GIVE_UP),
        ({"old": FAILED}, [], 0.0, ReadyWait.WAIT),  # about to be placed again
        ({"old": GAVE_UP}, [], 0.0, ReadyWait.GIVE_UP),
        ({"old": GAVE_UP, "new": LOADING}, [], 0.0, ReadyWait.WAIT),  # a later term's try
        ({"old": READY}, [], 0.0, ReadyWait.RUN),
    ],
)
def test_what_a_request_without_a_ready_instance_does(table, failed, waited_s, step):
    instances = {
        name: _instance(
            name,
            FAILED if status == GAVE_UP else status,
            0.0,
            model="n" if name == "other" else "m",
            given_up=status == GAVE_UP,
        )
        for name, status in table.items()
    }
    got, inst = ready_wait(instances, "m", "a", failed, waited_s, limit_s=30.0, verdict_s=6.0)
    assert got == step and (inst is not None) == (step == ReadyWait.RUN)


def test_a_request_whose_instance_failed_before_any_output_runs_on_the_next_one():
    """The request's instance failed (in the table) before it yielded anything; the model
    is placed again on another node 0.3 s later: the request waits and runs there (and
    says so, for the fingerprint), and the client sees its tokens, not the failure."""
    node = SimpleNamespace(node_id="a", instances={"old": _instance("old", FAILED, 0.0)}, streams={}, **LIVE)
    asked: list[str] = []

    async def generate(address, request, ran_on=None):
        asked.append(address)
        yield TokenEvent(1, 42, "length")

    node.peer_client = SimpleNamespace(generate=generate)
    ran_on: list[str] = []  # what the API's fingerprint names

    async def run() -> tuple[list[TokenEvent], float]:
        async def place_again() -> None:
            await asyncio.sleep(0.3)
            node.instances = {"new": _instance("new", READY, 1.0, replaced=("old",), node="b")}

        placing = asyncio.create_task(place_again())
        started = asyncio.get_running_loop().time()
        events = [
            e
            async for e in Router(node).generate(
                TokenRequest("m", (1, 2), 4, SamplingParams(), ()), None, lambda i: ran_on.append(i.instance_id)
            )
        ]
        await placing
        return events, asyncio.get_running_loop().time() - started

    events, took = asyncio.run(run())
    assert [e.token_id for e in events] == [42] and asked == ["b:1"] and ran_on == ["new"]
    assert 0.3 <= took < 2.0


@pytest.mark.parametrize(
    "new_status, chosen",
    [(InstanceStatus.LOADING, "old"), (InstanceStatus.READY, "new"), (InstanceStatus.FAILED, "old")],
)
def test_requests_go_to_an_instance_placed_beside_another_once_it_is_ready(new_status, chosen):
    """A rejoin places the new instance beside the serving one (state.superseded)."""
    table = {
        "old": _instance("old", InstanceStatus.READY, 0.0),
        "new": _instance("new", new_status, 1.0, replaced=("old",)),
    }
    node = SimpleNamespace(node_id="a", instances=table)
    assert Router(node).ready_instance("m").instance_id == chosen


def test_a_request_whose_node_waited_is_not_run_again():
    """A forwarded request whose node answered with its own final error (it waited for
    the model already, or continued it as far as it goes): the error, at once, and the
    peer asked once."""
    node = SimpleNamespace(node_id="a", instances={"x": _instance("x", READY, 0.0, node="b")}, streams={}, **LIVE)
    asked: list[str] = []

    async def generate(address, request, ran_on=None):
        asked.append(address)
        yield TokenEvent(1, 42)
        raise InstanceFailedError("rank 0 failed", final=True)

    node.peer_client = SimpleNamespace(generate=generate)
    with pytest.raises(InstanceFailedError):
        run_to_end(Router(node), None)
    assert asked == ["b:1"]


def test_a_request_runs_twice_at_most():
    """A request whose forwarded runs both fail before any output, the instance still
    ready in the table (a link lost, or a request that fails its runner): run again once,
    after the coordinator's verdict time, then the error."""
    node = SimpleNamespace(
        node_id="a",
        instances={"x": _instance("x", READY, 0.0, node="b")},
        streams={},
        **{**LIVE, "down_after_s": -0.9},  # verdict after 0.1 s
    )
    asked: list[str] = []

    async def generate(address, request, ran_on=None):
        asked.append(address)
        raise PeerError("lost b:1")
        yield  # an async generator

    node.peer_client = SimpleNamespace(generate=generate)
    with pytest.raises(InstanceFailedError, match="lost b:1"):
        run_to_end(Router(node), None)
    assert asked == ["b:1", "b:1"]


def test_a_forwarded_request_names_the_instance_its_node_ran_it_on():
    """The node forwarded to runs the request on another instance than the one this node
    chose (one of its own, or the one placed again after a failure there): the stream
    names it, and this node's fingerprint follows."""
    node = SimpleNamespace(
        node_id="a",
        streams={},
        **LIVE,
        instances={"x": _instance("x", READY, 0.0, node="b"), "y": _instance("y", READY, 1.0, node="b")},
    )

    async def generate(address, request, ran_on=None):
        ran_on("y")
        yield TokenEvent(1, 42)
        ran_on("unknown")  # not in this node's table yet: the last known stays
        yield TokenEvent(1, 43, "length")

    node.peer_client = SimpleNamespace(generate=generate)
    ran_on: list[str] = []

    async def run() -> list[int]:
        return [
            e.token_id
            async for e in Router(node).generate(
                TokenRequest("m", (1, 2), 4, SamplingParams(), ()), None, lambda i: ran_on.append(i.instance_id)
            )
        ]

    assert asyncio.run(run()) == [42, 43]
    assert ran_on == ["x", "y"]


def test_a_forwarded_request_whose_instance_left_the_table_for_another_runs_there():
    """This node missed the table in which the instance it forwarded to failed: it sees
    the instance gone and one placed again in its place (``replaced``). The request, with
    no output yet, runs there: a failure, not a deletion (which would end it)."""
    node = SimpleNamespace(node_id="a", streams={}, instances={"old": _instance("old", READY, 0.0, node="b")}, **LIVE)
    asked: list[str] = []

    async def generate(address, request, ran_on=None):
        asked.append(address)
        if address == "b:1":
            await asyncio.sleep(30)  # b is cut off: its stream never ends by itself
        yield TokenEvent(1, 42, "length")

    node.peer_client = SimpleNamespace(generate=generate)

    async def run() -> list[int]:
        router = Router(node)

        async def place_again() -> None:
            await asyncio.sleep(0.2)
            node.instances = {"new": _instance("new", READY, 1.0, replaced=("old",), node="c")}
            router.end_forwarded()  # as the node's reconcile does on a new table

        placing = asyncio.create_task(place_again())
        events = [e.token_id async for e in router.generate(TokenRequest("m", (1, 2), 4, SamplingParams(), ()))]
        await placing
        return events

    assert asyncio.run(run()) == [42]
    assert asked == ["b:1", "c:1"]


@pytest.mark.parametrize(
    "on, near_context, asked",
    [
        ("long", 256, "c:1"),
        ("gone", 256, "b:1"),
        (None, 256, "b:1"),
        ("gone", 5, "c:1"),  # the prompt (2) and max_tokens (4) do not fit the near one's context
        (None, 6, "b:1"),  # they just fit
    ],
)
def test_a_request_runs_on_the_instance_the_api_chose_while_it_is_ready(on, near_context, asked):
    """The API checked the request against another ready instance than this node's
    first choice (a longer context): it runs there; one no longer ready is passed over
    for the first ready instance whose context takes the request."""
    node = SimpleNamespace(
        node_id="a",
        streams={},
        **LIVE,
        instances={
            "near": _instance("near", READY, 0.0, node="b", context=near_context),
            "long": _instance("long", READY, 1.0, node="c"),
        },
    )
    chosen = {"long": node.instances["long"], "gone": _instance("gone", READY, 2.0, node="d"), None: None}[on]
    seen: list[str] = []

    async def generate(address, request, ran_on=None):
        seen.append(address)
        yield TokenEvent(1, 42, "length")

    node.peer_client = SimpleNamespace(generate=generate)

    async def run() -> None:
        async for _ in Router(node).generate(TokenRequest("m", (1, 2), 4, SamplingParams(), ()), None, None, chosen):
            pass

    asyncio.run(run())
    assert seen == [asked]


def test_a_forwarded_request_is_ended_by_a_failure_of_the_instance_it_runs_on_only():
    """The node forwarded to ran the request again on another instance (named in its
    stream): the first one failing in this node's table does not end it here; the one it
    runs on failing does."""
    node = SimpleNamespace(
        node_id="a",
        streams={},
        **LIVE,
        instances={"x": _instance("x", READY, 0.0, node="b"), "y": _instance("y", READY, 1.0, node="b")},
    )
    tokens: list[int] = []

    async def generate(address, request, ran_on=None):
        ran_on("y")
        yield TokenEvent(1, 42)
        await asyncio.sleep(0.4)
        yield TokenEvent(1, 43)
        await asyncio.sleep(30)  # cut off
        yield TokenEvent(1, 44, "length")

    node.peer_client = SimpleNamespace(generate=generate)

    async def run() -> None:
        router = Router(node)

        async def fail(instance_id: str, after_s: float) -> None:
            await asyncio.sleep(after_s)
            node.instances = {
                **node.instances,
                instance_id: _instance(instance_id, FAILED, 0.0, node="b", given_up=True),
            }
            router.end_forwarded()  # given up: not placed again, so not continued

        failing = [asyncio.create_task(fail("x", 0.2)), asyncio.create_task(fail("y", 0.6))]
        with pytest.raises(InstanceFailedError, match="instance y"):
            async for event in router.generate(TokenRequest("m", (1, 2), 4, SamplingParams(), ())):
                tokens.append(event.token_id)
        await asyncio.gather(*failing)
        assert router._forwarding == {}

    asyncio.run(run())
    assert tokens == [42, 43]


@pytest.mark.parametrize("heartbeats", [True, False])
def test_a_forwarded_stream_left_by_its_client_closes_its_stream_to_the_node(heartbeats):
    """The client of a forwarded stream leaves: Starlette ends the answer within an anyio
    cancel scope, which cancels every ``await`` of the task again while it cleans up. The
    stream to the node that runs the request still closes to its end (its connection's
    close, which takes awaits: cut short, the connection stayed open and that node decoded
    the request to its max_tokens), and nothing of the request is left here. With
    heartbeats (the public APIs' streams) the request runs in a task of its own; without
    (a node's ``/internal/generate`` that forwards again), in the answer's task."""
    import anyio

    from shardline.api.heartbeat import with_heartbeats

    node = SimpleNamespace(node_id="a", instances={"x": _instance("x", READY, 0.0, node="b")}, streams={}, **LIVE)
    closed: list[str] = []

    async def generate(address, request, ran_on=None):
        try:
            yield TokenEvent(1, 42)
            await asyncio.sleep(30)  # more tokens, later
        finally:
            await asyncio.sleep(0.05)  # the connection's close (httpcore's takes awaits)
            closed.append(address)

    node.peer_client = SimpleNamespace(generate=generate)

    async def run() -> float:
        router = Router(node)
        events = router.generate(TokenRequest("m", (1, 2), 4, SamplingParams(), ()))
        stream = with_heartbeats(events, 5.0) if heartbeats else events
        with anyio.CancelScope() as scope:
            async for _ in stream:
                scope.cancel()  # the client left after its first token
        left = asyncio.get_running_loop().time()
        while not closed and asyncio.get_running_loop().time() - left < 1.0:
            await asyncio.sleep(0.01)
        return asyncio.get_running_loop().time() - left, router._forwarding

    took, forwarding = asyncio.run(run())
    assert closed == ["b:1"] and took < 0.5
    assert forwarding == {}


FAILED_CODE, DELETED, STOPPING = EndCode.INSTANCE_FAILED, EndCode.INSTANCE_DELETED, EndCode.SERVER_STOPPING
FAIL, RUN_AGAIN, CONTINUE = AfterFailure.FAIL, AfterFailure.RUN_AGAIN, AfterFailure.CONTINUE


@pytest.mark.parametrize(
    "code, final, sent, other_output, runs, continuations, stopping, step",
    [
        (FAILED_CODE, False, 0, False, 1, 0, False, RUN_AGAIN),  # nothing given yet: from the start
        (FAILED_CODE, False, 0, False, 2, 0, False, FAIL),  # run twice already
        (FAILED_CODE, False, 0, True, 1, 0, False, FAIL),  # prompt log-probabilities given, cut off
        (FAILED_CODE, False, 50, False, 1, 0, False, CONTINUE),  # tokens given: go on from them
        (FAILED_CODE, False, 50, True, 1, 0, False, CONTINUE),  # (the prompt's log-probabilities all given)
        (FAILED_CODE, False, 90, False, 1, 1, False, CONTINUE),  # a second time
        (FAILED_CODE, False, 120, False, 1, 2, False, FAIL),  # a third: no
        (FAILED_CODE, False, 50, False, 2, 0, False, CONTINUE),  # run again before its first token: still
        (FAILED_CODE, False, 200, False, 1, 0, False, FAIL),  # all its max_tokens given (no room to go on)
        (FAILED_CODE, True, 50, False, 1, 0, False, FAIL),  # the node it was forwarded to decided
        (FAILED_CODE, True, 0, False, 1, 0, False, FAIL),
        (DELETED, False, 50, False, 1, 0, False, FAIL),  # deleted: nothing serves it on purpose
        (STOPPING, False, 50, False, 1, 0, False, FAIL),
        (FAILED_CODE, False, 50, False, 1, 0, True, FAIL),  # this node stops
    ],
)
def test_what_a_request_does_when_its_instance_fails(
    code, final, sent, other_output, runs, continuations, stopping, step
):
    assert after_failure(code, final, sent, 200, other_output, runs, continuations, stopping) == step


@pytest.mark.parametrize(
    "prompt, resumed, sent, max_tokens, expected_prompt, expected_max, expected_resumed",
    [
        ((1, 2), 0, [42], 4, (1, 2, 42), 3, 1),
        ((1, 2), 0, [42, 43, 44], 4, (1, 2, 42, 43, 44), 1, 3),
        ((1, 2, 7, 8), 2, [9], 10, (1, 2, 7, 8, 9), 9, 3),  # a continuation forwarded, continued again
    ],
)
def test_a_continuation_is_the_prompt_and_the_tokens_given(
    prompt, resumed, sent, max_tokens, expected_prompt, expected_max, expected_resumed
):
    sampling = SamplingParams(
        temperature=0.7, seed=3, logprobs=2, prompt_logprobs=1, grammar="g", frequency_penalty=0.5, resumed=resumed
    )
    request = TokenRequest("m", prompt, max_tokens, sampling, (0, 5))
    got = continuation(request, sent)
    assert (got.prompt, got.max_tokens, got.sampling.resumed) == (expected_prompt, expected_max, expected_resumed)
    assert got.model_id == "m" and got.stop_token_ids == (0, 5)
    assert got.sampling == replace(sampling, resumed=expected_resumed, prompt_logprobs=None)
    assert len(got.prompt) + got.max_tokens == len(prompt) + max_tokens  # the same context


def _continuing_node(fail_after: int, place_again_s: float = 0.2, runs: int = 1):
    """A node that forwards to b, whose runs (``runs`` of them) give one token each
    (``fail_after`` in the first) and then lose b; the instance placed again on c
    0.2 s after b's first loss gives the rest."""
    node = SimpleNamespace(node_id="a", instances={"x": _instance("x", READY, 0.0, node="b")}, streams={}, **LIVE)
    asked: list[TokenRequest] = []
    where: list[str] = []

    async def generate(address, request, ran_on=None):
        asked.append(request)
        where.append(address)
        if address == "b:1" and len(asked) <= runs:
            for i in range(fail_after if len(asked) == 1 else 1):
                yield TokenEvent(1, 40 + len(request.prompt) - 2 + i)
            raise PeerError("lost b:1")
        yield PrefillProgress(1, len(request.prompt), len(request.prompt))  # not the client's
        for i in range(request.max_tokens):
            yield TokenEvent(1, 40 + len(request.prompt) - 2 + i, "length" if i == request.max_tokens - 1 else None)

    node.peer_client = SimpleNamespace(generate=generate)

    async def place_again() -> None:
        await asyncio.sleep(place_again_s)
        node.instances = {"new": _instance("new", READY, 1.0, replaced=("x",), node="c")}

    return node, asked, where, place_again


def test_a_request_whose_instance_failed_after_tokens_continues_on_the_next_one():
    """A forwarded request whose node is lost after 2 tokens: the stream stays open, and
    the model placed again on c 0.2 s later runs the continuation (the prompt and the 2
    tokens, 2 more of max_tokens, resumed 2): the client reads 4 tokens, in order, with
    no prefill progress after the first token, and the fingerprint's instance follows."""
    node, asked, where, place_again = _continuing_node(fail_after=2)
    ran_on: list[str] = []

    async def run() -> list:
        placing = asyncio.create_task(place_again())
        router = Router(node)
        events = [
            e
            async for e in router.generate(
                TokenRequest("m", (1, 2), 4, SamplingParams(temperature=0.5, seed=1), (0,)),
                None,
                lambda i: ran_on.append(i.instance_id),
            )
        ]
        await placing
        assert router.continuations == {"continued": 1, "failed": 0}
        return events

    events = asyncio.run(run())
    assert [(e.token_id, e.finish_reason) for e in events] == [(40, None), (41, None), (42, None), (43, "length")]
    assert where == ["b:1", "c:1"] and ran_on == ["x", "new"]
    assert asked[1] == TokenRequest("m", (1, 2, 40, 41), 2, SamplingParams(temperature=0.5, seed=1, resumed=2), (0,))


def test_a_request_continues_twice_at_most():
    """Each run gives a token, then loses its node (the instance still ready in the
    table: run on it again after the coordinator's verdict time): continued twice, then
    the error, its tokens given before it."""
    node = SimpleNamespace(
        node_id="a",
        instances={"x": _instance("x", READY, 0.0, node="b")},
        streams={},
        **{**LIVE, "down_after_s": -0.9},  # verdict after 0.1 s
    )
    asked: list[TokenRequest] = []

    async def generate(address, request, ran_on=None):
        asked.append(request)
        yield TokenEvent(1, 40 + len(asked))
        raise PeerError("lost b:1")

    node.peer_client = SimpleNamespace(generate=generate)
    tokens: list[int] = []

    async def run() -> Router:
        router = Router(node)
        with pytest.raises(InstanceFailedError, match="lost b:1"):
            async for event in router.generate(TokenRequest("m", (1, 2), 8, SamplingParams(), ())):
                tokens.append(event.token_id)
        return router

    router = asyncio.run(run())
    assert tokens == [41, 42, 43]
    assert [r.prompt for r in asked] == [(1, 2), (1, 2, 41), (1, 2, 41, 42)]
    assert router.continuations == {"continued": 2, "failed": 1}


def test_a_continuation_that_cannot_start_in_time_ends_with_the_error(monkeypatch):
    """The instance failed after a token and is not placed again (it would be: not given
    up) within the bound: the failure's error, at the bound."""
    monkeypatch.setattr(routing, "CONTINUE_WAIT_S", 0.3)
    node, asked, where, place_again = _continuing_node(fail_after=1)

    async def run() -> tuple[list[int], float]:
        node.instances = {"x": _instance("x", READY, 0.0, node="b")}
        tokens: list[int] = []
        started = asyncio.get_running_loop().time()

        async def fail_in_table() -> None:
            await asyncio.sleep(0.05)
            node.instances = {"x": _instance("x", FAILED, 0.0, node="b")}

        failing = asyncio.create_task(fail_in_table())
        with pytest.raises(InstanceFailedError, match="lost b:1"):
            async for event in Router(node).generate(TokenRequest("m", (1, 2), 4, SamplingParams(), ())):
                tokens.append(event.token_id)
        await failing
        return tokens, asyncio.get_running_loop().time() - started

    tokens, took = asyncio.run(run())
    assert tokens == [40] and where == ["b:1"]
    assert 0.3 <= took < 1.5


def test_a_client_that_went_away_is_not_continued():
    """The client leaves while its request waits to be continued: nothing more runs."""
    node, asked, where, place_again = _continuing_node(fail_after=1, place_again_s=0.5)

    async def run() -> list[int]:
        tokens: list[int] = []

        async def consume() -> None:
            async for event in Router(node).generate(TokenRequest("m", (1, 2), 4, SamplingParams(), ())):
                tokens.append(event.token_id)

        placing = asyncio.create_task(place_again())
        client = asyncio.create_task(consume())
        await asyncio.sleep(0.2)  # failed, waiting for the model
        client.cancel()  # the client's answer is cancelled when it goes (Starlette)
        with contextlib.suppress(asyncio.CancelledError):
            await client
        await placing
        await asyncio.sleep(0.3)
        return tokens

    assert asyncio.run(run()) == [40]
    assert where == ["b:1"]


def test_a_continuation_is_queued_however_many_wait():
    """The queue bound refuses a new request, not the continuation of one let in."""
    inst = _instance("x", READY, 0.0, node="a")
    node = SimpleNamespace(
        node_id="a",
        instances={"x": inst},
        streams={},
        engine_stats={},
        max_waiting=1,
        _salt=1,
        _task_counter=iter(range(100)),
        **LIVE,
    )
    router = Router(node)
    owners = [TokenRequest("m", (1,), 1) for _ in range(3)]  # what the API holds the place with
    assert router.reserve(inst, owners[0]) is not None
    with pytest.raises(QueueFullError):
        router.reserve(inst, owners[1])
    assert router.reserve(inst, owners[2], bounded=False) is not None


@pytest.mark.parametrize(
    "waited_s, limit_s, verdict_s, look_s",
    [
        (0.0, 30.0, 6.0, 1.0),  # nothing due within a second: the recheck bound
        (5.5, 30.0, 6.0, 0.5),  # the verdict (the failed instance may be tried again)
        (29.8, 30.0, 6.0, 0.2),  # the limit
        (30.5, 30.0, 6.0, 0.0),  # past both: at once
    ],
)
def test_a_waiting_request_looks_again_when_its_verdict_or_limit_comes(waited_s, limit_s, verdict_s, look_s):
    assert next_look_s(waited_s, limit_s, verdict_s) == pytest.approx(look_s)


def test_a_waiting_request_sees_a_ready_instance_when_the_table_changes_not_on_a_clock():
    """The wait looks at the table when its node says the table changed: an instance that
    becomes ready 0.05 s in is run on then, long before the wait's own recheck."""
    node = SimpleNamespace(
        node_id="a",
        streams={},
        is_stopping=lambda: False,
        down_after_s=5.0,
        instances={"x": _instance("x", LOADING, 0.0)},
    )
    looks: list[float] = []

    async def run() -> float:
        changed = asyncio.Event()

        async def table_changed(timeout_s: float) -> None:
            looks.append(timeout_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout_s)
            changed.clear()

        node.table_changed = table_changed

        async def ready() -> None:
            await asyncio.sleep(0.05)
            node.instances = {"x": _instance("x", READY, 0.0)}
            changed.set()

        started = time.monotonic()
        task = asyncio.create_task(ready())
        inst = await Router(node).wait_for_ready("m")
        await task
        assert inst is not None and inst.instance_id == "x"
        return time.monotonic() - started

    assert asyncio.run(run()) < READY_RECHECK_S
    assert looks == [READY_RECHECK_S]  # one look after the first: the change
