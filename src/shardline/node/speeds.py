"""What a node knows of speed: its machine's profile, measured when the node is idle
(:class:`HostProfiler`), and what the placements it served really did
(:class:`ServedLog`, fed by :class:`RequestTiming` from the requests it streams).

The profile: a node starts from the machine's cached profile
(``host-profile-v<N>-<device>-threads<T>.json`` in the data directory, shared by the nodes of a
machine whose runners have T threads) as a first guess, and measures
again (:func:`~shardline.node.profile.measure_host_async`: a child process, rates the
median of several samples) only while it is idle (:func:`node_idle`: no request in
flight, no runner of it loading or serving, and under :data:`OTHER_LOAD_PERCENT` of the
CPUs used by other programs, ``psutil.cpu_percent``), after :data:`FIRST_IDLE_S` idle
when it has no first guess, else once it has been idle for ``idle_s``, and again every
``interval_s`` it is idle for (:func:`measure_due`). A measurement the node stops being
idle during is killed and thrown away, and tried again once it is idle: a profile taken
while its runners work measures them, not the machine. Other programs' load is checked
before it starts (the child's own start spikes the load): a node serving nothing while
llama-server decoded on its 2 cores measured 39 ms a decode layer where the idle
machine takes under 0.1 ms, and cached that for the machine. With no profile at all it
measures whatever the load: better than none, and measured again later. Load that comes
once it measures is read at the end (the child's ``other_cores``): a profile measured
beside other programs' work (:func:`disturbed`) is not kept (a first one under a busy
core read weights 100x slower than the quiet machine: no profile, the preview's
defaults, is nearer), and the node measures again :data:`RETRY_S` later, once it is idle
and other programs rest; where the machine has no good profile cached, it is cached as
the machine's last try, which no node takes as a first guess, and a node that finds such
a try of the last hour measures only once other programs rest too (a test suite's nodes
each measured beside it).
It never holds up the node's start: it runs in the background. Nodes of one machine (a
local cluster) share the file: each waits ``idle_s`` plus up to 10 s by its id before it
measures, one at a time (a lock file beside the cache), and takes a profile another
node of the machine measured within ``interval_s`` instead of measuring again.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import psutil

from shardline.machine_cache import write_atomically
from shardline.node.status import InstanceStatus, RankStatus
from shardline.placement.served import PlacementKey, ServedSpeed, record, request_rates, with_prediction

if TYPE_CHECKING:
    from shardline.node.profile import HostProfile
    from shardline.node.table import Instance

log = logging.getLogger(__name__)

IDLE_S = 10.0
"""Seconds a node with a first-guess profile stays idle before it measures its machine."""

FIRST_IDLE_S = 3.0
"""Seconds a node with no profile at all stays idle before it measures: not at its very
start, where a local cluster places a model within a second and the measurement (a child
importing torch, 1.5 s of CPU) would only be killed, having taken that CPU from the start."""

INTERVAL_S = 3600.0
"""Seconds between measurements of an idle node's machine."""

RETRY_S = 60.0
"""Seconds after a measurement other programs disturbed (:func:`disturbed`) before the
node, once idle, measures again."""

PROFILE_SECONDS = 1.0
"""The timed loops of one measurement, seconds in all (child start and imports aside)."""

PROFILE_SAMPLES = 5
"""Timed windows each measured rate is the median of."""

OTHER_LOAD_PERCENT = 20.0
"""Percent of all the machine's CPUs that other work may use while the node counts as
idle: an idle node and its siblings of a local cluster use a few percent (heartbeats,
the event loop); another program decoding on the cores uses most of them."""

_SETTLED = (RankStatus.READY, RankStatus.FAILED, RankStatus.STOPPED)


def node_idle(
    in_flight: int, busy: Iterable[str], rank_statuses: Iterable[RankStatus], other_load_percent: float = 0.0
) -> bool:
    """Whether a node's runners leave its machine alone: no request of it in flight
    (``in_flight`` streams), no instance with requests on its rank (``busy``), none of
    its ranks starting, fetching or loading (``rank_statuses``), and other programs using
    under :data:`OTHER_LOAD_PERCENT` of the machine's CPUs (``other_load_percent``: the
    system-wide use, percent of all CPUs, over the last second; 0 where it does not
    count)."""
    return (
        in_flight == 0
        and not list(busy)
        and all(s in _SETTLED for s in rank_statuses)
        and other_load_percent < OTHER_LOAD_PERCENT
    )


