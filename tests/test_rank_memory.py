"""What each rank is counted to hold, and what a node has left after placements: tables
over pure functions (no processes)."""

import pytest
from model_shapes import smollm2 as smollm2_config

from shardline.placement.layer_ranges import NodeCapacity, PlacementError, pipeline_layer_ranges
from shardline.placement.memory import (
    RUNNER_EXTRA_BYTES,
    RUNTIME_BASELINE_BYTES,
    committed_bytes,
    free_bytes,
    gpu_bytes,
    prefill_scratch_bytes,
    runtime_baseline,
)
from shardline.placement.ranks import (
    ContextRequestError,
    KVCacheRequestError,
    PlacementOptions,
    RankShare,
    check_context,
    draft_hint,
    draft_model_bytes,
    kv_pool_tokens,
    kv_tokens_for_bytes,
    model_param_count,
    place_ranks,
    place_with_kv_pool,
    rank_bytes,
    with_draft_model,
)

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]

MB = 1 << 20
FILE = 101_885_989  # SmolLM2-135M Q4_1's GGUF


@pytest.mark.parametrize(
    "ranks, node, expected", [([], "a", 0), ([("a", 5), ("b", 7), ("a", 11)], "a", 16), ([("a", 5), ("b", 7)], "c", 0)]
)
def test_committed_bytes_sum_the_nodes_ranks(ranks, node, expected):
    assert committed_bytes(ranks, node) == expected


@pytest.mark.parametrize("offered, committed, expected", [(100, 0, 100), (100, 40, 60), (100, 100, 0), (100, 150, 0)])
def test_free_bytes_never_go_below_zero(offered, committed, expected):
    assert free_bytes(offered, committed) == expected


def test_one_rank_holds_about_the_file_plus_runtime_cache_and_scratch():
    config = smollm2_config()
    need = rank_bytes(
        config, "pipeline", [RankShare(0, 30)], 0, context=256, max_batch=1, dtype="bfloat16", weight_file_bytes=FILE
    )
    kv = 256 * config.kv_bytes_per_token(2)
    weights = (
        need
        - RUNTIME_BASELINE_BYTES
        - kv
        - prefill_scratch_bytes(
            config.hidden_size, config.intermediate_size, 2 * config.intermediate_size * config.hidden_size, 2
        )
    )
    assert FILE <= weights <= 1.16 * FILE  # the tied head shares the embedding


@pytest.mark.parametrize("sharding", ["pipeline", "tensor"])
def test_ranks_of_three_add_up_to_about_one_node_plus_two_runtimes(sharding):
    config = smollm2_config()
    nodes = [NodeCapacity(n, 8 << 30) for n in "abc"]
    shares = place_ranks(config, sharding, nodes, 256, 1, weight_file_bytes=FILE)
    three = [rank_bytes(config, sharding, shares, r, 256, 1, "bfloat16", FILE) for r in range(3)]
    one = rank_bytes(config, "pipeline", [RankShare(0, 30)], 0, 256, 1, "bfloat16", FILE)
    fixed = RUNTIME_BASELINE_BYTES + prefill_scratch_bytes(
        config.hidden_size, config.intermediate_size, 2 * config.intermediate_size * config.hidden_size, 2
    )
    extra = sum(three) - one - 2 * fixed
    # Pipeline: the last rank's tied head is a second copy of the embedding; tensor: every
    # rank holds the embedding, and KV head 1 sits on two ranks.
    embed = 1.15 * FILE / model_param_count(config) * config.vocab_size * config.hidden_size
    assert 0 <= extra <= 2.05 * embed, (three, one)


def test_pipeline_ranges_leave_room_for_each_ranks_fixed_bytes():
    nodes = [NodeCapacity("a", 100), NodeCapacity("b", 100)]
    # 10 layers of 10 bytes; rank 0 must also hold 60 bytes (embedding, runtime).
    assert pipeline_layer_ranges(10, nodes, 10, fixed_bytes=[60, 0]) == [(0, 4), (4, 10)]
    with pytest.raises(PlacementError, match="node a needs at least 70 bytes"):
        pipeline_layer_ranges(10, [NodeCapacity("a", 69), NodeCapacity("b", 1000)], 10, fixed_bytes=[60, 0])


