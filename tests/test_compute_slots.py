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


def test_spare_takes_every_free_slot_and_gives_them_all_back(tmp_path):
    first, second = ComputeSlots(3, tmp_path), ComputeSlots(3, tmp_path)
    with first.held(spare=True) as held:
        assert held == 3
        _, entered = _taking(second)
        assert not entered.wait(0.2)  # every slot taken
    assert entered.wait(5)
    with first.held() as one, second.held(spare=True) as rest:
        assert (one, rest) == (1, 2)  # a stage without spare takes one; the other the rest
    first.close()
    second.close()


def test_a_prefill_micro_batch_computes_on_the_spare_slots_threads(tmp_path):
    """A one-rank pipeline stage with two slots free: its prefill micro-batch runs at
    twice the thread count, its decode micro-batch at the count (a tiny model; the shard's
    ``forward`` records the count it ran at)."""
    import tiny_models as tm
    import torch

    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights
    from shardline.parallel.pipeline import PipelineStage

    tm.save_hf(tm.hf_model("llama", num_layers=2, seed=3), tmp_path / "m")
    shard = load_shard(open_weights(tmp_path / "m"), 0, 2, dtype=torch.float32)
    counts: list[int] = []
    shard.register_forward_pre_hook(lambda *_: counts.append(torch.get_num_threads()))
    slots = ComputeSlots(2, tmp_path / "slots")
    stage = PipelineStage(shard, tm.new_cache(shard, slots=1, context=64), 0, 1, slots=slots, spare_threads=True)
    held = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        stage.run([(torch.arange(1, 9), stage.prefill_batch(0, 0, 8, True))])
        stage.run([(torch.tensor([9]), stage.decode_batch([0], [8]))])
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(held)
        slots.close()
    assert counts == [2, 1] and after == 1


@pytest.mark.parametrize(
    "rank, index, width, stages, alone",
    [
        (0, 0, 1, 1, True),  # one stage
        (0, 0, 2, 3, True),  # the fill: rank 0's first
        (1, 0, 2, 3, False),  # beside rank 0's second
        (0, 1, 2, 3, False),
        (2, 0, 2, 3, False),  # beside rank 1's second
        (2, 1, 2, 3, True),  # the drain: the last rank's last
        (1, 0, 1, 3, True),  # one micro-batch passes alone
        (1, 1, 4, 3, False),
        (0, 0, 4, 2, True),
        (1, 3, 4, 2, True),
        (1, 2, 4, 2, False),
    ],
)
def test_a_micro_batch_computes_alone_in_the_fill_and_drain(rank, index, width, stages, alone):
    from shardline.parallel.pipeline import computes_alone

    assert computes_alone(rank, index, width, stages) is alone
