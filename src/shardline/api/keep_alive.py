"""Ollama's ``keep_alive``: how long a model stays placed after a request.

Ollama's forms (docs/api.md, "keep_alive"; its ``api.Duration``): a duration string as Go's
``time.ParseDuration`` reads it (``"5m"``, ``"1h30m"``, ``"300ms"``, ``"0"``), or a number
of seconds; a negative value keeps the model loaded for ever; ``0`` unloads it.

shardline differs in one default: a request without ``keep_alive`` changes nothing, and a
placed model stays placed (Ollama unloads after 5 minutes unless told otherwise), because a
cluster's placement is an explicit act (``POST /cluster/instances``). As in Ollama, a request
for a model the cluster has no instance of loads it (:meth:`KeepAlive.load`: placed as
``POST /cluster/instances`` with ``sharding: auto`` places it, then waited for), so a
client's ``keep_alive`` never leaves the model out of reach. With ``0`` the node
deletes every instance of the model through the coordinator (as ``DELETE
/cluster/instances/{id}`` does) once no request of it runs; with a duration the node asks
the coordinator to record a deadline on each instance in the table
(``Instance.keep_until``; :meth:`~shardline.node.coordinator.Coordinator.keep_alive`), so
that every node shows it in ``/api/ps`` and it outlives the node that set it; the
coordinator deletes the instance once that much time has passed idle after the last
request that set it (an instance placed again keeps its deadline). The coordinator checks
the deadlines every :data:`CHECK_INTERVAL_S`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from shardline.api.coordinator_forward import ask_coordinator
from shardline.api.errors import API, error_body
from shardline.api.model_facts import placed
from shardline.node.peer_client import PeerError
from shardline.node.status import InstanceStatus
from shardline.node.table import Instance
from shardline.node.wire import KeepAliveMessage

if TYPE_CHECKING:
    from shardline.node.node import Node

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
"""How often the node looks for instances whose keep_alive has run out, seconds."""

LOAD_TIMEOUT_S = 300.0
"""How long a request waits for a model it loads to be ready, seconds."""

LOAD_POLL_S = 0.2

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION = re.compile(r"(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+")


def parse_keep_alive(value: object) -> float | None:
    """``keep_alive`` in seconds: None when absent (None), ``math.inf`` for a negative one
    (for ever), else the duration (0: unload now).

    Accepts a JSON number of seconds, or a Go duration string: an optional sign, then one or
    more decimal numbers each with a unit (ns, us, µs, ms, s, m, h), or ``"0"``.

    Raises:
        ValueError: anything else (a boolean, a string without units such as ``"10"``, an
            unknown unit, NaN); the message names ``keep_alive``.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f'keep_alive must be a duration such as "5m" or a number of seconds, not {value!r}')
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text[1:] if text[:1] in "+-" else text
        if body == "0":
            seconds = 0.0
        elif _DURATION.fullmatch(body):
            seconds = sum(float(n) * _UNITS[unit] for n, unit in _PART.findall(body))
        else:
            raise ValueError(
                f'keep_alive: {value!r} is not a duration (e.g. "5m", "1h30m", "0", or a number of seconds)'
            )
        seconds *= sign
    else:
        seconds = float(value)
    if math.isnan(seconds):
        raise ValueError("keep_alive must not be NaN")
    return math.inf if seconds < 0 else seconds


def expired(now: float, instances: Iterable[Instance], busy: Collection[str]) -> list[str]:
    """The ids of ``instances`` whose keep_alive deadline (``keep_until``, ``time.time()``
    seconds) is at or before ``now`` and that have no request running (``busy``), sorted."""
    return sorted(
        i.instance_id
        for i in instances
        if i.keep_until is not None and i.keep_until <= now and i.instance_id not in busy
    )


def load_state(statuses: Collection[InstanceStatus]) -> bool | None:
    """Whether a model whose instances have ``statuses`` is loaded: True once one is ready,
    False when there are some and every one failed, None while it is still loading (or
    placed but not yet in this node's table)."""
    if InstanceStatus.READY in statuses:
        return True
    if statuses and all(s == InstanceStatus.FAILED for s in statuses):
        return False
    return None


