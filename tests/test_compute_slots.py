"""The machine's compute slots that CPU pipeline stages take in turn."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from shardline.parallel.compute_slots import ComputeSlots, slot_count


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
