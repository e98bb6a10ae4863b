"""What a rank holds in memory, and what each node has left: pure functions over values.

A rank's runner holds (:func:`rank_bytes`), in private memory
(:mod:`shardline.process_memory`): the process's runtime (Python and torch, measured once
per machine by the node's profile, else :data:`RUNTIME_BASELINE_BYTES`), its
weights at :func:`~shardline.placement.ranks.resident_bytes_per_weight` each (the file's
own quantization), its KV cache reservation, and the scratch a prefill chunk needs (a
dequantized weight block and the chunk's activations).

A node offers ``offered`` bytes (its ``--memory-limit``, else the memory the system has
available plus what its own runners hold); the estimates of the ranks placed on it are
``committed``; the rest is ``free``, what the next placement may use. The coordinator
computes ``committed`` from its own instance table, so two placements in a row cannot
both count the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

from shardline.models.budgets import DEQUANT_SCRATCH_BYTES

RUNTIME_BASELINE_BYTES = 256 * 2**20
"""A runner's private memory besides its shard (Python, torch, shardline, the kernels'
buffers), where the node has not measured it: 150-160 MiB measured on Linux x86-64 with
torch 2.13, counted with room to spare (another platform's runtime is unknown)."""

RUNNER_EXTRA_BYTES = 8 * 2**20
"""What a runner holds beyond the node profile's measured runtime (which already ran a
tiny model's kernels): its process group and threads (a few MiB on Linux x86-64)."""


def runtime_baseline(measured: list[int]) -> int:
    """The runtime bytes to count per rank on nodes whose profiles measured ``measured``
    (``HostProfile.runtime_baseline_bytes`` each; 0: not measured): the largest measured
    plus :data:`RUNNER_EXTRA_BYTES`, or :data:`RUNTIME_BASELINE_BYTES` where a node has
    not measured it."""
    if not measured or any(m <= 0 for m in measured):
        return max([RUNTIME_BASELINE_BYTES] + [m + RUNNER_EXTRA_BYTES for m in measured])
    return max(measured) + RUNNER_EXTRA_BYTES


def prefill_scratch_bytes(
    hidden: int, intermediate: int, largest_weight: int, dtype_bytes: int, chunk_tokens: int = 512
) -> int:
    """Scratch of one prefill chunk: the largest weight dequantized into the compute dtype
    of ``dtype_bytes`` bytes (at most :data:`DEQUANT_SCRATCH_BYTES`) and the chunk's
    float32 activations (hidden states, the fused gate/up output and the attention's
    q/k/v, about ``chunk * (4 * hidden + 2 * intermediate)`` elements)."""
    dequant = min(dtype_bytes * largest_weight, DEQUANT_SCRATCH_BYTES)
    return dequant + 4 * chunk_tokens * (4 * hidden + 2 * intermediate)


def committed_bytes(ranks: Iterable[tuple[str, int]], node_id: str) -> int:
    """Bytes committed on ``node_id``: the sum of ``(node, estimated bytes)`` of the live
    instances' ranks placed on it."""
    return sum(b for n, b in ranks if n == node_id)


def free_bytes(offered: int, committed: int) -> int:
    """What a node can still give: ``offered - committed``, never below 0."""
    return max(0, offered - committed)


GPU_MEMORY_FRACTION = 0.9
"""The share of a GPU's memory a node offers to models (vLLM's default
``gpu_memory_utilization``): the rest for the CUDA context, its allocator's slack and
other programs."""


def gpu_bytes(profile: dict | None) -> int | None:
    """Bytes a node whose runners compute on a CUDA GPU offers to models:
    :data:`GPU_MEMORY_FRACTION` of the GPU's memory, from its profile
    (``shardline.node.profile.HostProfile``: ``accelerator`` ``"cuda:N name"``,
    ``accelerator_total_bytes``); None for a node that computes on its CPU (or has no
    profile yet)."""
    if not profile or not str(profile.get("accelerator", "")).startswith("cuda"):
        return None
    total = int(profile.get("accelerator_total_bytes") or 0)
    return int(GPU_MEMORY_FRACTION * total) if total else None
