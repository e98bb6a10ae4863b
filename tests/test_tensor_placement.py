"""Tensor placement: head, KV-head and column shares; refusals say why and which node lacks
how many bytes."""

import pytest
from model_shapes import smollm2 as _config

from shardline.placement.layer_ranges import NodeCapacity, PlacementError
from shardline.placement.ranks import RankShare, model_param_count, place_ranks, rank_bytes, resident_bytes_per_weight
from shardline.placement.tensor import tensor_placement, tensor_rank_bytes, tensor_shares

pytestmark = [pytest.mark.fast, pytest.mark.timeout(30)]

GB = 1 << 30


def _nodes(n: int, available: int = 8 * GB) -> list[NodeCapacity]:
    return [NodeCapacity(f"n{i}", available) for i in range(n)]


def test_smollm2_on_two_ranks_replicates_one_kv_head():
    shares = tensor_shares(_config(), 2)
    assert [s.heads for s in shares] == [(0, 5), (5, 9)]
    assert [s.kv_heads for s in shares] == [(0, 1), (1, 2)]
    assert [s.columns for s in shares] == [(0, 768), (768, 1536)]
    assert [(s.rank, s.world_size) for s in shares] == [(0, 2), (1, 2)]


def test_smollm2_on_three_ranks_is_even():
    shares = tensor_placement(_config(), _nodes(3))
    assert [s.heads for s in shares] == [(0, 3), (3, 6), (6, 9)]
    assert [s.kv_heads for s in shares] == [(0,), (1,), (2,)]
    assert [s.columns for s in shares] == [(0, 512), (512, 1024), (1024, 1536)]


def test_columns_split_in_blocks_of_32_larger_first():
    shares = tensor_shares(_config(intermediate_size=160, hidden_size=576), 3)
    assert [s.columns for s in shares] == [(0, 64), (64, 128), (128, 160)]
    for s in tensor_shares(
        _config(num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096, intermediate_size=11008), 3
    ):
        assert s.columns[0] % 32 == 0 and s.columns[1] % 32 == 0


