"""Placement preview: the placements of a model a set of nodes allows, with predicted speed.

:func:`preview` lists candidate placements (a sharding and the nodes in rank order), each
either feasible, with its ranks' shares from :func:`~shardline.placement.ranks.place_with_kv_pool`
and a predicted decode and prefill speed, or infeasible, with the
:class:`~shardline.placement.layer_ranges.PlacementError` message that says which node lacks
how many bytes or which shape cannot split. :func:`auto` picks the best feasible one.

Memory is checked by ``place_with_kv_pool`` alone; the speeds are the speed model's
(:func:`shardline.placement.speed.predict_tokens_per_s`), corrected by what placements
measured while serving (:func:`shardline.placement.served.calibrate`).

Everything here is pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from shardline.models.config import ModelConfig, RankShare, Sharding
from shardline.placement.layer_ranges import NodeCapacity, PlacementError
from shardline.placement.memory import RUNTIME_BASELINE_BYTES
from shardline.placement.ranks import (
    PlacementOptions,
    draft_hint,
    place_with_kv_pool,
    ranks_bytes,
    resident_bytes_per_weight,
    with_draft_model,
)
from shardline.placement.served import Basis, PlacementKey, ServedSpeed, calibrate
from shardline.placement.speed import Link, NodeProfile, check_dtype, predict_tokens_per_s


@dataclass(frozen=True)
class Candidate:
    """One placement: a sharding on nodes (in rank order), feasible or not.

    Attributes:
        sharding: ``"pipeline"``, ``"tensor"`` or ``"ring"``.
        node_ids: the nodes, node i is rank i.
        shares: each rank's share (``place_with_kv_pool``'s answer); empty when infeasible.
        predicted_decode_tokens_per_s: tokens/s one sequence decodes at; None when infeasible.
        predicted_prefill_tokens_per_s: prompt tokens/s one long prompt prefills at; None
            when infeasible.
        error: why the placement is refused (``PlacementError``'s message: the node and its
            shortfall in bytes, or the shape that cannot split); None when feasible.
        kv_tokens: the KV pool it would have (tokens, all sequences together); 0 when
            infeasible.
        model_decode_tokens_per_s, model_prefill_tokens_per_s: the first-order
            prediction (:func:`predict_tokens_per_s`) before what the cluster measured
            corrected it into the ``predicted_*`` figures; None when infeasible.
        decode_basis, prefill_basis: where each ``predicted_*`` figure comes from
            (:data:`shardline.placement.served.Basis`: ``"model"``, ``"measured"``,
            ``"scaled"``).
        rank_bytes: the bytes each rank would hold (:func:`~shardline.placement.ranks.rank_bytes`,
            what the coordinator records as a placed rank's ``estimated_bytes``); empty when
            infeasible.
    """

    sharding: Sharding
    node_ids: tuple[str, ...]
    shares: tuple[RankShare, ...] = ()
    predicted_decode_tokens_per_s: float | None = None
    predicted_prefill_tokens_per_s: float | None = None
    error: str | None = None
    kv_tokens: int = 0
    model_decode_tokens_per_s: float | None = None
    model_prefill_tokens_per_s: float | None = None
    decode_basis: Basis = "model"
    prefill_basis: Basis = "model"
    rank_bytes: tuple[int, ...] = ()

    @property
    def feasible(self) -> bool:
        return self.error is None


def _subsets(nodes: Sequence[NodeProfile], max_nodes: int | None, min_nodes: int = 1) -> list[list[NodeProfile]]:
    """For k = min_nodes .. max_nodes, the k nodes with the most available bytes, most first
    (ties in the given order)."""
    ranked = sorted(nodes, key=lambda n: -n.available_bytes)
    top = len(ranked) if max_nodes is None else min(max_nodes, len(ranked))
    return [ranked[:k] for k in range(max(min_nodes, 1), top + 1)]


def _measured_placements(
    served: Sequence[ServedSpeed],
    nodes: Sequence[NodeProfile],
    listed: Sequence[tuple[Sharding, Sequence[NodeProfile]]],
    model_id: str,
    dtype: str,
    quantize: str | None,
    shardings: Sequence[Sharding],
    min_nodes: int,
    max_nodes: int | None,
) -> list[tuple[Sharding, list[NodeProfile]]]:
    """The placements of ``model_id`` (in ``dtype``, ``quantize``) that served, on
    ``nodes`` under ``shardings`` and within the node counts, that ``listed`` lacks: each
    in its own rank order (a placement made by hand or by ``shardline cluster`` need not be
    in the preview's order, and its measured figures should still be listed), oldest
    record first."""
    by_id = {n.node_id: n for n in nodes}
    seen = {(str(sharding), tuple(n.node_id for n in subset)) for sharding, subset in listed}
    top = len(nodes) if max_nodes is None else max_nodes
    out: list[tuple[Sharding, list[NodeProfile]]] = []
    for speed in sorted(served, key=lambda s: s.at):
        key = speed.key
        if (
            key.model_id != model_id
            or key.dtype != dtype
            or key.quantize != quantize
            or key.sharding not in shardings
            or not max(min_nodes, 1) <= len(key.node_ids) <= top
            or not all(i in by_id for i in key.node_ids)
            or (key.sharding, key.node_ids) in seen
        ):
            continue
        seen.add((key.sharding, key.node_ids))
        out.append((Sharding(key.sharding), [by_id[i] for i in key.node_ids]))
    return out


def applies(sharding: Sharding, config: ModelConfig) -> bool:
    """Whether ``sharding`` can place ``config`` at all: expert sharding a mixture of
    experts, ring a model without attention sinks or sliding windows."""
    if sharding == Sharding.EXPERT:
        return config.is_moe
    if sharding == Sharding.RING:
        return not (config.attention_sinks or config.sliding_window)
    return True


def preview(
    config: ModelConfig,
    nodes: Sequence[NodeProfile],
    links: Mapping[tuple[str, str], Link] | None,
    options: PlacementOptions,
    *,
    weight_file_bytes: int = 0,
    baseline_bytes: int = RUNTIME_BASELINE_BYTES,
    model_id: str = "",
    served: Sequence[ServedSpeed] = (),
    draft_bytes: int = 0,
) -> list[Candidate]:
    """Every candidate placement of ``config`` on ``nodes`` under ``options`` (resolved:
    :meth:`~shardline.placement.ranks.PlacementOptions.sizes`), feasible ones first,
    fastest first.

    Candidates: for each k from ``min_nodes`` to ``max_nodes`` (default: all), the k nodes with the most
    available bytes, in rank order by available bytes (most first), under each sharding in
    ``shardings`` (of several, those that :func:`applies` to the model: asked for alone, a
    sharding that does not is listed refused, with the reason). One node is listed as a
    pipeline of one when ``"pipeline"`` is in ``shardings`` (tensor or ring of one is the
    same placement), else under each sharding asked (a placement of one node under it
    works, and the preview says so). Then each
    placement of ``model_id`` in ``served`` that these miss (other nodes or another rank
    order) and the same bounds allow, in its own rank order.

    Memory per rank is ``place_with_kv_pool``'s check under ``options``, with
    ``weight_file_bytes`` (the model's weight files, 0: unknown) and ``baseline_bytes`` of
    runtime per rank; the speeds are :func:`predict_tokens_per_s`'s (decode tokens/s of one sequence, prefill
    tokens/s), decode reading :func:`~shardline.placement.ranks.resident_bytes_per_weight`
    bytes a weight, then corrected by what placements of ``model_id`` measured while
    serving (``served``: :func:`shardline.placement.served.calibrate`'s rule; the
    uncorrected figures stay in ``model_*``). The sampling rank's node holds
    ``draft_bytes`` more, a draft model's (:func:`~shardline.placement.ranks.with_draft_model`).

    Returns:
        Feasible candidates sorted by predicted decode tokens/s, descending (ties: prefill
        tokens/s descending, then fewer nodes), then the infeasible ones in enumeration
        order, each with its ``error``.

    Raises:
        PlacementError: an unknown dtype (a ValueError).
        KVCacheRequestError: ``kv_cache_bytes`` holds less than one sequence.
        ValueError: ``options`` without a context or max_batch.
    """
    options.sizes()  # set, or a ValueError
    dtype, quantize = options.dtype, options.quantize
    check_dtype(dtype)
    quantized = quantize.value if quantize else None
    decode_weight_bytes = resident_bytes_per_weight(config, weight_file_bytes, dtype, quantize)
    options.kv_tokens(config)  # a pool of less than one sequence is refused first
    placements = _placements(
        config, nodes, options.shardings, options.max_nodes, options.min_nodes or 1, served, model_id, dtype, quantized
    )
    candidates = [
        _candidate(
            config,
            sharding,
            subset,
            links,
            options,
            weight_file_bytes,
            baseline_bytes,
            decode_weight_bytes,
            model_id,
            served,
            draft_bytes,
        )
        for sharding, subset in placements
    ]
    feasible = [c for c in candidates if c.feasible]
    infeasible = [c for c in candidates if not c.feasible]
    feasible.sort(
        key=lambda c: (
            -(c.predicted_decode_tokens_per_s or 0.0),
            -(c.predicted_prefill_tokens_per_s or 0.0),
            len(c.node_ids),
        )
    )
    return feasible + infeasible


def _candidate(
    config: ModelConfig,
    sharding: Sharding,
    subset: Sequence[NodeProfile],
    links: Mapping[tuple[str, str], Link] | None,
    options: PlacementOptions,
    weight_file_bytes: int,
    baseline_bytes: int,
    decode_weight_bytes: float,
    model_id: str,
    served: Sequence[ServedSpeed],
    draft_bytes: int = 0,
) -> Candidate:
    """One placement of :func:`preview`'s: ``sharding`` on ``subset`` (in rank order),
    feasible with its shares, speeds and each rank's bytes, or refused with its error
    (``decode_weight_bytes``: :func:`~shardline.placement.ranks.resident_bytes_per_weight`'s,
    the same for every candidate; ``draft_bytes``: a draft model's, on the sampling rank)."""
    ids = tuple(n.node_id for n in subset)
    try:
        free = [NodeCapacity(n.node_id, n.available_bytes) for n in subset]
        capacities, drafts = with_draft_model(sharding, free, draft_bytes)
        shares, kv_pool = place_with_kv_pool(config, sharding, capacities, options, weight_file_bytes, baseline_bytes)
    except PlacementError as exc:
        return Candidate(sharding, ids, error=f"{exc}{draft_hint(draft_bytes)}")
    dtype, quantize = options.dtype, options.quantize
    model = predict_tokens_per_s(
        config, sharding, subset, shares, links, options.sizes()[0], dtype, decode_weight_bytes=decode_weight_bytes
    )
    key = PlacementKey(model_id, str(sharding), ids, dtype, quantize.value if quantize else None)
    decode, prefill, decode_basis, prefill_basis = calibrate(key, model, served)
    held = ranks_bytes(config, sharding, shares, options, weight_file_bytes, baseline_bytes, kv_pool)
    held = tuple(h + d for h, d in zip(held, drafts))
    return Candidate(
        sharding,
        ids,
        tuple(shares),
        decode,
        prefill,
        kv_tokens=kv_pool,
        model_decode_tokens_per_s=model[0],
        model_prefill_tokens_per_s=model[1],
        decode_basis=decode_basis,
        prefill_basis=prefill_basis,
        rank_bytes=held,
    )


def _placements(
    config: ModelConfig,
    nodes: Sequence[NodeProfile],
    shardings: Sequence[Sharding],
    max_nodes: int | None,
    min_nodes: int,
    served: Sequence[ServedSpeed],
    model_id: str,
    dtype: str,
    quantized: str | None,
) -> list[tuple[Sharding, list[NodeProfile]]]:
    """The (sharding, nodes in rank order) placements :func:`preview` weighs, in its
    enumeration order: each node subset under each sharding (of several, those that
    :func:`applies` to the model; one node as a pipeline where pipeline is asked for), then
    the measured placements of ``model_id`` in ``served`` these miss."""
    if len(shardings) > 1:  # all of them (auto): only those the model can take
        shardings = [s for s in shardings if applies(s, config)]
    one_node = Sharding.PIPELINE if Sharding.PIPELINE in shardings else None  # else as asked
    placements = [
        (sharding, subset)
        for subset in _subsets(nodes, max_nodes, min_nodes)
        for sharding in shardings
        if len(subset) > 1 or sharding == one_node or one_node is None
    ]
    placements += _measured_placements(
        served, nodes, placements, model_id, dtype, quantized, shardings, min_nodes, max_nodes
    )
    return placements


def auto(
    config: ModelConfig,
    nodes: Sequence[NodeProfile],
    links: Mapping[tuple[str, str], Link] | None,
    options: PlacementOptions,
    *,
    weight_file_bytes: int = 0,
    baseline_bytes: int = RUNTIME_BASELINE_BYTES,
    model_id: str = "",
    served: Sequence[ServedSpeed] = (),
    draft_bytes: int = 0,
) -> Candidate:
    """The feasible candidate of :func:`preview` with the highest predicted decode tokens/s.

    Raises:
        PlacementError: no candidate is feasible; the message lists each candidate's
            sharding, nodes and why it was refused.
    """
    candidates = preview(
        config,
        nodes,
        links,
        options,
        weight_file_bytes=weight_file_bytes,
        baseline_bytes=baseline_bytes,
        model_id=model_id,
        served=served,
        draft_bytes=draft_bytes,
    )
    if candidates and candidates[0].feasible:
        return candidates[0]
    if not candidates:
        raise PlacementError("no placement to try: no nodes (or no sharding) given")
    reasons = "; ".join(f"{c.sharding} on [{', '.join(c.node_ids)}]: {c.error}" for c in candidates)
    raise PlacementError(f"no placement fits: {reasons}")
