"""Placement preview: candidates from place_ranks with predicted speeds, best first; refusals
say which node lacks how many bytes or which shape cannot split."""

import itertools

import pytest
from model_shapes import llama8b as _llama8b
from model_shapes import smollm2 as _smollm2

from shardline.placement.layer_ranges import NodeCapacity, PlacementError
from shardline.placement.preview import Candidate, auto, preview
from shardline.placement.ranks import PlacementOptions, place_ranks
from shardline.placement.speed import (
    DEFAULT_LINK,
    POINT_TO_POINT_BYTES,
    Link,
    NodeProfile,
    link_between,
    predict_tokens_per_s,
)

pytestmark = [pytest.mark.fast, pytest.mark.timeout(30)]

GB = 1 << 30


def _node(name: str, available: int = 64 * GB, bandwidth: float = 100e9, flops: float = 10e12) -> NodeProfile:
    return NodeProfile(name, available, bandwidth, flops)


def _mesh(names, link: Link) -> dict:
    return {(a, b): link for a, b in itertools.combinations(names, 2)}


def _find(candidates, sharding, k) -> Candidate:
    return next(c for c in candidates if c.sharding == sharding and len(c.node_ids) == k)


def test_uneven_memory_gives_uneven_pipeline_ranges():
    config = _smollm2()
    nodes = [_node("small", 4 * GB), _node("big", 12 * GB)]
    candidates = preview(config, nodes, {}, PlacementOptions(4096, 8, shardings=("pipeline",)))
    two = _find(candidates, "pipeline", 2)
    assert two.feasible and two.node_ids == ("big", "small")  # ranked by memory
    ranges = [(s.layer_start, s.layer_end) for s in two.shares]
    assert ranges[0][0] == 0 and ranges[-1][1] == 30 and ranges[0][1] == ranges[1][0]
    assert ranges[0][1] - ranges[0][0] > ranges[1][1] - ranges[1][0]
    # The shares are place_ranks's, not a copy of its memory logic.
    capacities = [NodeCapacity("big", 12 * GB), NodeCapacity("small", 4 * GB)]
    assert list(two.shares) == place_ranks(config, "pipeline", capacities, 4096, 8)


def test_each_rank_s_bytes_are_what_the_coordinator_records_and_fit_its_node():
    """``rank_bytes``: what a placed rank's ``estimated_bytes`` would be (the dashboard
    shows it per node before placing); none for a refused candidate."""
    from shardline.placement.ranks import rank_bytes

    config = _smollm2()
    nodes = [_node("small", 1 * GB), _node("big", 3 * GB)]
    options = PlacementOptions(4096, 8, shardings=("pipeline", "tensor", "ring"))
    candidates = preview(config, nodes, {}, options)
    for c in candidates:
        if not c.feasible:
            assert c.rank_bytes == ()
            continue
        assert len(c.rank_bytes) == len(c.node_ids)
        capacity = {n.node_id: n.available_bytes for n in nodes}
        expected = [
            rank_bytes(config, c.sharding, list(c.shares), r, 4096, 8, kv_tokens=c.kv_tokens)
            for r in range(len(c.shares))
        ]
        assert list(c.rank_bytes) == expected
        assert all(0 < b <= capacity[n] for b, n in zip(c.rank_bytes, c.node_ids))


def test_one_node_is_a_pipeline_of_one_and_subsets_are_the_largest_nodes():
    nodes = [_node("a", 8 * GB), _node("b", 16 * GB), _node("c", 12 * GB)]
    candidates = preview(_smollm2(), nodes, {}, PlacementOptions(2048, 4))
    singles = [c for c in candidates if len(c.node_ids) == 1]
    assert [(c.sharding, c.node_ids) for c in singles] == [("pipeline", ("b",))]
    assert {c.node_ids for c in candidates} == {("b",), ("b", "c"), ("b", "c", "a")}
    assert len(candidates) == 1 + 3 + 3
    limited = preview(_smollm2(), nodes, {}, PlacementOptions(2048, 4, max_nodes=2))
    assert max(len(c.node_ids) for c in limited) == 2
    at_least = preview(_smollm2(), nodes, {}, PlacementOptions(2048, 4, min_nodes=2))
    assert {c.node_ids for c in at_least} == {("b", "c"), ("b", "c", "a")}


