"""Request routing: a request taken by this node is handed to every rank's node of a
ready instance of its model (or forwarded to a node that hosts one), and its tokens are
streamed back from this node's runner."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import weakref
import zlib
from collections.abc import AsyncGenerator, Callable, Collection, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Protocol

from shardline.cancelling import cancel_and_wait
from shardline.node.peer_client import PeerError
from shardline.node.prefix_routing import ROUTE_BLOCK, Candidate, PrefixRecord, choose, route_hashes
from shardline.node.queue_bound import QueueFullError, admits, waiting_count
from shardline.node.runner_processes import RunnerHandle
from shardline.node.speeds import RequestTiming
from shardline.node.state import superseded, why_ended
from shardline.node.status import InstanceStatus
from shardline.node.table import EndCode, Instance, InstanceFailedError, NoInstanceError
from shardline.node.wire import CancelMessage, TaskMessage
from shardline.runner.protocol import Cancel, PrefillProgress, Task, TokenEvent, TokenRequest

log = logging.getLogger(__name__)

READY_WAIT_S = 30.0
"""How long a request waits for its model to be served (seconds): one whose instance failed
before its first output, from the failure (a node found down is replaced after the
coordinator's ``down_after_s + 1``, 6 s by default, then the new instance loads); one
that comes while its model loads, from its arrival."""

READY_RECHECK_S = 1.0
"""Longest a waiting request goes without looking at the table (seconds): it looks again
whenever the table changes (``table_changed``), and at the times its wait's verdict or limit
come (:func:`next_look_s`); this bounds how late it sees its node stopping."""

MAX_RUNS = 2
"""Runs of one request from its start at most: its first, and one more on another
instance where the first failed before any output. A request that itself makes its
runner fail (a bug, an out-of-memory prefill) fails two instances, not every one placed
again for 30 s."""

MAX_CONTINUATIONS = 2
"""Continuations of one request at most (:func:`continuation`: after a failure once it
gave tokens), each counted once submitted, whether or not it then gave more."""

CONTINUE_WAIT_S = 60.0
"""How long a continuation waits for its model to be served again, from the failure
(seconds); then the request ends with the failure's error, as one not continued."""


class AfterFailure(Enum):
    """What a request does when its instance fails under it (:func:`after_failure`)."""

    FAIL = "fail"
    """The client gets the error."""
    RUN_AGAIN = "run_again"
    """It gave nothing yet: run it from the start on the model's next ready instance."""
    CONTINUE = "continue"
    """It gave tokens: run its :func:`continuation` on the model's next ready instance."""


def after_failure(
    code: EndCode,
    final: bool,
    sent: int,
    max_tokens: int,
    other_output: bool,
    runs: int,
    continuations: int,
    stopping: bool,
) -> AfterFailure:
    """What a request on a node that is ``stopping`` or not does when its instance fails
    under it (an InstanceFailedError of ``code``, ``final`` where the node it was
    forwarded to has decided already) after it gave ``sent`` tokens of its ``max_tokens``
    and, where ``other_output``, prompt log-probabilities; ``runs`` from its start so far
    and ``continuations`` so far. Only a failure (not a deletion, nor a stop) is run
    again, and not one the node forwarded to decided: before any output from the start
    (:data:`MAX_RUNS`), after tokens as a continuation (:data:`MAX_CONTINUATIONS`;
    not where the prompt's log-probabilities were given but no token: those of the part
    the failure cut off are lost)."""
    if code != EndCode.INSTANCE_FAILED or final or stopping:
        return AfterFailure.FAIL
    if sent == 0:
        return AfterFailure.RUN_AGAIN if runs < MAX_RUNS and not other_output else AfterFailure.FAIL
    if continuations < MAX_CONTINUATIONS and sent < max_tokens:
        return AfterFailure.CONTINUE
    return AfterFailure.FAIL


def continuation(request: TokenRequest, sent: Sequence[int]) -> TokenRequest:
    """What runs ``request`` on after it gave the tokens ``sent`` (its instance failed):
    the prompt and those tokens as the prompt (``sampling.resumed`` more tokens of it
    are output: the sampler takes up its state after them), the rest of ``max_tokens``,
    the same sampling and stop tokens, and no prompt log-probabilities (given already).
    Its tokens follow ``sent`` as the request's would have: at temperature 0 the same
    text wherever the prefill of the prompt gives the logits decode gave."""
    sent = tuple(sent)
    return replace(
        request,
        prompt=request.prompt + sent,
        max_tokens=request.max_tokens - len(sent),
        sampling=replace(request.sampling, resumed=request.sampling.resumed + len(sent), prompt_logprobs=None),
    )


def ready_instances(
    instances: Mapping[str, Instance], model_id: str, node_id: str, avoid: Collection[str] = (), tokens: int = 0
) -> list[Instance]:
    """The ready instances of ``model_id`` in a table whose context takes ``tokens`` (a
    request's prompt and completion: :func:`request_tokens`), those with a rank on
    ``node_id`` first, then the oldest first; not one a ready instance stands in for
    (``state.superseded``: it is being handed over), nor those in ``avoid``."""
    old = superseded(instances)
    ready = [
        i
        for i in instances.values()
        if i.model_id == model_id
        and i.status == InstanceStatus.READY
        and i.instance_id not in old
        and i.instance_id not in avoid
        and i.context >= tokens
    ]
    return sorted(ready, key=lambda i: (node_id not in i.node_ids(), i.created_at))


def awaited(instances: Mapping[str, Instance], model_id: str) -> list[Instance]:
    """The instances of ``model_id`` a request that finds none ready may wait for: each
    not ``given_up`` (loading, or failed and about to be placed again), in table order."""
    return [i for i in instances.values() if i.model_id == model_id and not i.given_up]


def served_models(instances: Mapping[str, Instance]) -> dict[str, float]:
    """The models with a ready instance, in table order, each with its first such
    instance's ``created_at``."""
    seen: dict[str, float] = {}
    for inst in instances.values():
        if inst.status == InstanceStatus.READY:
            seen.setdefault(inst.model_id, inst.created_at)
    return seen


def request_tokens(request: TokenRequest) -> int:
    """The context a request needs: its prompt and ``max_tokens`` (which the API set to
    what the context it checked the request against leaves, at most). An instance of a
    shorter context would overrun its KV cache with the prompt, or end the completion
    early."""
    return len(request.prompt) + request.max_tokens


class ReadyWait(Enum):
    """What a request that found no ready instance of its model does next."""

    RUN = "run"
    """A ready instance (other than those that failed it) serves its model: run it there,
    from the start."""
    WAIT = "wait"
    """Its model has an instance that is loading, or a failed one the coordinator has not
    given up on (it places it again): look again when the table changes (or at
    :func:`next_look_s`)."""
    GIVE_UP = "give_up"
    """Nothing to wait for, or it waited ``limit_s``: the client gets the error (a 503,
    or the failure)."""


def ready_wait(
    instances: Mapping[str, Instance],
    model_id: str,
    node_id: str,
    failed: Collection[str],
    waited_s: float,
    limit_s: float = READY_WAIT_S,
    verdict_s: float = 6.0,
    tokens: int = 0,
) -> tuple[ReadyWait, Instance | None]:
    """The next step of a request on ``node_id`` with no ready instance of ``model_id``,
    ``waited_s`` seconds into its wait, and with :attr:`ReadyWait.RUN` the instance to run
    on (:func:`ready_instances`' first): run on a ready instance; wait while the model has another
    instance: loading, or failed and not ``given_up`` (the coordinator places it again),
    or one in ``failed`` the table still shows ready; else give up. ``failed``: the
    instances (ids) that failed the request before its first output
    (:meth:`Router.generate`: nothing the client keeps, so running it again elsewhere shows
    only as a delay), not run on again until ``verdict_s`` (the coordinator's time to find
    a node down, ``down_after_s + 1``): a hand-off that did not reach a rank comes before
    the verdict, and an instance still ready after it was not at fault (a lost
    connection). ``tokens``: the context the request needs (:func:`ready_instances`)."""
    ready = ready_instances(instances, model_id, node_id, avoid=failed if waited_s < verdict_s else (), tokens=tokens)
    if ready:
        return ReadyWait.RUN, ready[0]
    if waited_s >= limit_s or not awaited(instances, model_id):
        return ReadyWait.GIVE_UP, None
    return ReadyWait.WAIT, None


def next_look_s(waited_s: float, limit_s: float, verdict_s: float) -> float:
    """Seconds until :func:`ready_wait`'s answer to a request ``waited_s`` into its wait may
    change with no change to the table: at its ``verdict_s`` (where still to come), at its
    ``limit_s``, at most :data:`READY_RECHECK_S`; never below 0."""
    due = [limit_s - waited_s, *([verdict_s - waited_s] if verdict_s > waited_s else [])]
    return max(0.0, min(READY_RECHECK_S, *due))


@dataclass
class RequestStream:
    """A request this node took: its instance and the queue its token events (or the
    instance's failure) arrive on."""

    instance_id: str
    queue: asyncio.Queue


@dataclass
class RequestRuns:
    """One request's runs on this node (:meth:`Router.generate`): what runs (``running``:
    the request, or its :func:`continuation`) and where next (``chosen``), the instances it
    ran on (``tried``) and its task ids there (``tasks``), the tokens it gave (``sent``),
    whether it gave prompt log-probabilities (``shown``), its continuations so far and
    when its first failure before any output came (``failed_at``, ``time.monotonic()``)."""

    request: TokenRequest
    running: TokenRequest
    chosen: Instance | None = None
    tried: list[str] = field(default_factory=list)
    tasks: list[int] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    shown: bool = False
    continuations: int = 0
    failed_at: float | None = None

    def passes(self, event: TokenEvent | PrefillProgress) -> bool:
        """Whether ``event`` of the run goes to the client (a continuation's prefill
        progress does not: its prompt is output given already); its token kept."""
        if isinstance(event, PrefillProgress):
            if self.running is not self.request:
                return False
            self.shown = self.shown or bool(event.logprobs)
        elif event.token_id >= 0:
            self.sent.append(event.token_id)
        return True


class RoutingPeers(Protocol):
    """What the router asks of peers (``shardline.node.peer_client.PeerClient``)."""

    async def deliver(self, address: str, message: TaskMessage | CancelMessage) -> bool: ...
    def generate(
        self, address: str, request: TokenRequest, ran_on: Callable[[str], None] | None = None
    ) -> AsyncGenerator[TokenEvent | PrefillProgress, None]: ...


class LocalRunners(Protocol):
    """This node's runners (``shardline.node.runner_processes.Worker``)."""

    @property
    def runners(self) -> Mapping[str, RunnerHandle]: ...


class ServedRecorder(Protocol):
    """Where the router records what requests showed of speed (``speeds.ServedLog``)."""

    async def add(
        self, inst: Instance, decode: float | None, prefill: float | None, position: float, prompt_tokens: int
    ) -> None: ...


class RouterView(Protocol):
    """What the router reads of its node, and the requests it registers (``streams``, the
    node's: it ends them when it stops)."""

    @property
    def node_id(self) -> str: ...
    @property
    def instances(self) -> Mapping[str, Instance]: ...
    @property
    def streams(self) -> MutableMapping[int, RequestStream]: ...
    @property
    def engine_stats(self) -> Mapping[str, dict]: ...
    @property
    def max_waiting(self) -> int: ...
    @property
    def down_after_s(self) -> float: ...
    @property
    def peer_client(self) -> RoutingPeers: ...
    @property
    def worker(self) -> LocalRunners: ...
    @property
    def served(self) -> ServedRecorder: ...
    def is_stopping(self) -> bool: ...
    async def table_changed(self, timeout_s: float) -> None: ...


class Router:
    """Requests taken by this node, to the ranks that run them. One per node; the state is
    the node's."""

    def __init__(self, node: RouterView) -> None:
        self.node = node
        self._salt = zlib.crc32(node.node_id.encode()) & 0x3FF  # in task ids
        self._task_counter = itertools.count()
        self._recording: set[asyncio.Task] = set()
        # requests this node forwards, by instance: set when the instance fails or goes
        self._forwarding: dict[str, set[asyncio.Event]] = {}
        # requests whose instance failed after they gave tokens: "continued" on another
        # (each continuation), or "failed" (ended with the error)
        self.continuations: dict[str, int] = {"continued": 0, "failed": 0}
        self.prefixes = PrefixRecord()  # the prompts sent to each instance (routing by prefix)

    def ready_instance(self, model_id: str, tokens: int = 0) -> Instance:
        """A ready instance of the model whose context takes ``tokens``, preferring one
        with a rank on this node; not one a ready instance stands in for
        (``state.superseded``: it is being handed over).

        Raises:
            NoInstanceError: none is ready.
        """
        ready = ready_instances(self.node.instances, model_id, self.node.node_id, tokens=tokens)
        if not ready:
            raise NoInstanceError(f"no ready instance serves model {model_id!r}")
        return ready[0]

    def route(self, prompt: Sequence[int], within: Instance, local_only: bool = False) -> Instance:
        """Of the ready instances of ``within``'s model whose context is at least its own
        (``within`` among them: a request checked against it fits them all), and with
        ``local_only`` of those with a rank on this node (a forwarded request: another hop
        could send it back), the one a request of ``prompt`` goes to
        (:func:`~shardline.node.prefix_routing.choose`: the longest prefix this node sent
        it, then a rank on this node, then the fewest requests in flight, then the
        oldest); ``within`` where none is ready."""
        ready = [
            i
            for i in ready_instances(self.node.instances, within.model_id, self.node.node_id, tokens=within.context)
            if not local_only or self.node.node_id in i.node_ids()
        ]
        if len(ready) < 2:
            return ready[0] if ready else within
        hashes = route_hashes(prompt)
        chosen = choose(
            [
                Candidate(
                    i.instance_id,
                    self.prefixes.matched(i.instance_id, hashes) if i.prefix_cache else 0,
                    self.node.node_id in i.node_ids(),
                    self._in_flight(i.instance_id),
                    i.created_at,
                )
                for i in ready
            ]
        )
        return next(i for i in ready if i.instance_id == chosen)

    def _in_flight(self, instance_id: str) -> int:
        """Requests this node runs on the instance's ranks or forwards to it."""
        return sum(s.instance_id == instance_id for s in self.node.streams.values()) + len(
            self._forwarding.get(instance_id, ())
        )

    def models(self) -> list[dict]:
        """Models with a ready instance: ``[{"id", "created"}]`` (:func:`served_models`)."""
        return [{"id": m, "created": int(t)} for m, t in served_models(self.node.instances).items()]

    def new_task_id(self) -> int:
        """int64 ids that sort by creation time: ms (41 bits) | node salt (10) | counter (12)."""
        ms = int(time.time() * 1000) - 1_700_000_000_000
        return (ms << 22) | (self._salt << 12) | (next(self._task_counter) & 0xFFF)

    def reserve(self, inst: Instance, owner: object, bounded: bool = True) -> int | None:
        """Take a place in the queue of ``inst`` for a request this node runs: check the
        bound on waiting requests (:mod:`shardline.node.queue_bound`) and register the
        request's stream under a new task id, which :meth:`generate` then runs. The place
        is given up when :meth:`generate` ends, or when ``owner`` (what holds the id) is
        garbage collected without running it. None where this node holds no rank of
        ``inst`` (the node it forwards to decides there). Not ``bounded``: a continuation
        of a request let in once (:func:`continuation`) takes a place whatever waits.

        Raises:
            QueueFullError: as many requests wait as the instance takes.
        """
        if self.node.node_id not in inst.node_ids():
            return None
        task_id = self._register(inst, bounded)
        weakref.finalize(owner, self.node.streams.pop, task_id, None)
        return task_id

    def _register(self, inst: Instance, bounded: bool = True) -> int:
        """Check the queue bound (unless not ``bounded``) and register a stream for a new
        task of ``inst`` (no ``await`` between the two, so concurrent requests are counted
        one by one)."""
        own = {task_id for task_id, s in self.node.streams.items() if s.instance_id == inst.instance_id}
        waiting = waiting_count(own, self.node.engine_stats.get(inst.instance_id))
        if bounded and not admits(waiting, self.node.max_waiting):
            raise QueueFullError(
                f"the model {inst.model_id!r} has {waiting} requests waiting, as many "
                f"as this node queues ({self.node.max_waiting}); retry later"
            )
        task_id = self.new_task_id()
        self.node.streams[task_id] = RequestStream(inst.instance_id, asyncio.Queue())
        return task_id

    async def generate(
        self,
        request: TokenRequest,
        task_id: int | None = None,
        ran_on: Callable[[Instance], None] | None = None,
        on: Instance | None = None,
    ) -> AsyncGenerator[TokenEvent | PrefillProgress, None]:
        """Run one request on a ready instance of its model and yield its events: the
        progress of a prefill that takes more than one engine step, then its tokens.
        ``task_id``: the place :meth:`reserve` took for it, if one was taken; ``ran_on``:
        called with each instance the request is run on or forwarded to (a second one
        after a failure, below), before its events; ``on``: the instance the API checked
        it against, to run on where no place was taken in another's queue (its context
        may be longer than that of the one this node prefers), while it is ready. Else it runs
        on the first of :func:`ready_instances` whose context takes it
        (:func:`request_tokens`).

        Where its instance fails (a runner, node or link lost) before the request yielded
        output (a token, or prompt log-probabilities; during its hand-off or prefill), it
        waits for the model to be served again and runs there from the start
        (:meth:`wait_for_ready`, at most :data:`READY_WAIT_S` after the failure, once:
        :data:`MAX_RUNS`): the client sees a delay, and a prefill's progress start again,
        not an error. Where it fails after tokens, the request's :func:`continuation` (its
        prompt and the tokens yielded as the prompt, the rest of its ``max_tokens``) runs
        on the model's next ready instance (the one placed again), at most
        :data:`CONTINUE_WAIT_S` after the failure, at most :data:`MAX_CONTINUATIONS` times:
        the client sees a pause, then the tokens that follow (the continuation's prefill
        progress is not yielded). :func:`after_failure` decides; else the failure ends it.
        A client that goes away closes this, and nothing runs on.

        Closing the iterator early cancels the request on every rank.

        Raises:
            QueueFullError: as many requests wait as the instance takes (here, or on the
                node forwarded to).
            InstanceFailedError: the instance failed mid-request, or none is ready when it
                starts (the API found one ready before tokenizing; it has gone since, e.g.
                its nodes restarted: a 503 to retry, not an internal error) and no other
                became ready in time.
        """
        runs = RequestRuns(request, request, chosen=on)
        while True:
            try:
                # closed here, so that its cleanup (its stream, the ranks' cancel) runs when
                # this closes, not when the loop collects it
                async with contextlib.aclosing(
                    self._attempt(runs.running, task_id, runs.chosen, runs.tried, ran_on, runs.tasks)
                ) as events:
                    async for event in events:
                        if runs.passes(event):
                            yield event
                return
            except InstanceFailedError as exc:
                await self._recover(runs, exc)
                task_id = None

    async def _recover(self, runs: RequestRuns, exc: InstanceFailedError) -> None:
        """After ``exc`` ended a run of ``runs``' request: wait for the instance it runs on
        next (``runs.chosen``), from its start or as its continuation (``runs.running``),
        as :func:`after_failure` decides (see :meth:`generate`).

        Raises:
            InstanceFailedError: ``exc``, where the request ends with it.
        """
        request, sent = runs.request, runs.sent
        step = after_failure(
            exc.code,
            exc.final,
            len(sent),
            request.max_tokens,
            runs.shown,
            len(runs.tried),
            runs.continuations,
            self.node.is_stopping(),
        )
        if step == AfterFailure.FAIL:
            if sent and exc.code == EndCode.INSTANCE_FAILED and not exc.final:
                self.continuations["failed"] += 1
                log.info(
                    "%s: the request (model %r, tasks %s) ends after %d tokens, not continued (%d continuations)",
                    exc,
                    request.model_id,
                    runs.tasks,
                    len(sent),
                    runs.continuations,
                )
            raise exc
        if step == AfterFailure.RUN_AGAIN:
            runs.failed_at = runs.failed_at or time.monotonic()
            log.info(
                "%s: the request had no output yet; waiting for its model %r to be served again", exc, request.model_id
            )
            runs.chosen = await self.wait_for_ready(
                request.model_id, runs.tried, runs.failed_at, request_tokens(request)
            )
            if runs.chosen is None:
                raise exc
            return
        since = time.monotonic()
        log.info(
            "%s: the request (model %r, tasks %s) gave %d tokens; waiting for its "
            "model to be served again to continue it",
            exc,
            request.model_id,
            runs.tasks,
            len(sent),
        )
        runs.chosen = await self.wait_for_ready(
            request.model_id, runs.tried, since, request_tokens(request), limit_s=CONTINUE_WAIT_S
        )
        if runs.chosen is None:
            self.continuations["failed"] += 1
            log.info(
                "the request (model %r, tasks %s) ends after %d tokens: its model was "
                "not served again (it could not be placed, or not within %.0f s)",
                request.model_id,
                runs.tasks,
                len(sent),
                CONTINUE_WAIT_S,
            )
            raise exc
        runs.continuations += 1
        self.continuations["continued"] += 1
        runs.running = continuation(request, sent)
        log.info(
            "the request (model %r, tasks %s) continues after %d tokens on instance %s "
            "(from %s), %.1f s after the failure (continuation %d of at most %d)",
            request.model_id,
            runs.tasks,
            len(sent),
            runs.chosen.instance_id,
            runs.tried[-1] if runs.tried else None,
            time.monotonic() - since,
            runs.continuations,
            MAX_CONTINUATIONS,
        )

    async def wait_for_ready(
        self,
        model_id: str,
        failed: Collection[str] = (),
        since: float | None = None,
        tokens: int = 0,
        limit_s: float = READY_WAIT_S,
    ) -> Instance | None:
        """A ready instance of ``model_id`` once there is one (:func:`ready_wait` says
        whether to wait; ``failed``, ``tokens`` and ``limit_s`` are its, ``since`` when the
        wait began, ``time.monotonic()`` seconds, default now); None where there is nothing
        to wait for, the wait ran out or the node is stopping. It looks at the table when
        it changes (the node's ``table_changed``), not on a clock."""
        since = time.monotonic() if since is None else since
        verdict_s = self.node.down_after_s + 1
        while not self.node.is_stopping():
            waited = time.monotonic() - since
            step, inst = ready_wait(
                self.node.instances,
                model_id,
                self.node.node_id,
                failed,
                waited,
                limit_s=limit_s,
                verdict_s=verdict_s,
                tokens=tokens,
            )
            if step != ReadyWait.WAIT:
                return inst
            await self.node.table_changed(next_look_s(waited, limit_s, verdict_s))
        return None

    async def _attempt(
        self,
        request: TokenRequest,
        task_id: int | None,
        chosen: Instance | None,
        tried: list[str],
        ran_on: Callable[[Instance], None] | None,
        tasks: list[int] | None = None,
    ) -> AsyncGenerator[TokenEvent | PrefillProgress, None]:
        """One run of :meth:`generate`'s request (or its continuation) on an instance (the
        reserved one, where it still is; else ``chosen``, else the first ready one), or
        through the node of one; the instance's id is appended to ``tried``, the instance
        passed to ``ran_on`` and the task's id, where it runs on this node's ranks,
        appended to ``tasks``. A continuation takes a place in the queue even where the
        queue is full (the request was let in once).

        Raises:
            QueueFullError, InstanceFailedError: as :meth:`generate`.
        """
        stream = None if task_id is None else self.node.streams.get(task_id)
        inst = None if stream is None else self.node.instances.get(stream.instance_id)
        if inst is None:
            if task_id is not None:
                self.node.streams.pop(task_id, None)  # its instance is gone: find another
            stream = None
            ready = ready_instances(
                self.node.instances, request.model_id, self.node.node_id, tokens=request_tokens(request)
            )
            inst = next(
                (i for i in ready if chosen is not None and i.instance_id == chosen.instance_id),
                ready[0] if ready else None,
            )  # chosen, while it is ready
            if inst is None:
                raise InstanceFailedError(
                    f"no ready instance serves model {request.model_id!r} any "
                    "more (its instance failed or its nodes restarted since the "
                    "request came); retry later"
                )
        tried.append(inst.instance_id)
        if ran_on is not None:
            ran_on(inst)
        if inst.prefix_cache:  # its cache will hold this prompt: later ones that start alike go there
            self.prefixes.keep_only(set(self.node.instances))
            self.prefixes.record(
                inst.instance_id,
                route_hashes(request.prompt),
                (inst.kv_tokens or inst.max_batch * inst.context) // ROUTE_BLOCK,
            )
        if stream is None:
            if self.node.node_id not in inst.node_ids():
                async with contextlib.aclosing(self._forward(inst, request, ran_on)) as forwarded:
                    async for event in forwarded:
                        yield event
                return
            task_id = self._register(inst, bounded=request.sampling.resumed == 0)
            stream = self.node.streams[task_id]
        assert task_id is not None and stream is not None
        if tasks is not None:
            tasks.append(task_id)
        async with contextlib.aclosing(
            self._run_here(stream, inst, Task.of(task_id, self.node.node_id, request))
        ) as run:
            async for event in run:
                yield event

    async def _run_here(
        self, stream: RequestStream, inst: Instance, task: Task
    ) -> AsyncGenerator[TokenEvent | PrefillProgress, None]:
        """Hand ``task`` to ``inst``'s ranks and yield its events from ``stream`` (this
        node's runner's) until it finishes, its speed kept; closed early, it is cancelled
        on every rank.

        Raises:
            InstanceFailedError: the instance failed under it (its stream's error).
        """
        finished = False
        stats = self.node.engine_stats
        timing = RequestTiming.start(task.task_id, len(task.prompt), stats.get(inst.instance_id))
        handing = asyncio.get_running_loop().create_task(
            self._hand_over(stream, inst, TaskMessage(instance_id=inst.instance_id, task=task))
        )
        try:
            while True:
                event = await stream.queue.get()
                if isinstance(event, Exception):
                    raise event
                if isinstance(event, TokenEvent):
                    if event.token_id >= 0:
                        timing.token(stats.get(inst.instance_id), event.drafted, event.cached_tokens)
                    if event.finish_reason is not None:
                        finished = True
                        if event.finish_reason != "cancelled":
                            self._record(inst, timing)
                yield event
                if finished:
                    return
        finally:
            handing.cancel()  # done by now unless the request ended first
            self.node.streams.pop(task.task_id, None)
            if not finished:
                asyncio.get_running_loop().create_task(self._cancel(inst, task.task_id))

    def _record(self, inst: Instance, timing: RequestTiming) -> None:
        """Keep what a finished request shows of its instance's speed (in the background:
        its prediction may read the model's card)."""
        decode, prefill = timing.rates()
        if decode is not None or prefill is not None:
            task = asyncio.get_running_loop().create_task(
                self.node.served.add(inst, decode, prefill, timing.position, timing.prompt_tokens)
            )
            self._recording.add(task)  # held until done (the loop keeps weak references)
            task.add_done_callback(self._recording.discard)

    async def _hand_over(self, stream: RequestStream, inst: Instance, message: TaskMessage) -> None:
        """:meth:`_deliver` a task while its request reads its stream, where a failure to
        deliver goes. A rank's node that takes the connection but does not answer
        (paused: SIGSTOP, a closed lid) holds the hand-off to its 10 s timeout; the request
        ends sooner, when the instance fails in the table (the node is found down) and
        its streams are failed (trial 9: the 503 came at the timeout)."""
        try:
            await self._deliver(inst, message)
        except Exception as exc:  # the request raises it
            stream.queue.put_nowait(exc)

    async def _deliver(self, inst: Instance, message: TaskMessage | CancelMessage) -> None:
        """Hand a task or a cancellation to the runner of every rank of ``inst``.

        Raises:
            InstanceFailedError: a rank's node or runner could not be reached (a task that
                some rank never receives would never start).
        """
        local = message.task if isinstance(message, TaskMessage) else Cancel(message.task_id)
        missed = []  # why, per rank that did not take it
        if self.node.node_id in inst.node_ids() and not self.deliver_local(inst.instance_id, local):
            missed.append(
                f"this node's runner ({self.node.node_id}) is not running (it stops when "
                f"another rank of the instance fails)"
            )
        remote = [r for r in inst.ranks if r.node_id != self.node.node_id]
        results = await asyncio.gather(
            *(self.node.peer_client.deliver(r.address, message) for r in remote), return_exceptions=True
        )
        for rank, result in zip(remote, results):
            if isinstance(result, BaseException) and not isinstance(result, PeerError):
                raise result
            if isinstance(result, PeerError):
                missed.append(f"node {rank.node_id} could not be reached ({result})")
            elif result is not True:
                missed.append(
                    f"node {rank.node_id}'s runner is not running (it stops when another rank of the instance fails)"
                )
        if missed:
            raise InstanceFailedError(
                f"instance {inst.instance_id}: the request could not be handed to every rank: {'; '.join(missed)}"
            )

    async def _cancel(self, inst: Instance, task_id: int) -> None:
        """Tell every rank to drop a task (best effort: a rank that is gone has no batch;
        nothing to do once the instance failed, its runners are stopped)."""
        current = self.node.instances.get(inst.instance_id)
        if current is None or current.status == InstanceStatus.FAILED:
            return
        try:
            await self._deliver(inst, CancelMessage(instance_id=inst.instance_id, task_id=task_id))
        except InstanceFailedError as exc:  # a rank that cannot take it runs nothing of it
            log.debug("cancel of task %d: %s", task_id, exc)

    def deliver_local(self, instance_id: str, message: Task | Cancel) -> bool:
        """Pass a task or cancellation to this node's runner of the instance; whether it
        took it."""
        handle = self.node.worker.runners.get(instance_id)
        return handle is not None and handle.send(message)

    def dispatch(self, events: tuple[TokenEvent | PrefillProgress, ...]) -> None:
        for event in events:
            stream = self.node.streams.get(event.task_id)
            if stream is not None:
                stream.queue.put_nowait(event)

    def fail_streams(self, instance_id: str, error: str | None, code: EndCode = EndCode.INSTANCE_FAILED) -> None:
        for stream in list(self.node.streams.values()):
            if stream.instance_id == instance_id:
                stream.queue.put_nowait(InstanceFailedError(f"instance {instance_id}: {error}", code))

    def end_forwarded(self) -> None:
        """End the requests this node forwards to instances that failed or left the table
        (their node may be cut off: its stream would hang for as long as the partition
        lasts, trial 7: 165 s)."""
        for instance_id, ended in self._forwarding.items():
            inst = self.node.instances.get(instance_id)
            if inst is None or inst.status == InstanceStatus.FAILED:
                for event in ended:
                    event.set()

    async def _forward(
        self, inst: Instance, request: TokenRequest, ran_on: Callable[[Instance], None] | None = None
    ) -> AsyncGenerator[TokenEvent | PrefillProgress, None]:
        """Run the request through the node of the instance's first rank, until it ends or
        the instance it runs on fails in the table (:meth:`end_forwarded`). ``ran_on`` is
        called with each instance that node names as the one running it (from this node's
        table: it may choose another ready one, or run the request again on another);
        from then on that one is watched, not the first.

        Raises:
            InstanceFailedError: that node could not be reached, the request failed
                there, or the instance failed.
        """
        ended = asyncio.Event()
        watched = [inst.instance_id]  # the instance whose failure ends the request here

        def watch(instance_id: str | None) -> None:
            if watched:
                waiting = self._forwarding.get(watched[0], set())
                waiting.discard(ended)
                if not waiting:
                    self._forwarding.pop(watched[0], None)
                watched.clear()
            if instance_id is not None:
                watched.append(instance_id)
                self._forwarding.setdefault(instance_id, set()).add(ended)

        def named(instance_id: str) -> None:
            running = self.node.instances.get(instance_id)
            if running is not None:  # unknown here yet: the last known stays
                watch(instance_id)
                if ran_on is not None:
                    ran_on(running)

        watch(inst.instance_id)
        events = self.node.peer_client.generate(inst.ranks[0].address, request, named)
        stop = asyncio.ensure_future(ended.wait())
        following: asyncio.Future | None = None
        try:
            while True:
                following = asyncio.ensure_future(anext(events))
                await asyncio.wait({following, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not following.done():
                    code, error = why_ended(self.node.instances, watched[0])
                    raise InstanceFailedError(f"instance {watched[0]}: {error}", code)
                try:
                    event = following.result()
                except StopAsyncIteration:
                    return
                yield event
        except PeerError as exc:
            raise InstanceFailedError(f"node {inst.ranks[0].node_id}: {exc}") from exc
        finally:
            stop.cancel()
            watch(None)  # before any await: a cancelled one ends this finally
            if following is not None and not following.done():
                # Its cleanup closes the stream, and so the connection to the node that
                # runs the request, which cancels it there; it runs to its end, however
                # often this is cancelled meanwhile.
                await cancel_and_wait(following)
            await events.aclose()