def disturbed(other_cores: float, cpus: int) -> bool:
    """Whether a profile was measured beside other programs' work: they kept over
    :data:`OTHER_LOAD_PERCENT` of the machine's ``cpus`` busy while it ran
    (``HostProfile.other_cores``). Its figures are then theirs as much as the machine's
    (a node measuring while llama-server decoded on its 2 cores read its weights at 0.22
    GB/s where the quiet machine reads 21), so the node does not keep it."""
    return other_cores * 100 > OTHER_LOAD_PERCENT * max(cpus, 1)


def measure_due(
    now: float,
    idle_since: float | None,
    measured_at: float | None,
    first_guess: bool,
    idle_s: float = IDLE_S,
    interval_s: float = INTERVAL_S,
) -> bool:
    """Whether to measure the machine now.

    Args:
        now, idle_since: seconds on one clock; ``idle_since`` None: the node is not idle.
        measured_at: when this node last measured (or tried to), None: never.
        first_guess: it holds a cached profile to go on with meanwhile.
        idle_s: idle seconds before a measurement, when there is a profile to go on with.
        interval_s: seconds between measurements.
    """
    if idle_since is None:
        return False
    if measured_at is None and not first_guess:
        return now - idle_since >= FIRST_IDLE_S
    if measured_at is not None and now - measured_at < interval_s:
        return False
    return now - idle_since >= idle_s


class ProfilerView(Protocol):
    """What the profiler reads of its node (read-only)."""

    @property
    def node_id(self) -> str: ...
    @property
    def profile(self) -> dict | None: ...
    @property
    def instances(self) -> Mapping[str, Instance]: ...
    @property
    def streams(self) -> Mapping[int, object]: ...
    def busy_instances(self) -> list[str]: ...