def test_a_model_that_does_not_fit_is_refused_with_node_and_shortfall():
    nodes = [_node("n0", 2 * GB), _node("n1", 2 * GB)]
    candidates = preview(_llama8b(), nodes, {}, PlacementOptions(4096, 1))
    assert candidates and not any(c.feasible for c in candidates)
    for c in candidates:
        assert c.shares == () and c.predicted_decode_tokens_per_s is None
        assert "short by" in c.error and "node n" in c.error
    ring = _find(candidates, "ring", 2)
    assert "node n0" in ring.error and "node n1" in ring.error
    refusal = r"no placement fits: pipeline on \[n0\]: .*short by \d+ bytes"
    with pytest.raises(PlacementError, match=refusal):
        auto(_llama8b(), nodes, {}, PlacementOptions(4096, 1))


def test_tensor_shapes_that_cannot_split_are_refused():
    config = _smollm2(
        num_layers=4, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1, head_dim=32, vocab_size=256
    )
    nodes = [_node(f"n{i}") for i in range(3)]
    candidates = preview(config, nodes, {}, PlacementOptions(256, 1, shardings=("tensor",)))
    three = _find(candidates, "tensor", 3)
    assert not three.feasible
    assert "3 tensor ranks but only 2 attention heads" in three.error
    assert _find(candidates, "tensor", 2).feasible
    assert candidates[-1] is three  # infeasible after feasible


def test_previews_are_ordered_by_predicted_decode_tokens_per_s():
    nodes = [
        _node("a", 24 * GB, bandwidth=50e9),
        _node("b", 20 * GB, bandwidth=200e9),
        _node("c", 4 * GB, bandwidth=100e9),
    ]
    candidates = preview(_llama8b(), nodes, _mesh("abc", Link(50e-6, 10e9)), PlacementOptions(4096, 2))
    feasible = [c for c in candidates if c.feasible]
    assert len(feasible) >= 3 and any(not c.feasible for c in candidates)
    seen_infeasible = False
    for c in candidates:
        seen_infeasible |= not c.feasible
        assert c.feasible != seen_infeasible  # all feasible ones first
    speeds = [c.predicted_decode_tokens_per_s for c in feasible]
    assert speeds == sorted(speeds, reverse=True)
    assert all(s > 0 and c.predicted_prefill_tokens_per_s > 0 for s, c in zip(speeds, feasible))


def test_slow_links_rank_tensor_below_pipeline():
    names = ["n0", "n1", "n2", "n3"]
    nodes = [_node(n, 16 * GB) for n in names]
    candidates = preview(
        _llama8b(), nodes, _mesh(names, Link(10e-3, 1e9)), PlacementOptions(4096, 1, shardings=("pipeline", "tensor"))
    )
    pipeline, tensor = _find(candidates, "pipeline", 4), _find(candidates, "tensor", 4)
    assert pipeline.feasible and tensor.feasible
    assert tensor.predicted_decode_tokens_per_s < pipeline.predicted_decode_tokens_per_s
    assert candidates.index(tensor) > candidates.index(pipeline)


def test_fast_links_and_equal_nodes_rank_tensor_above_pipeline_for_a_big_model():
    names = ["n0", "n1", "n2", "n3"]
    nodes = [_node(n, 16 * GB) for n in names]
    candidates = preview(
        _llama8b(), nodes, _mesh(names, Link(5e-6, 50e9)), PlacementOptions(4096, 1, shardings=("pipeline", "tensor"))
    )
    pipeline, tensor = _find(candidates, "pipeline", 4), _find(candidates, "tensor", 4)
    assert tensor.predicted_decode_tokens_per_s > 2 * pipeline.predicted_decode_tokens_per_s
    assert candidates[0] is tensor
    assert tensor.predicted_prefill_tokens_per_s > 0


