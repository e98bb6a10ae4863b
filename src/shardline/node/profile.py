"""What a node's machine can do (:class:`HostProfile`, :func:`measure_host`,
:func:`measure_host_async`): memory from psutil, and the accelerator, matmul throughput
and memory bandwidth measured with torch. The torch half runs in a child process
(``python -m shardline.node.profile``, which prints one JSON object), so the node process
itself never imports torch. Links between nodes are measured by
``shardline.node.link_probe``.

Units everywhere: bytes, seconds, FLOP/s, bytes/s.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from shardline.devices import pick_device
from shardline.node.profile_decode import (
    cuda_decode_layer_s,
    cuda_decode_weight_rate,
    decode_weight_rate,
    runner_runtime,
)
from shardline.parallel.compute_slots import host_id, usable_cpus
from shardline.process_memory import memory_now, release_free_memory
from shardline.runner.other_load import busy_cpu_seconds

DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
"""The devices a node's runners (and its profile) compute on: ``auto`` is the first CUDA
device torch sees, else the CPU; ``mps`` (Apple silicon) only when asked for."""

# Square matmul sizes: CPU ~1024 (about 2.1 GFLOP a product); a GPU needs a bigger product
# (4096: about 137 GFLOP) or kernel launches, not arithmetic, would be what is timed.
_MATMUL_N_CPU = 1024
_MATMUL_N_GPU = 4096

# Bytes of the tensor copied to time memory bandwidth (source and destination each).
_COPY_BYTES = 256 * 2**20


PROFILE_FORMAT = 12
"""What a :class:`HostProfile` measures and how; a node measures again rather than use a
cached profile of another format (2: the runtime baseline runs a tiny model; 3: and
counts private memory only; 4: rates are medians of several samples, taken with the
runners' thread count, and ``decode_layer_s`` and ``decode_weight_bytes_per_s`` are
measured; 5: ``decode_layer_s`` from a 16-layer probe, the runners' decode path; 6: the
runtime baseline without the probe's freed heap; 7: the decode figures from the least
time of their calls; 8: the decode product rounds its inputs to int8, which changed its
rate; 9: that rate timed over 64 MB of weights, read from memory as a model's are; 10:
``decode_layer_s`` measured on CUDA too, the probe replayed from CUDA graphs; 11:
``host_layer_s``, the CPU probe's figure, on a GPU node too, and on CUDA
``decode_weight_bytes_per_s``, dense one-row products replayed from a graph; 12: the CPU
decode product's rate timed over 256 MB, past a 32 MB last-level cache)."""


@dataclass
class HostProfile:
    """One machine as a node sees it.

    Attributes:
        total_bytes: physical memory (psutil ``virtual_memory().total``), bytes.
        available_bytes: memory available to new processes without swapping
            (psutil ``virtual_memory().available``) when measured, bytes.
        cpu_count: logical CPUs this process may run on (its affinity mask; else
            ``os.cpu_count()``).
        accelerator: the device runners would compute on: ``"cuda:0 NVIDIA H200"`` (index
            and name), ``"mps"`` (Apple GPU), ``"cpu"``; ``"unknown"`` when the
            measurement failed (see ``note``).
        accelerator_total_bytes: the accelerator's memory, bytes (CUDA: NVML if
            importable, else ``torch.cuda.mem_get_info``; MPS: torch's recommended
            maximum working set, which shares the host's memory). 0 for cpu.
        accelerator_free_bytes: of that, free when measured, bytes (CUDA: as reported by
            the driver before this measurement allocated anything, with NVML; else after
            torch's context was created). 0 for cpu.
        matmul_flops: measured dense matmul throughput on that device, FLOP/s (2·n³
            per n×n product, products of n=1024 on CPU and n=4096 on GPUs, averaged over
            the timed window). In ``matmul_dtype``.
        matmul_dtype: the dtype of ``matmul_flops``: ``"bfloat16"`` on GPUs (``"float16"``
            where bf16 is unsupported); on CPU whichever of ``"bfloat16"`` and
            ``"float32"`` was faster on this CPU.
        memory_bandwidth_bytes_per_s: measured device memory bandwidth, bytes/s: bytes
            read plus bytes written per second while copying a 256 MiB tensor into
            another already allocated one (``dst.copy_(src)``: 512 MiB moved a copy,
            the STREAM "copy" convention), averaged over several copies.
        runtime_baseline_bytes: the measuring child's private resident memory
            (:mod:`shardline.process_memory`) right after importing torch and a runner's
            modules, running one small product on its device and a tiny model's prefill
            and decode on the CPU, bytes: what a runner holds besides its shard
            (placement counts it per rank; 0: unmeasured).
        decode_layer_s: the fixed cost of one decoder layer in a one-sequence decode step,
            seconds: the least time of a decode step of a tiny random model
            (``profile_decode.PROBE_LAYERS`` layers 256 wide, int4 weights: its weights
            are read in microseconds, so what is timed is a layer's fixed cost on the
            runners' decode path, fused or torch ops, attention over 96 cached tokens
            included, and the step's own share), divided by its layers. On CUDA the probe
            runs there in dense bfloat16, its steps replayed from CUDA graphs
            (:func:`~shardline.node.profile_decode.cuda_decode_layer_s`); 0: unmeasured
            (MPS).
        host_layer_s: the same probe's per-layer figure on the CPU, seconds, measured on
            every node (on a CPU node it is ``decode_layer_s``): the CPU's speed at a
            decode step's small work, with which the step's work on the host beside the
            device's layers (the sampler, the engine loop, the token's way to the node)
            scales; 0: unmeasured.
        decode_weight_bytes_per_s: resident weight bytes/s the runner's weight-only
            product reads for one row (a decode step's products): a [2048, 2048] int4
            weight in its resident form (:func:`~shardline.models.linear.resident_weight`)
            times a bfloat16 row, the least time of its timed calls, on the CPU. Decode reads its
            weights at this rate (the kernel unpacks int4 at a rate of its own, and the
            probe's weights come from memory: the memory's read rate is in it). On CUDA: dense bfloat16 weights, 512 MiB a
            pass, replayed from a graph
            (:func:`~shardline.node.profile_decode.cuda_decode_weight_rate`). 0:
            unmeasured (MPS).
        threads: torch intra-op threads the measurement ran with (a runner's
            ``--runner-threads``; 0: torch's default).
        host_id: the machine (:func:`~shardline.parallel.compute_slots.host_id`): nodes
            with the same id share its CPUs, so ranks of theirs computing at once slow
            each other (the preview counts it:
            :func:`~shardline.placement.speed.oversubscription`).
        samples: how many timed windows each rate is the median of.
        other_cores: CPUs other processes kept busy while it measured (the machine's
            busy CPU seconds beside the measuring child's own, over its wall time:
            :func:`other_cores`); a node does not keep a profile measured beside much
            of that (:func:`~shardline.node.speeds.disturbed`).
        measured_at: when it was measured, seconds since the epoch.
        measure_s: wall time the measurement took (child start to exit), seconds.
        note: why measured figures are missing (the measurement failed or timed out),
            or what else is worth knowing; ``""`` when nothing.
    """

    total_bytes: int = 0
    available_bytes: int = 0
    cpu_count: int = 0
    accelerator: str = "cpu"
    accelerator_total_bytes: int = 0
    accelerator_free_bytes: int = 0
    matmul_flops: float = 0.0
    matmul_dtype: str = ""
    memory_bandwidth_bytes_per_s: float = 0.0
    runtime_baseline_bytes: int = 0
    decode_layer_s: float = 0.0
    host_layer_s: float = 0.0
    decode_weight_bytes_per_s: float = 0.0
    threads: int = 0
    host_id: str = ""
    samples: int = 0
    other_cores: float = 0.0
    measured_at: float = 0.0
    measure_s: float = 0.0
    note: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "HostProfile":
        """Build from :meth:`to_dict`'s output; unknown keys are ignored and missing ones
        take their defaults (so nodes of different versions can read each other's)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _host_memory() -> dict:
    memory = psutil.virtual_memory()
    return {
        "total_bytes": int(memory.total),
        "available_bytes": int(memory.available),
        "cpu_count": usable_cpus(),
        "host_id": host_id(),
    }


def _failed_profile(note: str, elapsed: float) -> HostProfile:
    """Memory and CPUs (psutil, no torch needed) with zeros for what was to be measured."""
    return HostProfile(**_host_memory(), accelerator="unknown", measure_s=elapsed, note=note)


def _command(device: str, seconds: float, threads: int, samples: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "shardline.node.profile",
        "--device",
        device,
        "--seconds",
        repr(float(seconds)),
        "--threads",
        str(int(threads)),
        "--samples",
        str(int(samples)),
    ]


def _parse(returncode: int | None, stdout: str, stderr: str, elapsed: float) -> HostProfile:
    if returncode != 0:
        tail = stderr.strip().splitlines()[-1:] or ["no message"]
        return _failed_profile(f"profile child exited with {returncode}: {tail[0][-500:]}", elapsed)
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        profile = HostProfile.from_dict(json.loads(lines[-1]))
    except (IndexError, ValueError, TypeError) as exc:
        return _failed_profile(f"profile child printed no profile: {exc}", elapsed)
    profile.measure_s = elapsed
    profile.measured_at = time.time()
    return profile


def measure_host(
    device: str = "auto", seconds: float = 0.5, timeout_s: float = 60.0, threads: int = 0, samples: int = 5
) -> HostProfile:
    """Measure this machine in a child process (torch is imported there, never here).

    Args:
        device: ``"auto"`` (CUDA if torch sees a GPU, else CPU), or
            ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"``.
        seconds: about how long the timed loops run in all: two thirds for matmuls
            (split between bf16 and float32 on CPU), one third for memory copies. The
            child also spends ~1.5-2 s importing torch (about 2.5-3 s in all on a 2-core
            CPU with the default).
        timeout_s: the child is killed after this many seconds.
        threads: torch intra-op threads in the child (0: torch's default), as a runner
            of this node would run with.
        samples: each rate is the median of this many timed windows (at least 1), so a
            burst of load from elsewhere moves it less than a mean would.

    Returns:
        The profile. Never raises for a failed measurement: a child that fails, prints
        no profile or times out gives psutil's memory figures, zeros for the measured
        ones, ``accelerator="unknown"`` and the reason in ``note``.
    """
    start = time.perf_counter()
    try:
        done = subprocess.run(
            _command(device, seconds, threads, samples), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return _failed_profile(f"profile child timed out after {timeout_s} s", time.perf_counter() - start)
    except OSError as exc:
        return _failed_profile(f"profile child did not start: {exc}", time.perf_counter() - start)
    return _parse(done.returncode, done.stdout, done.stderr, time.perf_counter() - start)


async def measure_host_async(
    device: str = "auto", seconds: float = 0.5, timeout_s: float = 60.0, threads: int = 0, samples: int = 5
) -> HostProfile:
    """:func:`measure_host` without blocking the event loop (``asyncio`` child process).

    Same arguments and result; never raises for a failed measurement (a child that times
    out is killed). Cancelling the awaiting task kills the child too.
    """
    start = time.perf_counter()
    try:
        proc = await asyncio.create_subprocess_exec(
            *_command(device, seconds, threads, samples),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        return _failed_profile(f"profile child did not start: {exc}", time.perf_counter() - start)
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        _kill(proc)
        await proc.wait()
        return _failed_profile(f"profile child timed out after {timeout_s} s", time.perf_counter() - start)
    except BaseException:
        _kill(proc)
        raise
    return _parse(
        proc.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace"), time.perf_counter() - start
    )


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass


# -- the child: torch measurements --------------------------------------------------------


def _timed_rate(fn, work: float, budget_s: float, sync, samples: int = 1) -> float:
    """``work`` units per second of ``fn()``: one untimed warm-up run, then ``samples``
    timed windows of ``budget_s / samples`` each (runs in growing batches, synchronized
    after each batch, until the window is over); the median window's rate."""
    fn()
    sync()
    rates = []
    for _ in range(max(samples, 1)):
        runs, batch = 0, 1
        start = time.perf_counter()
        while True:
            for _ in range(batch):
                fn()
            sync()
            runs += batch
            elapsed = time.perf_counter() - start
            if elapsed >= budget_s / max(samples, 1):
                break
            batch = min(batch * 2, 64)
        rates.append(work * runs / elapsed)
    return statistics.median(rates)


def device_problem(device: str, timeout_s: float = 60.0) -> str | None:
    """Why runners cannot compute on ``device`` (:data:`DEVICE_RE`) on this machine, as
    :func:`pick_device` says it, or None; ``auto`` and ``cpu`` always can. Asks a child
    process (torch's import, 1-2 s: the node never imports torch)."""
    if device in ("auto", "cpu"):
        return None
    code = "import sys, torch\nfrom shardline.devices import pick_device\npick_device(torch, sys.argv[1])"
    try:
        done = subprocess.run([sys.executable, "-c", code, device], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"torch did not answer within {timeout_s:g} s"
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return last.removeprefix("RuntimeError: ")


def _nvml_memory(index: int) -> tuple[int, int] | None:
    """(total, free) bytes of CUDA device ``index`` from NVML, or None without pynvml.

    Assumes CUDA_VISIBLE_DEVICES, if set, lists plain indices (else NVML's numbering may
    differ from torch's and None is returned)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if index >= len(ids) or not ids[index].isdigit():
            return None
        index = int(ids[index])
    try:
        import pynvml  # noqa: PLC0415 (optional)
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            return int(info.total), int(info.free)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 (any NVML failure: fall back to torch)
        return None


def other_cores(busy_s: float, own_s: float, wall_s: float) -> float:
    """CPUs other processes kept busy over ``wall_s`` seconds in which the machine spent
    ``busy_s`` busy CPU seconds, ``own_s`` of them this process's (0 for no time)."""
    return max(0.0, (busy_s - own_s) / wall_s) if wall_s > 0 else 0.0


def _measure(device: str, seconds: float, threads: int = 0, samples: int = 1) -> dict:
    """The child's work: every HostProfile field as a dict (imports torch)."""
    busy, own, start = busy_cpu_seconds(), time.process_time(), time.monotonic()
    result = _measure_rates(device, seconds, threads, samples)
    result["other_cores"] = other_cores(busy_cpu_seconds() - busy, time.process_time() - own, time.monotonic() - start)
    return result


def _measure_rates(device: str, seconds: float, threads: int, samples: int) -> dict:
    """:func:`_measure`'s figures but the other processes' load."""
    import torch  # noqa: PLC0415 (only in the child)

    if threads > 0:
        torch.set_num_threads(threads)
    result = _host_memory()
    result["threads"], result["samples"] = threads, samples
    dev = pick_device(torch, device)
    probe = torch.ones(64, 64, device=dev)
    (probe @ probe).sum().item()  # the device's runtime (CUDA context, kernels) in memory
    layer_s = runner_runtime()  # on the CPU: a figure for CPU runners only
    release_free_memory()  # the probe model's freed heap: a runner trims its own after loading
    result["runtime_baseline_bytes"] = memory_now()[0]
    result["host_layer_s"] = layer_s
    if dev.type == "cpu":
        result["decode_layer_s"] = layer_s
        result["decode_weight_bytes_per_s"] = decode_weight_rate(samples)  # after: not a runner's
    del probe
    notes: list[str] = []
    sync, dtypes, n = _accelerator(torch, dev, result)

    # Matmul: 2·n³ FLOP a product.
    result["matmul_flops"], result["matmul_dtype"] = _matmul_rate(
        torch, dev, dtypes, n, seconds * 2 / 3, sync, samples, notes
    )

    # Memory bandwidth: copy a 256 MiB tensor into another (read + write bytes per second).
    size = _COPY_BYTES
    if dev.type == "cpu":
        size = min(size, result["available_bytes"] // 8)  # both tensors well within free memory
    size = max(size // 4 * 4, 4)
    src = torch.ones(size // 4, dtype=torch.float32, device=dev)
    dst = torch.zeros_like(src)  # both touched: page faults are not timed
    result["memory_bandwidth_bytes_per_s"] = _timed_rate(
        lambda: dst.copy_(src), 2.0 * size, seconds / 3, sync, samples=max(samples, 3)
    )
    result["note"] = "; ".join(notes)
    return result


def _accelerator(torch: Any, dev: Any, result: dict) -> tuple[Callable[[], None], list, int]:
    """Fill ``result``'s accelerator fields for ``dev`` (a CUDA GPU's memory by NVML where
    it can, and its decode layer cost and weight-read rate; MPS's; none on the CPU).
    Returns (a function that waits for the device's queued work, the matmul dtypes to time
    in order, the matmul's side n)."""
    if dev.type == "cuda":
        nvml = _nvml_memory(dev.index)  # before torch creates a context on the device
        torch.cuda.set_device(dev)
        if nvml is None:
            free, total = torch.cuda.mem_get_info(dev)
        else:
            total, free = nvml
        result["accelerator"] = f"cuda:{dev.index} {torch.cuda.get_device_name(dev)}"
        result["accelerator_total_bytes"], result["accelerator_free_bytes"] = int(total), int(free)
        result["decode_layer_s"] = cuda_decode_layer_s(dev)  # after: its graphs take memory
        result["decode_weight_bytes_per_s"] = cuda_decode_weight_rate(dev)

        def sync() -> None:
            torch.cuda.synchronize(dev)

        return sync, [torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16], _MATMUL_N_GPU
    if dev.type == "mps":
        total = (
            int(torch.mps.recommended_max_memory())
            if hasattr(torch.mps, "recommended_max_memory")
            else result["total_bytes"]
        )
        used = int(torch.mps.driver_allocated_memory()) if hasattr(torch.mps, "driver_allocated_memory") else 0
        result["accelerator"] = "mps"
        result["accelerator_total_bytes"] = total
        result["accelerator_free_bytes"] = max(0, min(total - used, result["available_bytes"]))

        def mps_sync() -> None:
            torch.mps.synchronize()

        return mps_sync, [torch.bfloat16, torch.float16], _MATMUL_N_GPU  # bf16 needs macOS 14; the first that runs
    result["accelerator"] = "cpu"
    result["accelerator_total_bytes"] = result["accelerator_free_bytes"] = 0

    def no_sync() -> None:
        pass

    return no_sync, [torch.bfloat16, torch.float32], _MATMUL_N_CPU  # both timed; the faster is reported


def _matmul_rate(
    torch: Any,
    dev: Any,
    dtypes: list,
    n: int,
    budget_s: float,
    sync: Callable[[], None],
    samples: int,
    notes: list[str],
) -> tuple[float, str]:
    """(FLOP/s, dtype name) of the fastest n x n product among ``dtypes`` within
    ``budget_s`` seconds (on the CPU each dtype gets its share; on an accelerator the
    first that runs is taken); a dtype that fails is noted in ``notes``. (0.0, "") where
    none runs."""
    best_rate, best_dtype = 0.0, ""
    for dtype in dtypes:
        try:
            a = torch.randn(n, n, device=dev).to(dtype)
            b = torch.randn(n, n, device=dev).to(dtype)
            rate = _timed_rate(
                lambda: torch.mm(a, b),
                2.0 * n**3,
                budget_s / (len(dtypes) if dev.type == "cpu" else 1),
                sync,
                samples=samples,
            )
        except (RuntimeError, TypeError) as exc:  # a dtype this device lacks
            notes.append(f"{str(dtype).removeprefix('torch.')} matmul failed: {str(exc)[:200]}")
            continue
        if rate > best_rate:
            best_rate, best_dtype = rate, str(dtype).removeprefix("torch.")
        if dev.type != "cpu":
            break
    return best_rate, best_dtype


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print this machine's HostProfile as JSON.")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    parser.add_argument("--seconds", type=float, default=0.5, help="timed loops, about, in all")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--samples", type=int, default=1, help="timed windows per rate (median)")
    args = parser.parse_args(argv)
    if not DEVICE_RE.match(args.device):
        print(f"unknown device {args.device!r} (auto, cpu, cuda, cuda:N or mps)", file=sys.stderr)
        return 2
    try:
        result = _measure(args.device, max(args.seconds, 0.0), max(args.threads, 0), max(args.samples, 1))
    except Exception as exc:  # noqa: BLE001 (reported to the parent as the note)
        print(f"{type(exc).__name__}: {exc}".replace("\n", " "), file=sys.stderr)
        return 1
    print(json.dumps(result), flush=True)
    return 0


__all__ = ["HostProfile", "measure_host", "measure_host_async"]


if __name__ == "__main__":
    sys.exit(main())
