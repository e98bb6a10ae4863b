"""The machine's compute slots that CPU pipeline stages take in turn."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from shardline.parallel.compute_slots import ComputeSlots, slot_count, stages_at_once
from shardline.parallel.pipeline import alone


@pytest.mark.parametrize(
    "cpus, threads, slots",
    [
        (2, 2, 1),  # a 2-vCPU machine, 2 threads a stage: one at a time
        (2, 1, 2),
        (3, 2, 1),
        (16, 4, 4),
        (16, 5, 3),
        (1, 4, 1),  # more threads than CPUs: still one
        (8, 0, 8),  # 0 threads read as 1
    ],
)
def test_slot_count(cpus, threads, slots):
    assert slot_count(cpus, threads) == slots


@pytest.mark.parametrize(
    "pools, at_once",
    [
        ([("a", 2), ("a", 2), ("a", 2)], 2),  # a local 3-node cluster on 2 vCPUs, a thread a stage
        ([("a", 1), ("a", 1), ("a", 1)], 1),  # two threads a stage: one slot
        ([("a", 2), ("b", 2), ("c", 2)], 3),  # three machines
        ([("a", 2), ("a", 2), ("b", 1)], 3),
        ([("a", 8), ("a", 8)], 2),  # no more than its ranks
        ([("a", 2), ("a", 1), ("a", 2)], 1),  # the fewest counted
        ([("", 0), ("", 0)], 2),  # GPU stages take no slots
        ([("a", 2), ("", 0), ("a", 2)], 3),
    ],
)
def test_the_stages_that_compute_at_once(pools, at_once):
    assert stages_at_once(pools) == at_once


@pytest.mark.parametrize(
    "stages, microbatches, alone_at",
    [
        # (rank, micro-batch) pairs computed while no other stage has one to compute
        (3, 2, {(0, 0), (2, 1)}),  # a turn's two pieces: the first on rank 0, the last on 2
        (3, 4, {(0, 0), (2, 3)}),
        (3, 1, {(0, 0), (1, 0), (2, 0)}),  # one micro-batch: each stage in turn
        (2, 2, {(0, 0), (1, 1)}),
        (1, 3, {(0, 0), (0, 1), (0, 2)}),  # one stage
    ],
)
def test_a_stage_computes_alone_in_the_pipelines_fill_and_drain(stages, microbatches, alone_at):
    found = {(r, m) for r in range(stages) for m in range(microbatches) if alone(r, m, stages, microbatches)}
    assert found == alone_at


def _taking(slots: ComputeSlots) -> tuple[threading.Thread, threading.Event]:
    """A thread that takes a slot of ``slots`` (started) and the event it sets once it has."""
    entered = threading.Event()

    def take() -> None:
        with slots.held():
            entered.set()

    waiter = threading.Thread(target=take, daemon=True)
    waiter.start()
    return waiter, entered


def test_a_stage_waits_while_the_only_slot_is_held(tmp_path):
    # Two runners' stages (each opens the files itself: flock locks are per open file, so
    # two objects conflict as two processes do).
    first, second = ComputeSlots(1, tmp_path), ComputeSlots(1, tmp_path)
    with first.held():
        waiter, entered = _taking(second)
        assert not entered.wait(0.2)  # held: the second waits
    assert entered.wait(5)  # released: it gets the slot
    waiter.join(5)
    first.close()
    second.close()


def test_two_slots_let_two_stages_compute_at_once(tmp_path):
    first, second = ComputeSlots(2, tmp_path), ComputeSlots(2, tmp_path)
    with first.held():
        waiter, entered = _taking(second)
        assert entered.wait(5)  # the other slot was free
    waiter.join(5)
    with first.held(), second.held():  # and again, in either order
        pass
    first.close()
    second.close()


def test_a_stage_alone_takes_the_free_slots_it_asks_for_and_no_more(tmp_path):
    first, second = ComputeSlots(3, tmp_path), ComputeSlots(3, tmp_path)
    with first.held(2) as taken:
        assert taken == 2  # all free: two of three
        with second.held(3) as others:
            assert others == 1  # the one left
    with first.held(5) as taken:
        assert taken == 3
        waiter, entered = _taking(second)
        assert not entered.wait(0.2)  # every slot held: it waits, as for one
    assert entered.wait(5)  # all released at once
    waiter.join(5)
    first.close()
    second.close()


def test_a_slot_is_freed_when_its_holder_is_killed(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from shardline.parallel.compute_slots import ComputeSlots\n"
            "with ComputeSlots(1, Path(sys.argv[1])).held():\n"
            "    print('held', flush=True)\n"
            "    time.sleep(60)\n",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        slots = ComputeSlots(1, tmp_path)
        _, entered = _taking(slots)
        assert not entered.wait(0.2)
        holder.kill()
        assert entered.wait(5)
        slots.close()
    finally:
        holder.kill()
        holder.wait(5)
