"""How many compute threads a runner's next decode step takes: the decision, a pure
function of the steps' measured times (issue 47).

A runner's products split their work over OpenMP threads that meet at a barrier at the
end of each parallel region (some 60 regions a decode step). When another process keeps
a core busy, the thread that shares that core runs half the time, in slices of
milliseconds, and every region waits for it: a 2-thread step of SmolLM2 went from ~14 ms
to ~1 s under load, where one thread lost only its share of the core. The runner cannot
know how busy the machine will be, so it measures: it times its decode steps at the
thread count it runs, now and then times one step at another count (a probe), and keeps
the faster. Two steps that take far longer than the recent ones at their count probe at
once.

Only decode-only steps without drafts are timed (a prefill chunk's time is another
figure, and a drafted step has up to 16 rows a sequence more); decode steps run at the
chosen count, a step with prefill rows at the count the machine's free CPUs give
(:mod:`shardline.runner.other_load`), and so do a fresh runner's first decode steps,
until one is timed (:meth:`ThreadGovernor.seed`); a probe adopted is on trial for
:data:`TRIAL` steps. The count does not change a sequence's tokens: the decode products
(the fused decode layers, the compiled int4 and packed-group products, the LM head's)
give each output the same bits whatever the thread count (each thread computes whole
outputs), and so did the prefill of SmolLM2's Q4_1 and of a Q4_K_M mixture of experts on
a Zen 4 CPU, checked at 1 and 2 threads (tests/test_thread_governor.py checks a tiny
model's prefill and decode at both counts, so a CPU where the GEMMs sum otherwise is
caught). Under one busy core of a 2-vCPU VM a SmolLM2 runner decoded 110-120 tokens/s
with it against 1-4 without (2026-12-06, ``shardline bench --busy 1``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

PROBE_EVERY = 128
"""Decode steps between probes while nothing looks wrong (a probe at a slower count costs
one step's difference: under 1% of the steps). Each probe that loses doubles the wait
for the next, up to :data:`PROBE_MOST`: a probe of two threads while a core stays busy
can take a second."""

PROBE_MOST = 4096
"""The longest wait between probes, in decode steps."""

SLOW = 2.0
"""Two steps in a row this many times the median of the recent ones (same rows, same
count) probe at once, judged against those two."""

FASTER = 0.9
"""A probe is adopted where its time is at most this share of the recent median."""

KEPT = 8
"""Recent step times kept per thread count."""

TRIAL = 3
"""Steps at an adopted probe's count (the probe's among them) whose median must beat the
count it left, or it goes back: one step at two threads can fall in a slice where the
busy core's other process is off it, and the slow-step rule has no history at the new
count to judge by."""


@dataclass
class ThreadGovernor:
    """The thread count of a runner's decode steps (see the module's docstring).

    Attributes:
        most: the configured count (the runner's ``--runner-threads``), at least 1.
        threads: the count the next decode step runs at.
        rows: the decode rows of the steps timed so far (a step of another batch size
            starts the history again: its time is another figure; a probe waits for two
            steps of a size).
        recent: seconds of the latest decode steps at each count, newest last.
        probing: the count the current probe left (None: no probe running).
        since_probe: decode steps since the last probe.
        interval: decode steps between probes now (see :data:`PROBE_EVERY`).
        seeded: the count was once set from the free CPUs (:meth:`seed`).
        trial: after an adopted probe, the count it left and that count's median step
            time, until :data:`TRIAL` steps at the new count judge it.
    """

    most: int
    threads: int = 0
    rows: int = 0
    recent: dict[int, list[float]] = field(default_factory=dict)
    probing: int | None = None
    since_probe: int = 0
    interval: int = PROBE_EVERY
    seeded: bool = False
    trial: tuple[int, float] | None = None

    def __post_init__(self) -> None:
        self.most = max(1, self.most)
        self.threads = self.threads or self.most

    def timed(self, rows: int, seconds: float) -> int:
        """Record a decode step of ``rows`` rows that took ``seconds`` at
        :attr:`threads`; returns the count for the next decode step."""
        if rows != self.rows:
            # The steps since the last probe still count: a batch that changes size often
            # must not hold off every probe.
            self.rows, self.recent, self.trial = rows, {}, None
            if self.probing is not None:  # a probe of another batch size: back, unjudged
                self.threads, self.probing = self.probing, None
                return self.threads
        ran = self.threads
        if self.probing is not None:
            left, self.probing = self.probing, None
            before = self.recent.get(left, [])
            self._keep(ran, seconds)
            if before and seconds <= FASTER * statistics.median(before):
                self.recent[left] = []  # the machine changed: those times no longer hold
                self.recent[ran] = [seconds]  # nor do the earlier ones at this count
                self.trial = (left, statistics.median(before))
                self.interval = PROBE_EVERY
                return self.threads  # adopted, on trial
            return self._back(left)
        self._keep(ran, seconds)
        self.since_probe += 1
        times = self.recent[ran]
        if self.trial is not None and len(times) >= TRIAL:
            left, median = self.trial
            self.trial = None
            if statistics.median(times[-TRIAL:]) > median:  # a lucky probe: back
                self.recent[ran] = []
                return self._back(left)
        slow = len(times) >= 6 and min(times[-2:]) > SLOW * statistics.median(times[:-2])
        if slow:  # two in a row (one is a hiccup: a collection, a page fault): the machine changed
            self.recent[ran] = times[-2:]
        if self.most > 1 and len(self.recent[ran]) >= 2 and (slow or self.since_probe >= self.interval):
            self.since_probe, self.probing = 0, ran
            self.threads = ran - 1 if (slow or ran == self.most) and ran > 1 else ran + 1
        return self.threads

    def _back(self, left: int) -> int:
        """Return to ``left``, the count a probe that lost (or lost its trial) left, and
        wait twice as long for the next probe (at most :data:`PROBE_MOST` steps)."""
        self.threads, self.interval = left, min(2 * self.interval, PROBE_MOST)
        return self.threads

    @property
    def unseeded(self) -> bool:
        """No step timed yet and no count set from the free CPUs (a fresh runner): the
        next decode step may take :meth:`seed`'s."""
        return not self.recent and self.probing is None and not self.seeded

    def seed(self, count: int) -> int:
        """Run at ``count`` (the free CPUs', :func:`~shardline.runner.other_load.free_count`),
        1 to :attr:`most`, until the step times say otherwise; returns it."""
        self.threads, self.seeded = max(1, min(self.most, count)), True
        return self.threads

    def _keep(self, threads: int, seconds: float) -> None:
        times = self.recent.setdefault(threads, [])
        times.append(seconds)
        del times[:-KEPT]
