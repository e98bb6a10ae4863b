"""How many of the machine's CPUs other processes kept busy lately: what a runner's prefill
step may take beyond its decode steps' thread count (issue 47).

A one-rank runner's decode steps run at the count its thread governor measured fastest
(:mod:`shardline.runner.threads`). That count also drops where the machine is merely
shared while tokens stream: a local cluster's node and its clients take slices of a core
beside each decode step, and a one-row step's many short parallel regions feel them. A
prompt's prefill comes while nothing streams; at the decode count it took a
conversation's next turn 1.3-1.9x as long (SmolLM2, one node of a 2-vCPU VM: a 2,321-token
prompt cold 1,413 ms at one thread, 1,087 at two). But a prefill's regions stall under a
core really taken as decode's do (at two threads under one busy core: 3-11 s to a
128-token prompt's first token, 0.1-0.2 s at one), and the governor's step times do not
tell the two apart. The CPU time the machine spent outside this process does: a prefill
step takes as many threads, up to the configured count, as the other processes left CPUs
free since a reading at least :data:`WINDOW_S` old (:func:`free_count`), whatever
decode's count. A fresh runner's decode steps start at that count too, until the
governor has a time to go by: its first requests under one busy core decoded at 7-16
tokens/s at the configured two threads (their drafted steps are not timed), 140-330 since.

The reading is psutil's system CPU times (``/proc/stat`` on Linux: 10 ms ticks) against
this process's own CPU time and its node's (the runner's parent, whose work is the
requests' own: tokenizing a prompt, streaming its tokens); steal counts as taken. A
burst shorter than :data:`STEADY_S` is not a core taken: the node tokenizing an
agent's prompt, or a client building its request, just before the prompt's step kept a
2-vCPU machine's 1,930-token prefill at one thread (1.3-1.4 s against 0.7 s, a 150 ms
burst in the client; the step takes the whole prompt), where the burst was over when
the step began.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import psutil

from shardline.parallel.compute_slots import usable_cpus

WINDOW_S = 0.1
"""The shortest span a reading covers, seconds (ten of ``/proc/stat``'s ticks a CPU)."""

KEPT_S = 2.0
"""Samples older than this are dropped but the newest of them: a reading covers from
:data:`WINDOW_S` to a little over this span (more after a longer step)."""

EVERY_S = 0.02
"""The least time between kept samples, seconds."""

STEADY_S = 0.5
"""A reading is at most the other processes' busy cores over this span too, seconds: a
process that keeps a core busy counts within about half of it, a shorter burst does not.
(A core taken for good while a step runs at two threads stalls it: 3-11 s to a
128-token prompt's first token; the step after one that long reads the core taken.)"""


class RunnerAndNode:
    """CPU seconds this process and its parent (a runner's node, looked up once) have
    spent, the parent's other children left out; this process's alone without a parent
    or once it is gone."""

    def __init__(self) -> None:
        try:
            self.node: psutil.Process | None = psutil.Process().parent()
        except psutil.Error:
            self.node = None

    def __call__(self) -> float:
        mine = time.process_time()
        if self.node is not None:
            try:
                times = self.node.cpu_times()
                return mine + times.user + times.system
            except psutil.Error:
                self.node = None
        return mine


def busy_cpu_seconds() -> float:
    """CPU seconds the machine has spent busy since boot, all CPUs together (psutil's
    times but idle and I/O wait; guest time is in user time on Linux)."""
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    total = sum(value for name, value in times._asdict().items() if name not in ("guest", "guest_nice"))
    return total - idle


def free_count(governed: int, most: int, cpus: int, others: float | None) -> int:
    """Threads the free CPUs give (a step with prefill rows; a decode step the governor
    has no times for): the ``cpus`` the other processes' ``others`` busy cores leave free
    (rounded to the nearest), at least 1 and at most ``most`` (the configured count);
    ``governed`` (the decode steps' count) where ``others`` is unknown (None)."""
    if others is None:
        return governed
    return max(1, min(most, int(cpus - others + 0.5)))


class OtherLoad:
    """Busy cores of the machine's other processes, read at each step.

    ``busy`` and ``own``: the machine's busy CPU seconds and this process's CPU seconds
    (:func:`busy_cpu_seconds`; ``time.process_time``, or for a runner
    :class:`RunnerAndNode`, its node's too); ``clock``: seconds, monotonic;
    ``cpus``: the CPUs this process may run on (read once, at start). The first reading
    is taken at start: the first step's span goes back to it.
    """

    def __init__(
        self,
        busy: Callable[[], float] = busy_cpu_seconds,
        own: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        cpus: int | None = None,
    ) -> None:
        self.busy, self.own, self.clock = busy, own, clock
        self.cpus = usable_cpus() if cpus is None else cpus
        self.samples: deque[tuple[float, float, float]] = deque()
        self._take(self.clock())

    def sample(self) -> None:
        """Keep a reading for later spans (at most one each :data:`EVERY_S`, so a decode
        step pays a clock read, not psutil's)."""
        now = self.clock()
        if not self.samples or now - self.samples[-1][0] >= EVERY_S:
            self._take(now)

    def cores(self) -> float | None:
        """The other processes' busy cores from the newest sample at least
        :data:`WINDOW_S` old to now, and at most from the newest at least
        :data:`STEADY_S` old (or the oldest kept) to now (None where there is no sample
        :data:`WINDOW_S` old; never below 0)."""
        now = self._take(self.clock())
        recent = steady = None
        for sample in self.samples:
            if now[0] - sample[0] < WINDOW_S:
                break
            if steady is None or now[0] - sample[0] >= STEADY_S:
                steady = sample
            recent = sample
        if recent is None or steady is None:
            return None

        def since(base: tuple[float, float, float]) -> float:
            return ((now[1] - base[1]) - (now[2] - base[2])) / (now[0] - base[0])

        return max(0.0, min(since(recent), since(steady)))

    def _take(self, at: float) -> tuple[float, float, float]:
        reading = (at, self.busy(), self.own())
        while len(self.samples) >= 2 and at - self.samples[1][0] >= KEPT_S:
            self.samples.popleft()  # the newest sample older than KEPT_S stays, a base
        self.samples.append(reading)
        return reading