class HostProfiler:
    """The node's :class:`~shardline.node.profile.HostProfile` (``node.profile``, a dict):
    the cached one first, measured again while the node is idle (module docstring).

    Args:
        view: the node, read (its state, its profile now).
        keep: keeps a profile as the node's (``node.profile``).
        cache: the machine's profile file (None: none).
        threads, device: its runners' (what the profile measures).
        idle_s, interval_s: :func:`measure_due`'s.
    """

    def __init__(
        self,
        view: ProfilerView,
        keep: Callable[[dict | None], None],
        cache: Path | None,
        threads: int = 0,
        device: str = "auto",
        idle_s: float = IDLE_S,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self.view = view
        self.keep = keep
        self.cache = cache
        self.threads = threads
        self.device = device
        self.idle_s = idle_s + zlib.crc32(view.node_id.encode()) % 1000 / 100  # staggered
        self.interval_s = interval_s
        self.measured_at: float | None = None  # time.monotonic() of the last try

    def idle(self, any_load: bool = False) -> bool:
        """:func:`node_idle` now, with the machine's load since the last call (each call
        starts a window). ``any_load``: other programs' load does not count (the node
        has no profile yet, or its measurement runs: the child's own start spikes the
        load, and the samples' median outlasts a burst)."""
        node = self.view
        statuses = [
            r.status
            for inst in node.instances.values()
            if inst.status != InstanceStatus.FAILED
            for r in inst.ranks
            if r.node_id == node.node_id
        ]
        other = 0.0 if any_load else psutil.cpu_percent()
        return node_idle(len(node.streams), node.busy_instances(), statuses, other)

    def _cached(self) -> HostProfile | None:
        """The machine's cached profile, if it was measured with this node's runner
        threads."""
        from shardline.node.profile import HostProfile

        if self.cache is None:
            return None
        try:
            cached = HostProfile.from_dict(json.loads(self.cache.read_text()))
        except (OSError, ValueError, TypeError):
            return None
        return cached if cached.threads == self.threads else None

    def first_guess(self) -> dict | None:
        """The cached profile, if it was measured with this node's runner threads and
        not beside other programs' work (:func:`disturbed`), with this boot's
        :func:`~shardline.parallel.compute_slots.host_id`."""
        from shardline.parallel.compute_slots import host_id

        cached = self._cached()
        if cached is None or disturbed(cached.other_cores, cached.cpu_count):
            return None
        return dict(cached.to_dict(), host_id=host_id())

    def _tried_beside_load(self) -> bool:
        """Whether the machine's last measurement (another node's, or an earlier run's)
        was disturbed within ``interval_s``: measure again only once other programs rest,
        not whatever the load (nodes starting one after another on a busy machine, a
        test suite's, would each measure beside it)."""
        cached = self._cached()
        return (
            cached is not None
            and disturbed(cached.other_cores, cached.cpu_count)
            and time.time() - cached.measured_at < self.interval_s
        )

    def _fresh_cache(self) -> dict | None:
        """The cached profile when another node of this machine measured it within
        ``interval_s`` and after this node's own."""
        cached = self.first_guess()
        if cached is None:
            return None
        mine = (self.view.profile or {}).get("measured_at") or 0.0
        fresh = time.time() - cached["measured_at"] < self.interval_s
        return cached if fresh and cached["measured_at"] > mine else None

    async def run(self) -> None:
        """Forever: keep ``node.profile`` (the first guess, then idle measurements)."""
        self.keep(self.first_guess())
        # measure only while other programs rest
        quiet_only = self.view.profile is not None or self._tried_beside_load()
        idle_since: float | None = None
        while True:
            now = time.monotonic()
            idle_since = (idle_since or now) if self.idle(any_load=not quiet_only) else None
            if measure_due(now, idle_since, self.measured_at, quiet_only, self.idle_s, self.interval_s):
                tried_before, self.measured_at = self.measured_at, now
                fresh = self._fresh_cache()
                if fresh is not None:
                    self.keep(fresh)
                    quiet_only = True
                elif await self._measure_while_idle(tried_before):
                    quiet_only = True
                idle_since = None
            await asyncio.sleep(1.0)

    async def _measure_while_idle(self, tried_before: float | None) -> bool:
        """Measure; kill the child and keep nothing if the node stops being idle first
        (``measured_at`` back to ``tried_before``: measured again once idle). Whether
        the next measurement waits for other programs to rest: a profile was taken, or
        their work disturbed this one."""
        with _machine_lock(self.cache) as mine:
            if not mine:  # another node of this machine measures: its profile is taken after
                log.debug("host profile: another node of this machine is measuring it")
                self.measured_at = tried_before
                return False
            return await self._measure(tried_before)

    async def _measure(self, tried_before: float | None) -> bool:
        """:meth:`_measure_while_idle`'s measurement, the machine's lock held."""
        from shardline.node.profile import measure_host_async

        task = asyncio.create_task(
            measure_host_async(
                device=self.device, seconds=PROFILE_SECONDS, threads=self.threads, samples=PROFILE_SAMPLES
            )
        )
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and not self.idle(any_load=True):
                task.cancel()
                log.debug("host profile: the node got busy; measuring again once it is idle")
                self.measured_at = tried_before  # this try does not count
                return False
        profile = task.result()
        if disturbed(profile.other_cores, profile.cpu_count):
            log.warning(
                "host profile: other programs kept %.1f of %d CPUs busy while it measured; measuring again once they rest",
                profile.other_cores,
                profile.cpu_count,
            )
            self.measured_at = time.monotonic() - self.interval_s + RETRY_S
            if self.view.profile is None:  # the machine's nodes wait for quiet
                self._write_cache(profile.to_dict())
            return True  # not kept: its figures are the other work's too
        if profile.note:
            log.warning("host profile: %s", profile.note)
            if self.view.profile is not None:
                return False  # keep what it had
        self.keep(profile.to_dict())
        log.info(
            "host profile: %.0f GFLOP/s, %.1f GB/s, %.2f ms a decode layer",
            profile.matmul_flops / 1e9,
            profile.memory_bandwidth_bytes_per_s / 1e9,
            profile.decode_layer_s * 1e3,
        )
        if not profile.note:
            self._write_cache(self.view.profile)
        return not profile.note

    def _write_cache(self, profile: dict | None) -> None:
        """Write ``profile`` as the machine's cached one (none where there is no cache
        file, or it cannot be written)."""
        if self.cache is not None:
            with contextlib.suppress(OSError):
                write_atomically(self.cache, json.dumps(profile))


@contextlib.contextmanager
def _machine_lock(cache: Path | None) -> Iterator[bool]:
    """Hold the machine's profile lock (an exclusive ``flock`` on the cache's ``.lock``
    file beside it) while the block runs, if no other process holds it: yields whether
    this one does. Nodes of one machine measuring at once share its CPUs and each
    measures a fraction of it (three local nodes started together: 61-91 GFLOP/s where
    one alone measured 197). No cache: nothing shared, always held."""
    if cache is None:
        yield True
        return
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        handle = open(cache.with_suffix(".lock"), "a")
    except OSError:
        yield True  # no lock to be had: measure as before
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def placement_key(inst: "Instance") -> PlacementKey:
    """The placement an instance is, for its speed."""
    return PlacementKey(inst.model_id, str(inst.sharding), tuple(inst.node_ids()), inst.dtype, inst.quantize)


class ServedLog:
    """The speeds of the placements this node streamed requests of
    (:class:`~shardline.placement.served.ServedSpeed` each), kept in ``path`` (None: in
    memory only) and told to peers in its ``NodeInfo.served``; ``predict``: an instance's
    first-order (decode, prefill) tokens/s now (``Forecast.first_order``)."""

    def __init__(self, predict: Callable[..., Awaitable[tuple[float, float]]], path: Path | None) -> None:
        self.predict = predict
        self.path = path
        self.speeds: dict[PlacementKey, ServedSpeed] = {}
        self._load()

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            for item in json.loads(self.path.read_text()):
                speed = ServedSpeed.from_dict(item)
                self.speeds[speed.key] = speed
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.warning("ignoring the kept speeds %s: %s", self.path, exc)

    def to_list(self) -> list[dict]:
        return [s.to_dict() for s in self.speeds.values()]

    async def add(
        self, inst: "Instance", decode: float | None, prefill: float | None, position: float, prompt_tokens: int
    ) -> None:
        """Record one request's rates for ``inst``'s placement (``position``: its decode's
        mean position; ``prompt_tokens``: its prompt), with the first-order prediction
        for it now (decode at the samples' context, prefill at their prompt length)."""
        if decode is None and prefill is None:
            return
        key = placement_key(inst)
        speed = record(self.speeds.get(key), key, decode, prefill, position, time.time(), prompt_tokens)
        predicted = await self.predict(inst, speed.context, prompt_tokens=speed.prompt_tokens)
        self.speeds[key] = with_prediction(speed, predicted)
        if self.path is not None:
            try:
                write_atomically(self.path, json.dumps(self.to_list()))
            except OSError as exc:
                log.warning("could not keep the speeds in %s: %s", self.path, exc)


@dataclass
class RequestTiming:
    """One request this node streams, timed for :class:`ServedLog` (``time.monotonic()``
    seconds). ``cached_tokens``, ``plain_steps``, ``plain_s``, ``alone`` and
    ``started_alone``: see :func:`~shardline.placement.served.request_rates`."""

    task_id: int
    prompt_tokens: int
    sent_at: float
    started_alone: bool
    first_token_at: float | None = None
    last_token_at: float | None = None
    generated: int = 0
    alone: bool = True
    cached_tokens: int = 0
    plain_steps: int = 0
    plain_s: float = 0.0

    @classmethod
    def start(cls, task_id: int, prompt_tokens: int, stats: Mapping | None) -> "RequestTiming":
        """Before the task is handed over; ``stats``: the instance's batch on this node
        (``EngineStats`` as a dict, None: none yet)."""
        return cls(task_id, prompt_tokens, time.monotonic(), not (stats or {}).get("running"))

    def token(self, stats: Mapping | None, drafted: int = 0, cached_tokens: int = 0) -> None:
        """A token of the request reached the node; ``stats`` its batch now; ``drafted``
        and ``cached_tokens``: the token's event's
        (:class:`~shardline.runner.protocol.TokenEvent`)."""
        now = time.monotonic()
        others = set((stats or {}).get("running") or ()) - {self.task_id}
        if self.first_token_at is None:
            self.first_token_at = now
            self.started_alone = self.started_alone and not others
            self.cached_tokens = cached_tokens
        else:
            self.alone = self.alone and not others
            if not drafted:  # a plain step's one token: the time since the step before's
                self.plain_steps += 1
                self.plain_s += now - (self.last_token_at or now)
        self.last_token_at = now
        self.generated += 1

    @property
    def position(self) -> float:
        """Its decode's mean position in the sequence, tokens."""
        return self.prompt_tokens + self.generated / 2

    def rates(self) -> tuple[float | None, float | None]:
        """(decode, prefill) tokens/s (:func:`~shardline.placement.served.request_rates`)."""
        ttft = None if self.first_token_at is None else self.first_token_at - self.sent_at
        return request_rates(
            self.prompt_tokens, self.cached_tokens, ttft, self.plain_steps, self.plain_s, self.alone, self.started_alone
        )