class KeepAlive:
    """One node's Ollama requests in flight, and its way to the keep_alive deadlines the
    table holds.

    Attributes:
        running: instance id -> Ollama requests of it this node runs now.
    """

    def __init__(self) -> None:
        self.running: Counter[str] = Counter()
        self._loading: dict[str, asyncio.Lock] = {}

    async def load(self, node: "Node", model: str, timeout_s: float = LOAD_TIMEOUT_S) -> tuple[int, dict] | None:
        """Make sure ``model`` has a ready instance, as Ollama loads the model a request
        names: place one (``sharding: auto``, through the coordinator) when the node's
        table has none, then wait until one is ready. One placement at a time per model
        on this node (concurrent requests wait for the same one). None when an instance is
        ready; else the status and cluster-API body of why not: the placement's refusal
        (404 for an unknown model, 409 for no room), 500 when every instance failed, 503
        after ``timeout_s`` seconds."""
        from shardline.api.create_instance import CreateInstance, create

        async with self._loading.setdefault(model, asyncio.Lock()):
            if not placed(node, model):
                if not node.logistics.held(model):  # not 503 when no coordinator answers: unknown
                    return 404, error_body(API.CLUSTER, 404, f"no node holds a model {model}", "model")
                status, body = await create(node, CreateInstance(model=model, sharding="auto"))
                if status >= 400:
                    return status, body
                log.info("loading %s on request: instance %s", model, body.get("instance_id"))
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                state = load_state([i.status for i in placed(node, model)])
                if state:
                    return None
                if state is False:
                    failed = "; ".join(f"{i.instance_id}: {i.error}" for i in placed(node, model))
                    return 500, error_body(API.CLUSTER, 500, f"model {model} failed to load ({failed})")
                await asyncio.sleep(LOAD_POLL_S)
        return 503, error_body(API.CLUSTER, 503, f"model {model} was not ready after {timeout_s:g} s")

    def begin(self, instance_ids: Iterable[str]) -> None:
        """A request of these instances started (they are busy until :meth:`end`)."""
        self.running.update(instance_ids)

    def end(self, node: "Node", instance_ids: list[str], seconds: float | None) -> None:
        """A request ended; with ``seconds`` (its keep_alive), their deadline is that long
        from now (recorded in the background: :meth:`keep`)."""
        self.running.subtract(instance_ids)
        self.running = +self.running  # drop zeros
        if seconds is not None:
            node.background(keep(node, instance_ids, seconds))

    def busy(self, node: "Node") -> set[str]:
        """The instances with a request running anywhere this node knows of: its own
        Ollama requests, the requests its ranks run or that it took, and its peers' busy
        instances (as of their last poll)."""
        out = set(self.running) | set(node.busy_instances())
        out |= {s.instance_id for s in node.streams.values()}
        for peer in node.peers.values():
            out |= set(peer.busy)
        return out

    async def check(self, node: "Node", now: float | None = None) -> list[str]:
        """Coordinator: delete the instances whose deadline passed while idle; the ids
        deleted (none where this node does not coordinate)."""
        if not node.is_coordinator():
            return []
        due = expired(time.time() if now is None else now, node.instances.values(), self.busy(node))
        for instance_id in due:
            status, body = await unload(node, instance_id)
            log.info("keep_alive: unloading instance %s: %s %s", instance_id, status, body)
        return due

    async def run(self, node: "Node") -> None:
        """Check every :data:`CHECK_INTERVAL_S` until cancelled."""
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            try:
                await self.check(node)
            except Exception as exc:  # noqa: BLE001 - the loop must outlive one failed check
                log.warning("keep_alive check failed: %r", exc)


async def keep(node: "Node", instance_ids: list[str], seconds: float) -> None:
    """Record in the table that the instances are kept ``seconds`` idle from now
    (``math.inf``: for ever), through the coordinator; a coordinator that cannot be
    reached is logged, and the deadlines stay as they were."""
    if node.is_coordinator():
        await node.coordinator.keep_alive(instance_ids, seconds)
        return
    message = KeepAliveMessage(instance_ids=instance_ids, seconds=None if math.isinf(seconds) else seconds)
    try:
        if await node.peer_client.keep_alive(node.address_of(node.coordinator_id()), message):
            return
        problem = "it does not coordinate (any more)"
    except PeerError as exc:
        problem = str(exc)
    log.warning("keep_alive of %s not recorded by the coordinator: %s", ", ".join(instance_ids), problem)


async def unload(node: "Node", instance_id: str) -> tuple[int, dict]:
    """Delete an instance through the coordinator, as ``DELETE /cluster/instances/{id}``
    does: the HTTP status and body that request would answer (``deleted``: the id
    removed, the one placed again in ``instance_id``'s place where it failed)."""
    if not node.is_coordinator():
        return await ask_coordinator(node, "DELETE", f"/cluster/instances/{instance_id}")
    deleted = await node.coordinator.delete_instance(instance_id)
    if deleted is None:
        return 404, error_body(API.CLUSTER, 404, f"no instance {instance_id}", "instance_id")
    return 200, {"deleted": deleted}
