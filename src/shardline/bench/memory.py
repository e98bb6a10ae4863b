"""``shardline bench --memory``: what each rank of the benchmarked instance holds.

After the workload, every rank's node is asked for its runner's memory
(``GET /cluster/instances``, ``local_memory``): the resident set now (steady: idle after
the workload, when a runner has handed its prefill scratch back) and its peak (the
workload's, a full prefill chunk's scratch included), and the peak while loading. Beside
them: the bytes of the model's files the rank read for its shard, what placement counted
it to hold (``estimated_bytes``, the serving peak: KV pool and scratch included) and the
runtime placement counts on its node (measured by the node's profile, ``GET
/cluster/nodes``). Resident memory is private memory (:mod:`shardline.process_memory`:
anonymous pages, not the libraries' shared, reclaimable file pages), Python's and torch's
runtime included.
"""

from __future__ import annotations

import sys
from typing import Any

import httpx

from shardline.placement.memory import runtime_baseline


class MemoryReportError(RuntimeError):
    """The instance or a rank's node could not be asked."""


def rank_memory(
    url: str, model: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0
) -> list[dict[str, Any]]:
    """One row per rank of ``model``'s ready instance on the cluster at ``url``: ``rank``,
    ``node_id``, ``share`` (layers or heads), ``file_bytes`` (read from the model's
    files), ``estimated_bytes``, ``baseline_bytes`` (the runtime placement counts on its
    node: what the node's profile measured, :func:`runtime_baseline`), ``runtime_rss_bytes`` (the runner's before any weight), ``rss_bytes``,
    ``peak_rss_bytes``, ``load_peak_rss_bytes`` (bytes; None where a node did not say).

    Raises:
        MemoryReportError: no ready instance of ``model``, or a node did not answer.
    """
    try:
        instances = httpx.get(f"{url}/cluster/instances", timeout=timeout_s, headers=headers).json()["instances"]
        nodes = httpx.get(f"{url}/cluster/nodes", timeout=timeout_s, headers=headers).json()["nodes"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise MemoryReportError(f"{url}: {exc}") from exc
    baselines = {
        n["node_id"]: runtime_baseline([(n.get("profile") or {}).get("runtime_baseline_bytes") or 0]) for n in nodes
    }
    ready = [i for i in instances if i["model_id"] == model and i["status"] == "ready"]
    if not ready:
        raise MemoryReportError(f"no ready instance of {model} on {url}")
    inst = ready[0]
    rows = []
    for r, rank in enumerate(inst["ranks"]):
        try:
            views = httpx.get(f"http://{rank['address']}/cluster/instances", timeout=timeout_s, headers=headers).json()[
                "instances"
            ]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise MemoryReportError(f"node {rank['node_id']} ({rank['address']}): {exc}") from exc
        mine = next((v for v in views if v["instance_id"] == inst["instance_id"]), None)
        memory = (mine or {}).get("local_memory") or {}
        share = rank.get("tensor_share")
        rows.append(
            {
                "rank": r,
                "node_id": rank["node_id"],
                "share": (
                    f"heads {share['heads'][0]}-{share['heads'][1] - 1}"
                    if share
                    else f"layers {rank['layer_start']}-{rank['layer_end'] - 1}"
                ),
                "file_bytes": (rank.get("loaded") or {}).get("bytes_read"),
                "estimated_bytes": rank.get("estimated_bytes"),
                "baseline_bytes": baselines.get(rank["node_id"]),
                "rss_bytes": memory.get("rss_bytes"),
                "peak_rss_bytes": memory.get("peak_rss_bytes"),
                "load_peak_rss_bytes": memory.get("load_peak_rss_bytes"),
                "runtime_rss_bytes": memory.get("runtime_rss_bytes"),
            }
        )
    return rows


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.0f}"


def _ratio(a: int | None, b: int | None) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}"


def print_memory(rows: list[dict[str, Any]], console=None) -> None:
    """A rich table of :func:`rank_memory`'s rows, in MiB, with estimate / peak and load
    peak / steady."""
    from rich.console import Console
    from rich.table import Table

    # Wide enough for every column when the output is not a terminal (rich assumes 80).
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    table = Table(
        caption="MiB. file: the model's bytes the rank read; est.: what placement "
        "counted it to hold; baseline: the runtime it counted (measured); runtime: "
        "its private resident memory before any weight; RSS: the same, "
        "idle after the workload; peak, load peak: the highest so far and "
        "while loading.",
        caption_justify="left",
    )
    for title in (
        "rank",
        "node",
        "share",
        "file",
        "est.",
        "baseline",
        "runtime",
        "RSS",
        "peak",
        "load\npeak",
        "est.\n/peak",
        "load\n/RSS",
    ):
        table.add_column(title, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(
            str(row["rank"]),
            row["node_id"][:8],
            row["share"],
            _mib(row["file_bytes"]),
            _mib(row["estimated_bytes"]),
            _mib(row["baseline_bytes"]),
            _mib(row["runtime_rss_bytes"]),
            _mib(row["rss_bytes"]),
            _mib(row["peak_rss_bytes"]),
            _mib(row["load_peak_rss_bytes"]),
            _ratio(row["estimated_bytes"], row["peak_rss_bytes"]),
            _ratio(row["load_peak_rss_bytes"], row["rss_bytes"]),
        )
    console.print(table)
