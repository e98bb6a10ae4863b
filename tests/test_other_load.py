"""The other processes' busy cores and a prefill step's thread count
(:mod:`shardline.runner.other_load`): readings in, cores and counts out."""

import subprocess
import sys
import time

import pytest

from shardline.runner.other_load import (
    KEPT_S,
    STEADY_S,
    WINDOW_S,
    OtherLoad,
    RunnerAndNode,
    busy_cpu_seconds,
    free_count,
)

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    "governed, most, cpus, others, count",
    [
        (1, 2, 2, 0.1, 2),  # quiet but for the node: both, whatever decode's count
        (1, 2, 2, 0.45, 2),
        (2, 2, 2, 0.55, 1),  # more than half a core taken
        (2, 2, 2, 1.0, 1),  # a busy core
        (2, 2, 2, 2.0, 1),  # both busy: still one
        (1, 2, 2, None, 1),  # not measured yet: decode's
        (2, 2, 2, None, 2),
        (4, 8, 16, 3.0, 8),  # the configured count at most
        (2, 8, 8, 5.2, 3),
    ],
)
def test_free_count(governed, most, cpus, others, count):
    assert free_count(governed, most, cpus, others) == count


class Machine:
    """A clock, the machine's busy CPU seconds and this process's, moved by hand."""

    def __init__(self) -> None:
        self.now = self.busy = self.own = 0.0

    def run(self, seconds: float, others: float, own: float) -> None:
        """``seconds`` pass with ``others`` cores busy elsewhere and ``own`` here."""
        self.now += seconds
        self.busy += seconds * (others + own)
        self.own += seconds * own

    def load(self) -> OtherLoad:
        return OtherLoad(busy=lambda: self.busy, own=lambda: self.own, clock=lambda: self.now)


def test_a_reading_counts_only_the_other_processes_over_a_window():
    machine = Machine()
    load = machine.load()
    assert load.cores() is None  # the reading at start is not old enough
    machine.run(WINDOW_S / 2, others=1.0, own=2.0)
    assert load.cores() is None  # no sample old enough
    machine.run(WINDOW_S, others=1.0, own=2.0)
    assert load.cores() == pytest.approx(1.0)  # this process's own two cores left out


def test_samples_taken_at_decode_steps_make_the_window_recent():
    machine = Machine()
    load = machine.load()
    load.sample()
    machine.run(1.0, others=1.0, own=1.0)  # a busy spell
    for _ in range(20):  # then 0.3 s of decode steps, the machine quiet
        load.sample()
        machine.run(0.015, others=0.0, own=1.0)
    assert load.cores() == pytest.approx(0.0, abs=1e-9)  # from a sample 0.1-0.12 s old


def _quiet_then(machine: Machine, load: OtherLoad, seconds: float, others: float) -> None:
    """1 s of idle steps (a sample each 50 ms), then ``seconds`` with ``others`` cores
    busy elsewhere, sampled alike."""
    for _ in range(20):
        load.sample()
        machine.run(0.05, others=0.0, own=0.0)
    for _ in range(round(seconds / 0.05)):
        load.sample()
        machine.run(0.05, others=others, own=0.0)


@pytest.mark.parametrize(
    "seconds, others, threads",
    [
        (0.15, 1.0, 2),  # a client building its request just before it: not a core taken
        (0.2, 1.0, 2),
        (0.3, 1.0, 1),  # a core taken for 0.3 s: counted
        (1.0, 1.0, 1),  # a busy core
        (1.0, 2.0, 1),
        (1.0, 0.4, 2),  # less than half a core, steadily
    ],
)
def test_a_burst_shorter_than_the_steady_span_takes_no_thread(seconds, others, threads):
    machine = Machine()
    load = machine.load()
    _quiet_then(machine, load, seconds, others)
    assert free_count(1, 2, 2, load.cores()) == threads


def test_load_that_stopped_frees_the_cores_at_once():
    machine = Machine()
    load = machine.load()
    _quiet_then(machine, load, 1.0, 1.0)
    for _ in range(3):  # 0.15 s quiet after a busy second
        load.sample()
        machine.run(0.05, others=0.0, own=0.0)
    assert load.cores() == pytest.approx(0.0, abs=1e-9)
    assert STEADY_S > WINDOW_S


def test_the_node_s_cpu_counts_as_the_runner_s_own():
    """A runner (here a child process) counts its parent's CPU seconds as its own: the
    node's tokenizing is the request's work, not another process's load."""
    began = time.process_time()
    while time.process_time() - began < 0.2:  # the parent (the "node") busy 0.2 s
        pass
    spent = time.process_time()
    code = "from shardline.runner.other_load import RunnerAndNode; import time; print(RunnerAndNode()() - time.process_time())"
    parent = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert parent >= spent - 0.02  # the parent's CPU seconds, 10 ms ticks
    mine = time.process_time()
    assert RunnerAndNode()() >= mine


def test_old_samples_go_but_the_newest_of_them_stays_a_base():
    machine = Machine()
    load = machine.load()
    for _ in range(10):
        load.sample()
        machine.run(1.0, others=0.5, own=0.0)
    assert len(load.samples) <= KEPT_S / 1.0 + 2
    machine.run(5.0, others=0.5, own=1.0)  # a long step
    assert load.cores() == pytest.approx(0.5)


def test_this_machine_reads_busy_cpu_seconds():
    """Busy time grows by at least this process's own 0.1 s of CPU (less 10 ms ticks;
    /proc/stat's idle and I/O wait counters may step back a little, so not exactly)."""
    first = busy_cpu_seconds()
    end = time.process_time() + 0.1
    while time.process_time() < end:
        pass
    assert first > 0 and busy_cpu_seconds() - first >= 0.05
