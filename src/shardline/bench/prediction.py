"""The placement's predicted speed beside the speed the benchmark measured.

After the workload the bench asks the cluster for the benchmarked instance's ``speed``
(``GET /cluster/instances``): the placement preview's first-order decode and prefill
tokens/s for it now (:mod:`shardline.placement.speed`, decode at the context the measured
requests ran at) and what the cluster itself measured of the requests that ran alone.
Printed with the bench's own one-request decode figure, it says how far the preview that
chose the placement is from what the placement does.
"""

from __future__ import annotations

import time
from typing import Any

import httpx


def instance_speed(
    url: str, model: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0, poll_s: float = 0.5
) -> dict[str, Any] | None:
    """The ``speed`` of ``model``'s ready instance on the shardline cluster at ``url``
    (keys as ``GET /cluster/instances`` gives them: ``predicted_decode_tokens_per_s``,
    ``measured_decode_tokens_per_s``, ``decode_samples``, ``decode_context``, ...); None
    where the server has no cluster API or no ready instance of it says one. The node
    predicts nothing while it reads the model's card the first time (seconds for a GGUF,
    in the background): asked again every ``poll_s`` for up to ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            instances = httpx.get(f"{url}/cluster/instances", timeout=timeout_s, headers=headers).json()["instances"]
            ready = [i for i in instances if i["model_id"] == model and i["status"] == "ready"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        speed = ready[0].get("speed") if ready else None
        if not isinstance(speed, dict):
            return None
        if speed.get("predicted_decode_tokens_per_s") or time.monotonic() > deadline:
            return speed
        time.sleep(poll_s)


def one_request_decode(report: dict[str, Any], server: str) -> float | None:
    """``server``'s median decode tokens/s in the report's concurrency-1 level of the
    shortest prompt (the figure the preview's one-sequence decode predicts), else None."""
    levels = [w for w in report["workloads"] if w["kind"] == "level" and w["concurrency"] == 1]
    if not levels:
        return None
    level = min(levels, key=lambda w: w["prompt_tokens"])
    return level["results"][server]["figures"]["median_decode_tokens_per_s"]


def prediction_line(speed: dict[str, Any], bench_decode: float | None) -> str | None:
    """One line: the predicted decode tokens/s, the cluster's and the bench's measured
    figures and predicted / measured (against the bench's, else the cluster's); None
    where the cluster predicted nothing (a node or the model card not known yet)."""
    predicted = speed.get("predicted_decode_tokens_per_s")
    if not predicted:
        return None
    parts = []
    cluster = speed.get("measured_decode_tokens_per_s")
    if cluster:
        parts.append(
            f"{cluster:.1f} by the cluster (median of {speed.get('decode_samples', 0)} requests that ran alone)"
        )
    if bench_decode:
        parts.append(f"{bench_decode:.1f} by this bench (concurrency 1)")
    line = (
        f"placement's predicted decode: {predicted:.1f} tokens/s (sequences up to {speed.get('decode_context')} tokens)"
    )
    measured = bench_decode or cluster
    if not measured:
        return line
    return f"{line}; measured {', '.join(parts)}: predicted / measured {predicted / measured:.2f}x"
