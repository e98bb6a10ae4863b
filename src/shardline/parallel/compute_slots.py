"""A machine's cores taken in turn by the CPU pipeline stages of the runners on it.

A pipeline overlaps its stages: while stage r computes micro-batch i+1, stage r+1
computes micro-batch i (:mod:`shardline.parallel.pipeline`). Across machines that is the
point of it. On one machine (a local cluster, or nodes started side by side) the stages'
threads then outnumber the cores, and torch's and the kernels' OpenMP regions, each
ending at a barrier that waits for its slowest thread, stall whenever a thread is
descheduled: a 3-node local pipeline of 2 threads a rank on a 2-vCPU VM (the Qwen3-30B-A3B-
shaped MoE bench model) took 9.3 s to prefill the seven 128-token prompts of one step,
where the same chunks one after another take ~2 s.

So a CPU stage computes each micro-batch holding one of the machine's compute slots,
``max(1, cpus // threads)`` of them (:func:`slot_count`): as many stages compute at once
as the cores give threads for, the others wait their turn. A slot is an advisory lock on
a file (``flock(2)``) in a directory every runner of this user on the machine shares
(:func:`slots_directory`): the kernel releases it when its holder exits, however it exits.
A stage holds a slot only while it computes, never while it waits on another rank, so no
rank waits on a slot held by a rank that waits on it. Tensor and ring stages take none:
their ranks compute at once by design (an all-reduce or a key/value block passed inside
every layer).

Measured (2-vCPU VM, the bench model above, 3 local nodes, 2 runner threads each, 8
requests of 128 prompt tokens at once): median TTFT 5.0-9.3 s -> 2.4 s, aggregate decode
44 -> 84 tokens/s (``shardline bench --nodes 3 --runner-threads 2 --concurrency 8``).

A stage that computes while the others have nothing to (a step's first micro-batch on the
first rank, its last on the last: :func:`~shardline.parallel.pipeline.alone`) takes the
slots left free as well, up to the threads its prefill step asked for (the CPUs other
processes left free lately: the runner's engine decides), and computes on all their
threads: a conversation's next turn on SmolLM2's 3-node local pipeline (2 vCPUs, one
thread a stage) reached its first token in 170 ms against 192 (medians of 5 runs
alternated, 2,089 of 2,321 prompt tokens cached; the same prompt prefilled whole 968 ms
against 1,091).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import socket
import tempfile
import uuid
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the system has one, else
    every CPU)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_id() -> str:
    """An id of the running kernel, the same for every process (and container) that shares
    this machine's CPUs and different on another machine: a SHA-256 digest (16 hex digits)
    of Linux's ``/proc/sys/kernel/random/boot_id`` (new at each boot; see the kernel's
    ``Documentation/admin-guide/sysctl/kernel.rst``), else, where there is none (macOS),
    of the host name and a network interface's MAC address (:func:`uuid.getnode`)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            seed = f.read().strip()
    except OSError:
        seed = f"{socket.gethostname()}/{uuid.getnode():012x}"
    return hashlib.sha256(seed.encode()).hexdigest()[:16]


def stages_at_once(pools: Sequence[tuple[Hashable, int]]) -> int:
    """How many of a pipeline's stages can compute at once, ``pools`` giving each rank's
    compute slots: (its machine, e.g. :func:`host_id` or a number made of it, the slots
    there), or a false machine (``""``, 0) and 0 slots for a stage that takes none (it
    computes whenever it can: a GPU's). The ranks of one machine compute at most as many
    at once as its slots (the fewest any of them counts), each of the others on its own."""
    machines: dict[Hashable, list[int]] = {}
    alone = 0
    for machine, count in pools:
        if machine and count > 0:
            machines.setdefault(machine, []).append(count)
        else:
            alone += 1
    return alone + sum(min(len(counts), min(counts)) for counts in machines.values())


def slot_count(cpus: int, threads: int) -> int:
    """Stages that may compute at once on a machine of ``cpus`` CPUs, each stage running
    ``threads`` threads: the cores' worth of such stages, at least one."""
    return max(1, cpus // max(1, threads))


def slots_directory() -> Path:
    """Where this machine's slot files lie, shared by every runner of this user (the
    system's temporary directory: gone with the boot, as the locks are)."""
    return Path(tempfile.gettempdir()) / f"shardline-{os.getuid()}" / "compute-slots"


class ComputeSlots:
    """``count`` slots, files ``slot-0`` .. ``slot-{count-1}`` in ``directory`` (created),
    each worth ``threads`` compute threads.

    Raises:
        OSError: the directory or a slot file cannot be created or opened.
    """

    def __init__(self, count: int, directory: Path, threads: int = 1) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.count = count
        self.threads = threads
        self._files = [os.open(directory / f"slot-{i}", os.O_CREAT | os.O_RDWR, 0o600) for i in range(count)]

    @classmethod
    def on_this_machine(cls, threads: int) -> "ComputeSlots":
        """The slots of this machine for a stage of ``threads`` threads (the CPUs are
        those this process may run on)."""
        return cls(slot_count(usable_cpus(), threads), slots_directory(), threads)

    @contextlib.contextmanager
    def held(self, most: int = 1) -> Iterator[int]:
        """Hold a free slot for the block, waiting for one when all are taken (the wait
        has no timeout: holders only compute, and the kernel frees a dead one's), and of
        the others up to ``most`` in all where they are free then; yields how many it
        holds."""
        taken: list[int] = []
        for fd in self._files:
            if len(taken) >= most:
                break
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            taken.append(fd)
        if not taken:
            taken.append(self._files[os.getpid() % self.count])
            fcntl.flock(taken[0], fcntl.LOCK_EX)
        try:
            yield len(taken)
        finally:
            for fd in taken:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in self._files:
            os.close(fd)
        self._files = []
