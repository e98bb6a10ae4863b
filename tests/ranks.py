"""Run a function on several gloo ranks, each in a fresh process on 127.0.0.1."""

from __future__ import annotations

import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _worker(rank, world, port, job, args, out_dir):
    """One rank: join the gloo group, run ``job(rank, world, *args)``, save its result."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    result_file = Path(out_dir) / f"rank{rank}.pt"
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        try:
            result = job(rank, world, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, result_file)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, result_file)
        raise


def spawn_ranks(world: int, job, args: tuple, tmp_path: Path, timeout: float) -> list:
    """Run ``job`` on ``world`` gloo ranks in fresh processes; each rank's result."""
    ctx = mp.get_context("spawn")
    out_dir = tmp_path / f"ranks-{world}-{time.monotonic_ns()}"
    out_dir.mkdir()
    from conftest import free_port_block  # here: the ranks' processes import this module too

    port = free_port_block(1)
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, job, args, str(out_dir)), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join(5)
    results = []
    for r in range(world):
        file = out_dir / f"rank{r}.pt"
        assert file.exists(), f"rank {r} left no result (exit code {procs[r].exitcode})"
        result = torch.load(file, weights_only=False)
        assert "error" not in result, f"rank {r} failed:\n{result['error']}"
        results.append(result)
    assert not alive, f"ranks {[procs.index(p) for p in alive]} did not finish in {timeout} s"
    return results