def test_the_default_context_does_not_fit_under_400_mb_a_node():
    """4096 tokens x 8 sequences of SmolLM2's KV cache (755 MB) fit neither one node
    capped at 400 MB nor three; a small context fits one node capped at 500 MB, and the
    rank is counted to hold less than that."""
    config = smollm2_config()
    capped = [NodeCapacity(n, 400 * MB) for n in "abc"]
    for on in (capped[:1], capped):
        with pytest.raises(PlacementError, match="short by"):
            place_ranks(config, "pipeline", on, 4096, 8, weight_file_bytes=FILE)
    shares = place_ranks(config, "pipeline", [NodeCapacity("a", 500 * MB)], 256, 1, weight_file_bytes=FILE)
    assert rank_bytes(config, "pipeline", shares, 0, 256, 1, "bfloat16", FILE) <= 500 * MB


@pytest.mark.parametrize(
    "measured, expected",
    [
        ([], RUNTIME_BASELINE_BYTES),
        ([0, 0], RUNTIME_BASELINE_BYTES),
        ([224 * MB, 230 * MB], 230 * MB + RUNNER_EXTRA_BYTES),
        ([224 * MB, 0], RUNTIME_BASELINE_BYTES),  # an unmeasured node counts the default
        ([600 * MB, 0], 600 * MB + RUNNER_EXTRA_BYTES),  # a CUDA runtime, say
    ],
)
def test_runtime_baseline_is_the_largest_measured_else_the_default(measured, expected):
    assert runtime_baseline(measured) == expected


@pytest.mark.parametrize(
    "context, max_batch, asked, expected",
    [
        (4096, 8, None, 32768),  # max_batch sequences of context tokens
        (4096, 8, 10_000, 10_000),
        (4096, 8, 100_000, 32768),  # never more than the batch can use
    ],
)
def test_kv_pool_tokens(context, max_batch, asked, expected):
    assert kv_pool_tokens(context, max_batch, asked) == expected


def test_kv_cache_bytes_convert_to_tokens_and_must_hold_one_context():
    config = smollm2_config()  # 30 layers x 3 KV heads x 64 x 2 (K, V) x 2 bytes a token
    per_token = 23_040
    assert kv_tokens_for_bytes(config, 100 * per_token + 5, "bfloat16", 64) == 100
    assert kv_tokens_for_bytes(config, 100 * per_token, "float32", 50) == 50
    with pytest.raises(KVCacheRequestError, match=r"holds 99 tokens.*context \(100 tokens\)"):
        kv_tokens_for_bytes(config, 99 * per_token, "bfloat16", 100)


def test_the_default_pool_shrinks_to_what_fits_and_an_asked_one_does_not():
    """Under a 600 MB cap 8 sequences of 4096 tokens do not fit (755 MB of KV): the default
    pool is the most tokens that do, at least one context; an explicit pool is kept or
    refused."""
    config = smollm2_config()
    capped = [NodeCapacity("a", 600 * MB)]
    shares, tokens = place_with_kv_pool(config, "pipeline", capped, PlacementOptions(4096, 8), weight_file_bytes=FILE)
    assert 4096 <= tokens < 32768
    need = rank_bytes(config, "pipeline", shares, 0, 4096, 8, "bfloat16", FILE, kv_tokens=tokens)
    assert need <= 600 * MB
    with pytest.raises(PlacementError, match="short by"):  # one more token does not fit
        place_ranks(config, "pipeline", capped, 4096, 8, weight_file_bytes=FILE, kv_tokens=tokens + 1)
    roomy = [NodeCapacity("a", 4000 * MB)]
    assert place_with_kv_pool(config, "pipeline", roomy, PlacementOptions(4096, 8))[1] == 32768
    per_token = config.kv_bytes_per_token(2)  # bfloat16
    assert (
        place_with_kv_pool(
            config,
            "pipeline",
            capped,
            PlacementOptions(4096, 8, kv_cache_bytes=5000 * per_token),
            weight_file_bytes=FILE,
        )[1]
        == 5000
    )
    with pytest.raises(PlacementError, match="KV cache of 20000 tokens"):
        place_with_kv_pool(
            config,
            "pipeline",
            capped,
            PlacementOptions(4096, 8, kv_cache_bytes=20_000 * per_token),
            weight_file_bytes=FILE,
        )
    tiny = [NodeCapacity("a", 450 * MB)]
    with pytest.raises(PlacementError, match="KV cache of 4096 tokens"):  # not even one context
        place_with_kv_pool(config, "pipeline", tiny, PlacementOptions(4096, 8), weight_file_bytes=FILE)