def test_pipeline_prediction_follows_the_formula():
    config = _smollm2(
        num_layers=2, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1, head_dim=32, vocab_size=256
    )
    nodes = [_node("a", bandwidth=1e9, flops=1e12), _node("b", bandwidth=2e9, flops=1e12)]
    links = {("b", "a"): Link(1e-3, 1e6)}  # either key order
    shares = place_ranks(config, "pipeline", [NodeCapacity("a", GB), NodeCapacity("b", GB)], 100, 1)
    assert [(s.layer_start, s.layer_end) for s in shares] == [(0, 1), (1, 2)]
    decode, _ = predict_tokens_per_s(config, "pipeline", nodes, shares, links, context=100)
    linear = config.layer_param_count() - 2 * 64
    kv_layer = 2 * 1 * 32 * 2 * 50  # k and v, one KV head, bf16, 50 tokens on average
    expected = (linear + kv_layer) / 1e9 + (linear + 256 * 64 + kv_layer) / 2e9 + 1e-3 + 64 * 2 / 1e6 + 1e-3
    assert decode == pytest.approx(1 / expected)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(
    "hidden_size, latencies_per_all_reduce",
    [
        (64, lambda world: 1),  # a decode step's row: point-to-point, one hop
        (40_000, lambda world: 2 * (world - 1)),  # a row over POINT_TO_POINT_BYTES: gloo's ring
    ],
)
def test_a_tensor_decode_all_reduce_pays_its_algorithms_link_latencies(world, hidden_size, latencies_per_all_reduce):
    """A decode step's 2 all-reduces a layer each pay one latency where the sum is sent
    point to point (at most POINT_TO_POINT_BYTES), else gloo's ring all-reduce: a
    reduce-scatter and an all-gather of P-1 steps each, 2(P-1) latencies (measured on 2
    local nodes: 9.4 tokens/s where one latency a ring step less predicted 24); the step's
    proposals to rank 0 and back pay 2 more."""
    assert 40_000 * 4 > POINT_TO_POINT_BYTES >= 64 * 4
    config = _smollm2(
        num_layers=4,
        hidden_size=hidden_size,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        vocab_size=256,
    )
    names = [f"n{i}" for i in range(world)]
    nodes = [_node(n) for n in names]
    shares = place_ranks(config, "tensor", [NodeCapacity(n, GB) for n in names], 100, 1)

    def step_s(latency_s: float) -> float:
        decode, _ = predict_tokens_per_s(
            config, "tensor", nodes, shares, _mesh(names, Link(latency_s, 1e15)), context=100
        )
        return 1 / decode

    latency = 1e-3
    assert step_s(latency) - step_s(0.0) == pytest.approx(
        (2 * 4 * latencies_per_all_reduce(world) + 2) * latency, rel=1e-6
    )


def test_missing_links_default_to_1ms_and_100MB_per_s():
    assert DEFAULT_LINK == Link(1e-3, 100e6)
    fast = Link(1e-6, 1e12)
    assert link_between({("a", "b"): fast}, "b", "a") is fast
    assert link_between({("a", "b"): fast}, "a", "c") == DEFAULT_LINK
    assert link_between(None, "a", "b") == DEFAULT_LINK


def test_auto_picks_the_first_feasible_candidate():
    nodes = [_node("a", 24 * GB), _node("b", 24 * GB), _node("c", 1 * GB)]
    links = _mesh("abc", Link(5e-6, 50e9))
    candidates = preview(_llama8b(), nodes, links, PlacementOptions(4096, 1))
    best = auto(_llama8b(), nodes, links, PlacementOptions(4096, 1))
    assert best == candidates[0] and best.feasible
    assert "c" not in best.node_ids  # every placement with the 1 GB node is refused
    with pytest.raises(PlacementError, match="no placement to try"):
        auto(_llama8b(), [], links, PlacementOptions(4096, 1))


def test_unknown_sharding_is_an_infeasible_candidate_and_unknown_dtype_is_refused():
    nodes = [_node("a"), _node("b")]
    candidates = preview(_smollm2(), nodes, {}, PlacementOptions(1024, 1, shardings=("pipeline", "zigzag")))
    zigzag = _find(candidates, "zigzag", 2)
    assert not zigzag.feasible and "not supported" in zigzag.error
    with pytest.raises(PlacementError, match="dtype 'int3'"):
        preview(_smollm2(), nodes, {}, PlacementOptions(1024, 1, dtype="int3"))
