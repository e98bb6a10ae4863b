"""What gloo's collectives cost against :mod:`shardline.parallel.point_to_point`'s.

    python scripts/collective_costs.py [--world-size 3] [--iterations 500]

Starts ``--world-size`` processes on 127.0.0.1 (gloo, one torch thread each) and times,
for each tensor shape, torch.distributed's all-gather and all-reduce against
:func:`~shardline.parallel.point_to_point.gather_at` and
:func:`~shardline.parallel.point_to_point.all_reduce`, the units interleaved, and the CPU
each rank's threads spent per call (gloo's transport thread included). Prints rank 0's
median ms per call, its CPU ms per call and the ratio gloo / point-to-point.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shardline.parallel import point_to_point  # noqa: E402

SHAPES = [((20,), torch.int64), ((1, 576), torch.float32), ((8, 4096), torch.float32),
          ((512, 576), torch.float32)]
"""An agreement proposal, one and 8 rows of a decode step's partial sum, a prefill
chunk's."""


def _unit(name: str, x: torch.Tensor, rank: int, world: int):
    if name == "gloo all_gather":
        return lambda: dist.all_gather([torch.empty_like(x) for _ in range(world)], x)
    if name == "gather_at":
        return lambda: point_to_point.gather_at(world - 1, x, rank, world)
    if name == "gloo all_reduce":
        return lambda: dist.all_reduce(x.clone())
    return lambda: point_to_point.all_reduce(x.clone(), rank, world)


def _cpu_ms() -> float:
    """CPU time of all this process's threads, ms."""
    return time.process_time() * 1e3


def _rank(rank: int, world: int, port: int, iterations: int, results) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for shape, dtype in SHAPES:
        x = torch.ones(shape, dtype=dtype)
        names = (["gloo all_gather", "gather_at"] if dtype == torch.int64
                 else ["gloo all_reduce", "point_to_point all_reduce"])
        times: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, float] = dict.fromkeys(names, 0.0)
        for _ in range(iterations // 50):
            for name in names:  # interleaved, 50 calls at a time
                call = _unit(name, x, rank, world)
                dist.barrier()
                c0 = _cpu_ms()
                for _ in range(50):
                    t0 = time.perf_counter()
                    call()
                    times[name].append((time.perf_counter() - t0) * 1e3)
                cpu[name] += _cpu_ms() - c0
        for name in names:
            rows.append((f"{list(shape)} {str(dtype).removeprefix('torch.')}", name,
                         statistics.median(times[name]), cpu[name] / len(times[name])))
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=500, help="calls per unit")
    parser.add_argument("--port", type=int, default=29651)
    args = parser.parse_args()
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(args.world_size, args.port, max(50, args.iterations), results),
             nprocs=args.world_size, join=True)
    rows = results.get()
    print(f"{args.world_size} ranks on 127.0.0.1, gloo, rank 0's figures")
    print(f"{'tensor':<20} {'unit':<27} {'median ms':>10} {'CPU ms':>7} {'ratio':>6}")
    for i, (shape, name, median, cpu) in enumerate(rows):
        ratio = f"{rows[i - 1][2] / median:>6.2f}" if i % 2 else ""
        print(f"{shape:<20} {name:<27} {median:>10.3f} {cpu:>7.3f} {ratio}")


if __name__ == "__main__":
    main()