def test_shares_cover_every_head_and_column_once():
    config = _config(num_heads=14, num_kv_heads=2, head_dim=64, hidden_size=896, intermediate_size=4864)  # Qwen2-0.5B
    for world in range(1, 15):
        shares = tensor_shares(config, world)
        assert shares[0].heads[0] == 0 and shares[-1].heads[1] == 14
        assert shares[0].columns[0] == 0 and shares[-1].columns[1] == 4864
        for a, b in zip(shares, shares[1:]):
            assert a.heads[1] == b.heads[0] and a.columns[1] == b.columns[0]
            assert a.num_heads - b.num_heads in (0, 1)
        for s in shares:
            s.check(config)
            assert set(s.kv_heads) == {h // 7 for h in range(*s.heads)}


def test_one_rank_holds_everything():
    (share,) = tensor_shares(_config(intermediate_size=1000), 1)
    assert share.heads == (0, 9) and share.kv_heads == (0, 1, 2) and share.columns == (0, 1000)


def test_more_ranks_than_heads_is_refused():
    with pytest.raises(PlacementError, match="10 tensor ranks but only 9 attention heads"):
        tensor_placement(_config(), _nodes(10))


def test_intermediate_not_splittable_is_refused():
    with pytest.raises(PlacementError, match="intermediate size 1000 is not a multiple of 32"):
        tensor_shares(_config(intermediate_size=1000), 2)
    with pytest.raises(PlacementError, match="only 2 blocks of 32 columns for 3 tensor ranks"):
        tensor_shares(_config(intermediate_size=64), 3)


def test_no_nodes_is_refused():
    with pytest.raises(PlacementError, match="no nodes"):
        tensor_placement(_config(), [])


def test_rank_bytes_count_the_share():
    config = _config()
    shares = tensor_shares(config, 3)
    per_rank = [tensor_rank_bytes(config, s, weight_bytes=2) for s in shares]
    embed = 49152 * 576 * 2
    layer_elements = 576 * (192 + 2 * 64) + 192 * 576 + 3 * 576 * 512
    assert per_rank[1] == per_rank[2] == 30 * (layer_elements + 2 * 576) * 2 + embed
    assert per_rank[0] == per_rank[1] + 576 * 2  # a tied head in bf16 adds the final norm
    # The KV cache holds only the rank's KV heads: 1 of 3.
    with_cache = tensor_rank_bytes(config, shares[1], kv_tokens=4096 * 8)
    without = tensor_rank_bytes(config, shares[1])
    assert with_cache - without == config.kv_bytes_per_token() // 3 * 4096 * 8


def test_refusal_names_the_node_and_shortfall():
    config = _config()
    shares = tensor_shares(config, 2)
    need = [tensor_rank_bytes(config, s, kv_tokens=2048 * 4) for s in shares]
    nodes = [NodeCapacity("roomy", 8 * GB), NodeCapacity("tiny", need[1] - 1000)]
    with pytest.raises(PlacementError) as info:
        tensor_placement(config, nodes, kv_tokens=2048 * 4)
    message = str(info.value)
    assert f"node tiny (rank 1: heads 5-8, KV heads [1, 2], MLP columns 768-1535) needs {need[1]} bytes" in message
    assert "short by 1000 bytes" in message
    assert "roomy" not in message
    # Enough bytes: placed.
    nodes = [NodeCapacity("a", need[0]), NodeCapacity("b", need[1])]
    assert tensor_placement(config, nodes, kv_tokens=2048 * 4) == shares


def test_a_forced_placement_skips_memory_but_not_shapes():

    starved = _nodes(3, available=1_000_000)
    for sharding in ("pipeline", "tensor", "ring"):
        with pytest.raises(PlacementError, match="short by"):
            place_ranks(_config(), sharding, starved, 4096, 8)
    # Forced: layer ranges still follow memory (the 1 MB node gets the one layer it must).
    uneven = [NodeCapacity("big", 12 * GB), NodeCapacity("small", 4 * GB), NodeCapacity("tiny", 10**6)]
    shares = place_ranks(_config(), "pipeline", uneven, 4096, 8, admit=False)
    assert [(s.layer_start, s.layer_end) for s in shares] == [(0, 22), (22, 29), (29, 30)]
    assert len(place_ranks(_config(), "tensor", starved, 4096, 8, admit=False)) == 3
    assert len(place_ranks(_config(), "ring", starved, 4096, 8, admit=False)) == 3
    with pytest.raises(PlacementError, match="at least 2 nodes"):
        place_ranks(_config(), "ring", starved[:1], 4096, 8, admit=False)
    with pytest.raises(PlacementError, match="each tensor rank needs at least one head"):
        place_ranks(_config(), "tensor", _nodes(10, available=1), 4096, 8, admit=False)


def test_resident_bytes_follow_the_files_bits():
    """A 4-bit file's weights count about its own bytes (15% margin for int4 planes'
    scales); a 16-bit file's count the compute dtype's; an unknown size counts the dtype."""
    config = _config()
    params = model_param_count(config)
    q4 = resident_bytes_per_weight(config, int(0.6 * params), "bfloat16")
    assert q4 == pytest.approx(1.15 * 0.6, rel=1e-6)
    assert resident_bytes_per_weight(config, 2 * params, "float32") == 4
    assert resident_bytes_per_weight(config, 0, "bfloat16") == 2
    small = place_ranks(config, "pipeline", [NodeCapacity("a", GB)], 512, 1, weight_file_bytes=int(0.6 * params))
    assert small == [RankShare(0, config.num_layers)]
    # A node that holds the model counted in its file's bits cannot hold it at 2 bytes.
    need = rank_bytes(config, "pipeline", small, 0, 512, 1, weight_file_bytes=int(0.6 * params))
    tight = NodeCapacity("a", need)
    place_ranks(config, "pipeline", [tight], 512, 1, weight_file_bytes=int(0.6 * params))
    with pytest.raises(PlacementError, match="short by"):
        place_ranks(config, "pipeline", [tight], 512, 1)
