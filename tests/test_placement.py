"""Pipeline placement: layer ranges follow capacity; refusals name the node and shortfall."""

import pytest

from shardline.placement.layer_ranges import NodeCapacity, PlacementError, pipeline_layer_ranges

pytestmark = [pytest.mark.fast, pytest.mark.timeout(30)]

GB = 1 << 30


def test_equal_nodes_get_equal_contiguous_ranges():
    nodes = [NodeCapacity(f"n{i}", 8 * GB) for i in range(3)]
    assert pipeline_layer_ranges(30, nodes, 1000) == [(0, 10), (10, 20), (20, 30)]


def test_uneven_memory_gives_uneven_ranges():
    nodes = [NodeCapacity("big", 12 * GB), NodeCapacity("small", 4 * GB)]
    ranges = pipeline_layer_ranges(32, nodes, 1000)
    assert ranges == [(0, 24), (24, 32)]


def test_every_node_gets_a_layer_and_counts_add_up():
    nodes = [NodeCapacity("a", 100 * GB), NodeCapacity("b", 1 * GB), NodeCapacity("c", 1 * GB)]
    ranges = pipeline_layer_ranges(5, nodes, 1)
    assert ranges[0][0] == 0 and ranges[-1][1] == 5
    assert all(end - start >= 1 for start, end in ranges)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(2))


def test_a_full_node_takes_no_more_than_fits():
    nodes = [NodeCapacity("small", 3_000), NodeCapacity("large", 100_000)]
    assert pipeline_layer_ranges(12, nodes, 1_000) == [(0, 1), (1, 12)]


def test_refusal_names_node_and_shortfall():
    with pytest.raises(PlacementError, match=r"node tiny needs at least 1000 bytes .*short by at least 500 bytes"):
        pipeline_layer_ranges(4, [NodeCapacity("roomy", 10_000), NodeCapacity("tiny", 500)], 1_000)
    with pytest.raises(PlacementError, match=r"node a fits 5 .* node b fits 5 .*short by 2000 bytes"):
        pipeline_layer_ranges(12, [NodeCapacity("a", 5_000), NodeCapacity("b", 5_500)], 1_000)


def test_more_nodes_than_layers_is_refused():
    with pytest.raises(PlacementError, match="only 2 layers"):
        pipeline_layer_ranges(2, [NodeCapacity(str(i), GB) for i in range(3)], 1)


def test_ring_admission_names_the_node_and_its_shortfall():
    from shardline.placement.ring import ring_admission, ring_working_bytes

    working = ring_working_bytes(1024, 2, 9, 3, 64, 576, 1536, 2)
    assert working > 2 * 4 * 9 * 512 * 512  # the float32 score blocks alone
    ok = [NodeCapacity("a", 10**9), NodeCapacity("b", 10**9)]
    ring_admission(ok, 4 * 10**8, 10**8, working)
    with pytest.raises(PlacementError, match=r"node b has 500000000 bytes available \(short by"):
        ring_admission([NodeCapacity("a", 10**9), NodeCapacity("b", 5 * 10**8)], 4 * 10**8, 10**8, working)
    with pytest.raises(PlacementError, match="at least 2 nodes"):
        ring_admission(ok[:1], 1, 1, 1)