@pytest.mark.parametrize(
    "context, trained, refused", [(8192, 8192, False), (1, 8192, False), (8193, 8192, True), (16384, 8192, True)]
)
def test_a_context_over_the_trained_one_is_refused(context, trained, refused):
    if refused:
        with pytest.raises(
            ContextRequestError, match=f"context {context} is over m's trained context of {trained} tokens"
        ):
            check_context(context, trained, "m")
    else:
        check_context(context, trained, "m")


@pytest.mark.parametrize(
    "profile, offered",
    [
        (None, None),  # no profile yet: the system's memory
        ({"accelerator": "cpu", "accelerator_total_bytes": 0}, None),
        ({"accelerator": "mps", "accelerator_total_bytes": 64 * 2**30}, None),  # unified: the system's
        ({"accelerator": "cuda:0 NVIDIA H200", "accelerator_total_bytes": 140 * 10**9}, 126 * 10**9),
        ({"accelerator": "cuda:1 NVIDIA L4", "accelerator_total_bytes": 0}, None),  # not measured
    ],
)
def test_a_node_computing_on_a_gpu_offers_most_of_its_memory(profile, offered):
    assert gpu_bytes(profile) == offered


def test_a_draft_model_counts_as_a_one_rank_instance_of_it_without_a_runtime():
    """The sampling rank's draft model: SmolLM2's weights, keys and values for the
    target's KV pool and a prefill chunk's scratch: a one-rank instance of it, less its
    runtime; a smaller pool, less."""
    config = smollm2_config()
    options = PlacementOptions(context=2048, max_batch=4, draft_model="m")
    alone = rank_bytes(config, "pipeline", [RankShare(0, 30)], 0, 2048, 4, weight_file_bytes=FILE)
    assert draft_model_bytes(config, FILE, options, 4 * 2048) == pytest.approx(alone - RUNTIME_BASELINE_BYTES, abs=8)
    smaller = draft_model_bytes(config, FILE, options, 5_555)
    assert draft_model_bytes(config, FILE, options, 4 * 2048) - smaller == (
        4 * 2048 - 5_555
    ) * config.kv_bytes_per_token(2)


@pytest.mark.parametrize(
    "sharding,free,draft,left,held",
    [
        ("pipeline", [100, 100], 30, [100, 70], [0, 30]),  # a pipeline's last samples
        ("tensor", [100, 100], 30, [70, 100], [30, 0]),  # the others' first
        ("pipeline", [100, 20], 30, [100, 0], [0, 30]),  # never below nothing
        ("ring", [100], 0, [100], [0]),
    ],
)
def test_the_sampling_ranks_node_sets_the_draft_model_aside(sharding, free, draft, left, held):
    nodes = [NodeCapacity(f"n{i}", b) for i, b in enumerate(free)]
    capacities, drafts = with_draft_model(sharding, nodes, draft)
    assert [c.available_bytes for c in capacities] == left and drafts == held
    assert [c.node_id for c in capacities] == [n.node_id for n in nodes]
    assert ("draft model" in draft_hint(draft)) == bool(draft)
