"""Profiles that hold, by tables: when a node measures its machine, what a request's timing
shows, how measured speeds correct the preview, and the decode model's per-layer and
weight-read terms."""

from __future__ import annotations

import pytest
from model_shapes import smollm2 as _smollm2

from shardline.cluster_commands import links_text, models_held, serving_by_node, speed_text
from shardline.models.config import RankShare
from shardline.models.store import DEFAULT_MODEL_ID
from shardline.node import speeds
from shardline.node.speeds import RequestTiming, disturbed, measure_due, node_idle
from shardline.node.status import RankStatus
from shardline.placement.preview import preview
from shardline.placement.ranks import PlacementOptions
from shardline.placement.served import (
    KEEP_SAMPLES,
    MIN_DECODE_STEPS,
    MIN_PREFILL_TOKENS,
    PlacementKey,
    ServedSpeed,
    calibrate,
    merge,
    record,
    request_rates,
    with_prediction,
)
from shardline.placement.speed import STEP_LAYERS, NodeProfile, attention_flops, oversubscription, predict_tokens_per_s

pytestmark = [pytest.mark.fast, pytest.mark.timeout(30)]

GB = 1 << 30
R, L, F, S = RankStatus.READY, RankStatus.LOADING, RankStatus.FETCHING, RankStatus.STOPPED


@pytest.mark.parametrize(
    "in_flight, busy, statuses, idle",
    [
        (0, [], [], True),  # no runner at all
        (0, [], [R, S, RankStatus.FAILED], True),  # runners that settled
        (1, [], [R], False),  # a request in flight
        (0, ["i1"], [R], False),  # a rank with requests
        (0, [], [R, L], False),  # a runner loading
        (0, [], [F], False),  # files being fetched
    ],
)
def test_node_idle(in_flight, busy, statuses, idle):
    assert node_idle(in_flight, busy, statuses) is idle


@pytest.mark.parametrize(
    "other_load_percent, idle",
    [
        (3.0, True),  # heartbeats and event loops
        (19.9, True),
        (20.0, False),  # another program at work on the machine's CPUs
        (95.0, False),  # e.g. llama-server decoding beside an idle node
    ],
)
def test_other_programs_load_makes_a_node_not_idle(other_load_percent, idle):
    assert node_idle(0, [], [R], other_load_percent) is idle


@pytest.mark.parametrize(
    "other_cores, cpus, disturbs",
    [
        (0.05, 2, False),  # the node's own heartbeats
        (0.39, 2, False),
        (0.41, 2, True),  # over a fifth of the machine
        (1.9, 2, True),  # llama-server decoding beside the measurement
        (1.5, 16, False),
        (0.0, 0, False),  # no CPU count read
    ],
)
def test_a_profile_measured_beside_other_work_is_disturbed(other_cores, cpus, disturbs):
    assert disturbed(other_cores, cpus) is disturbs


@pytest.mark.parametrize(
    "busy_s, own_s, wall_s, cores",
    [(3.0, 2.0, 1.0, 1.0), (2.0, 2.0, 1.0, 0.0), (1.9, 2.0, 1.0, 0.0), (1.0, 0.0, 0.0, 0.0)],
)
def test_other_cores(busy_s, own_s, wall_s, cores):
    from shardline.node.profile import other_cores

    assert other_cores(busy_s, own_s, wall_s) == pytest.approx(cores)


@pytest.mark.parametrize(
    "now, idle_since, measured_at, guess, due",
    [
        (100, None, None, False, False),  # busy: never
        (100, 100, None, False, False),  # nothing to go on: after FIRST_IDLE_S (3 s) idle,
        (103, 100, None, False, True),  # not at the start, where a placement comes at once
        (100, 95, None, True, False),  # a cached guess: after IDLE_S (10 s) idle
        (100, 90, None, True, True),
        (4000, 3990, 100, True, True),  # an hour since the last, idle long enough
        (4000, 3999, 100, True, False),  # not idle long enough yet
        (3000, 1000, 100, True, False),  # within the hour
    ],
)
def test_measure_due(now, idle_since, measured_at, guess, due):
    assert measure_due(now, idle_since, measured_at, guess, idle_s=10, interval_s=3600) is due


@pytest.mark.parametrize(
    "prompt, cached, ttft, steps, plain_s, alone, started_alone, want",
    [
        # 8 plain steps in 0.1 s: 80 tok/s; 512 prompt tokens in 0.25 s
        (512, 0, 0.25, 8, 0.1, True, True, (80.0, 2048.0)),
        (512, 0, 0.25, 8, 0.1, False, True, (None, 2048.0)),  # shared the batch while decoding
        (512, 0, 0.25, 8, 0.1, True, False, (80.0, None)),  # something else ran at its start
        (MIN_PREFILL_TOKENS - 1, 0, 0.25, 8, 0.1, True, True, (80.0, None)),  # prompt too short
        (512, 32, 0.24, 8, 0.1, True, True, (80.0, 2000.0)),  # a chat template's header cached
        (512, 65, 0.25, 8, 0.1, True, True, (80.0, None)),  # a next turn: resumed from its cache
        (512, 0, 0.25, MIN_DECODE_STEPS - 1, 0.1, True, True, (None, 2048.0)),  # too few plain steps
        (512, 0, None, 0, 0.0, True, True, (None, None)),  # no token at all
    ],
)
def test_request_rates(prompt, cached, ttft, steps, plain_s, alone, started_alone, want):
    got = request_rates(prompt, cached, ttft, steps, plain_s, alone, started_alone)
    assert tuple(None if rate is None else round(rate, 6) for rate in got) == want


def test_a_request_that_speculated_is_timed_by_its_plain_steps(monkeypatch):
    """Tokens reach the node a step at a time: a drafted step's (here 4 tokens, 30 ms
    after the step before) are left out, the plain ones (10 ms each) give the rate."""
    clock = [100.0]
    monkeypatch.setattr(speeds.time, "monotonic", lambda: clock[0])
    timing = RequestTiming.start(7, 600, {"running": []})
    steps = [(0.2, 0, 1)] + [(0.01, 0, 1)] * 4 + [(0.03, 5, 4)] + [(0.01, 0, 1)] * 4 + [(0.03, 8, 2)]
    for seconds, drafted, tokens in steps:
        clock[0] += seconds
        for _ in range(tokens):
            timing.token({"running": [7]}, drafted, cached_tokens=0)
    decode, prefill = timing.rates()
    assert timing.generated == 15 and timing.plain_steps == 8
    assert decode == pytest.approx(100.0) and prefill == pytest.approx(3000.0)
    # the same prompt resumed from a cache: no prefill rate
    timing = RequestTiming.start(8, 600, None)
    for _ in range(9):
        clock[0] += 0.01
        timing.token(None, 0, cached_tokens=512)
    assert timing.rates() == (pytest.approx(100.0), None)


KEY = PlacementKey("m", "pipeline", ("a",), "bfloat16", None)


def test_record_keeps_the_newest_samples_and_the_median():
    speed = None
    for i in range(KEEP_SAMPLES + 4):
        speed = record(speed, KEY, float(i), None if i % 2 else 1000.0, position=100.0 + i, at=i)
    assert speed is not None
    assert speed.decode_samples == tuple(float(i) for i in range(4, KEEP_SAMPLES + 4))
    assert speed.decode_tokens_per_s == pytest.approx((11 + 12) / 2)
    assert speed.context == 2 * (100 + 11.5)  # twice the median position: the preview's context
    assert speed.prefill_tokens_per_s == 1000.0 and len(speed.prefill_samples) == KEEP_SAMPLES // 2 + 2
    # a prefill-only request adds no decode sample nor position
    assert record(speed, KEY, None, 5.0, 9999.0, 50).decode_positions == speed.decode_positions
    speed = with_prediction(speed, (50.0, 900.0))
    assert (speed.predicted_decode_tokens_per_s, speed.at) == (50.0, KEEP_SAMPLES + 3)
    assert ServedSpeed.from_dict(speed.to_dict()) == speed  # its JSON form reads back
    assert ServedSpeed(KEY).context is None


def test_merge_keeps_the_newest_record_of_each_placement():
    old, new = ServedSpeed(KEY, (1.0,), at=1), ServedSpeed(KEY, (2.0,), at=2)
    other = ServedSpeed(PlacementKey("m", "pipeline", ("b",)), (3.0,), at=0)
    assert merge([new, old, other]) == {KEY: new, other.key: other}


def _served(nodes, decode, prefill, predicted=(100.0, 1000.0), model="m", sharding="pipeline"):
    return ServedSpeed(
        PlacementKey(model, sharding, nodes),
        (decode,) if decode else (),
        (prefill,) if prefill else (),
        (100.0,) if decode else (),
        *predicted,
    )


@pytest.mark.parametrize(
    "key_nodes, speeds, want",
    [
        # nothing measured: the model's figures
        (("a",), [], (100.0, 1000.0, "model", "model")),
        # the same placement: its measured figures
        (("a",), [_served(("a",), 60.0, 2000.0)], (60.0, 2000.0, "measured", "measured")),
        # measured decode only: prefill scaled by nothing else, so the model's
        (("a",), [_served(("a",), 60.0, None)], (60.0, 1000.0, "measured", "model")),
        # a single node of the candidate measured: the model times its measured/predicted ratio
        (("a", "b"), [_served(("a",), 50.0, 3000.0)], (50.0, 3000.0, "scaled", "scaled")),
        # ratios of two related placements: their median (0.5 and 1.0 -> 0.75)
        (("a", "b"), [_served(("a",), 50.0, None), _served(("b",), 100.0, None)], (75.0, 1000.0, "scaled", "model")),
        # unrelated: other nodes, or another model
        (
            ("a",),
            [_served(("c",), 10.0, 10.0), _served(("a",), 10.0, 10.0, model="x")],
            (100.0, 1000.0, "model", "model"),
        ),
    ],
)
def test_calibrate(key_nodes, speeds, want):
    got = calibrate(PlacementKey("m", "pipeline", key_nodes), (100.0, 1000.0), speeds)
    assert got == pytest.approx(want)


def _node(name, o=0.0, weight_rate=0.0, bandwidth=10e9, flops=1e12):
    return NodeProfile(name, 64 * GB, bandwidth, flops, o, weight_rate)


def test_decode_model_adds_layer_cost_and_reads_weights_at_the_products_rate():
    config = _smollm2()
    one = [RankShare(0, config.num_layers)]
    base = predict_tokens_per_s(config, "pipeline", [_node("a")], one, {}, 2048, decode_weight_bytes=0.5)
    layered = predict_tokens_per_s(config, "pipeline", [_node("a", o=2e-4)], one, {}, 2048, decode_weight_bytes=0.5)
    # 1/decode grows by exactly (L + STEP_LAYERS) * o; prefill by L * o / 512 a token
    assert 1 / layered[0] - 1 / base[0] == pytest.approx((config.num_layers + STEP_LAYERS) * 2e-4)
    assert 1 / layered[1] - 1 / base[1] == pytest.approx(config.num_layers * 2e-4 / 512)
    # the product's measured rate replaces the bandwidth for the weights, below it or
    # above it (a copy's bandwidth counts a write too); the prefill does not change
    slow = predict_tokens_per_s(
        config, "pipeline", [_node("a", weight_rate=5e9)], one, {}, 2048, decode_weight_bytes=0.5
    )
    fast = predict_tokens_per_s(
        config, "pipeline", [_node("a", weight_rate=50e9)], one, {}, 2048, decode_weight_bytes=0.5
    )
    assert slow[0] < base[0] < fast[0] and slow[1] == fast[1] == pytest.approx(base[1])
    weights = 0.5 * (
        config.num_layers * (config.layer_param_count() - 2 * config.hidden_size)
        + config.vocab_size * config.hidden_size
    )
    assert 1 / slow[0] - 1 / base[0] == pytest.approx(weights / 5e9 - weights / 10e9)
    assert 1 / base[0] - 1 / fast[0] == pytest.approx(weights / 10e9 - weights / 50e9)


@pytest.mark.parametrize("sharding", ["pipeline", "tensor", "ring"])
def test_every_sharding_pays_the_layer_cost(sharding):
    config = _smollm2()
    plain = preview(config, [_node("a"), _node("b")], {}, PlacementOptions(2048, 4, shardings=(sharding,), min_nodes=2))
    costly = preview(
        config,
        [_node("a", o=1e-3), _node("b", o=1e-3)],
        {},
        PlacementOptions(2048, 4, shardings=(sharding,), min_nodes=2),
    )
    assert costly[0].feasible and costly[0].model_decode_tokens_per_s < plain[0].model_decode_tokens_per_s


@pytest.mark.parametrize("sharding", ["pipeline", "tensor", "ring"])
def test_the_step_beside_the_layers_costs_the_host_cpu_layers(sharding):
    """A GPU node's layer cost is its replayed graph's; the sampler, the engine loop and the
    token's way to the node run on its CPU: STEP_LAYERS of the host's layer cost, not of
    the device's (a CPU node gives the same figure for both)."""
    from dataclasses import replace

    config = _smollm2()
    gpus = [_node("a", o=6e-5), _node("b", o=6e-5)]
    (base,) = preview(config, gpus, {}, PlacementOptions(2048, 4, shardings=(sharding,), min_nodes=2))
    (hosted,) = preview(
        config,
        [replace(g, host_layer_s=2e-4) for g in gpus],
        {},
        PlacementOptions(2048, 4, shardings=(sharding,), min_nodes=2),
    )
    assert 1 / hosted.model_decode_tokens_per_s - 1 / base.model_decode_tokens_per_s == pytest.approx(
        STEP_LAYERS * (2e-4 - 6e-5)
    )
    # prefill's chunks pay the device's layers
    assert hosted.predicted_prefill_tokens_per_s == pytest.approx(base.predicted_prefill_tokens_per_s)


def test_preview_ranks_by_measured_speed():
    """The model prefers one node to a pipeline over two (no link to pay); once both
    served, what they measured decides, and the model's figures stay beside it."""
    config = _smollm2()
    nodes = [_node("a"), _node("b")]
    first = preview(config, nodes, {}, PlacementOptions(2048, 4, shardings=("pipeline",)), model_id="m")
    assert [c.node_ids for c in first] == [("a",), ("a", "b")]
    assert first[0].decode_basis == "model"
    served = [_served(("a",), 30.0, None), _served(("a", "b"), 45.0, None)]
    later = preview(config, nodes, {}, PlacementOptions(2048, 4, shardings=("pipeline",)), model_id="m", served=served)
    assert [c.node_ids for c in later] == [("a", "b"), ("a",)]
    assert later[0].predicted_decode_tokens_per_s == 45.0 and later[0].decode_basis == "measured"
    assert later[1].model_decode_tokens_per_s == first[0].model_decode_tokens_per_s


@pytest.mark.parametrize(
    "predicted, measured, samples, text",
    [(95.04, 101.2, 3, "95.0 / 101 (3)"), (None, None, 0, "- / -"), (2345.6, None, 0, "2,346 / -")],
)
def test_speed_text(predicted, measured, samples, text):
    assert speed_text(predicted, measured, samples) == text


def test_nodes_list_the_models_they_serve():
    """``shardline nodes`` showed "models: -" for a node serving the embedded model
    (that column is the node's store, which the packaged GGUF is not in)."""

    def inst(model, status, *nodes):
        return {"model_id": model, "status": status, "ranks": [{"node_id": n} for n in nodes]}

    table = [
        inst("a", "ready", "n1", "n2"),
        inst("b", "loading", "n2"),
        inst("a", "ready", "n2"),
        inst("c", "failed", "n3"),
    ]
    assert serving_by_node(table) == {"n1": ["a"], "n2": ["a", "b"]}


@pytest.mark.parametrize(
    "node, held",
    [
        # a live node holds the embedded default (models list says so), then its store's
        ({"live": True, "models": {}}, f"{DEFAULT_MODEL_ID} (embedded)"),
        (
            {"live": True, "models": {"q": {"complete": True}, "r": {"complete": False}}},
            f"{DEFAULT_MODEL_ID} (embedded), q, r (part)",
        ),
        # the default also in the store: listed once
        ({"live": True, "models": {DEFAULT_MODEL_ID: {"complete": True}}}, f"{DEFAULT_MODEL_ID} (embedded)"),
        # a node that is down: its last report's store only
        ({"live": False, "models": {"q": {"complete": True}}}, "q"),
        ({"live": False}, "-"),
    ],
)
def test_models_held(node, held):
    assert models_held(node) == held


def test_links_text():
    """Trial 5: the links a node measured were only in the cluster API's JSON."""
    links = {
        "c0a1a8cff8d2": {"rtt_s": 0.0018, "bandwidth_bytes_per_s": 253349357.0},
        "2fdda2d0f921": {"rtt_s": 0.2108, "bandwidth_bytes_per_s": 250000.0},
    }
    assert links_text({"links": links}) == "2fdd: 210.8 ms, 250 kB/s\nc0a1: 1.8 ms, 253 MB/s"
    assert links_text({"links": {}}) == links_text({}) == "-"


def test_calibrate_carries_a_ratio_only_within_its_sharding_and_nodes_or_from_one_node():
    """A tensor placement measured at 2x its prediction says little of a pipeline's error
    (its links and all-reduces are its own), nor a placement of several nodes of another
    node set's (trial 5: a pipeline over a rate-limited link at 4.6x its prediction
    raised a single node to 380 tokens/s); a one-node placement's ratio (the machine's
    error) applies to any placement on its node, after the same sharding's on the same
    nodes."""
    key = PlacementKey("m", "pipeline", ("a", "b"))
    tensor = _served(("a", "b"), 200.0, 2000.0, sharding="tensor")
    assert calibrate(key, (100.0, 1000.0), [tensor]) == (100.0, 1000.0, "model", "model")
    alone = _served(("b",), 50.0, None)
    assert calibrate(key, (100.0, 1000.0), [tensor, alone]) == (50.0, 1000.0, "scaled", "model")
    # a pipeline of other nodes, a and b among them: not carried
    pipeline3 = _served(("a", "b", "c"), 460.0, 500.0)
    assert calibrate(key, (100.0, 1000.0), [tensor, alone, pipeline3]) == (50.0, 1000.0, "scaled", "model")
    assert calibrate(PlacementKey("m", "pipeline", ("a",)), (100.0, 1000.0), [pipeline3]) == (
        100.0,
        1000.0,
        "model",
        "model",
    )
    # the same nodes in another order: carried, before the single node's
    reversed_order = _served(("b", "a"), 80.0, 500.0)
    assert calibrate(key, (100.0, 1000.0), [tensor, alone, reversed_order]) == pytest.approx(
        (80.0, 500.0, "scaled", "scaled")
    )
    ring_key = PlacementKey("m", "ring", ("a", "b"))
    assert calibrate(ring_key, (100.0, 1000.0), [tensor, alone])[0::2] == (50.0, "scaled")


def test_preview_lists_a_measured_placement_in_its_own_rank_order():
    """``shardline cluster`` places a pipeline in node order; the preview's own candidates
    rank nodes by free memory. The measured order is listed with its figures."""
    config = _smollm2()
    nodes = [
        NodeProfile("a", 32 * GB, 10e9, 1e12),
        NodeProfile("b", 64 * GB, 10e9, 1e12),
        NodeProfile("c", 48 * GB, 10e9, 1e12),
    ]
    served = [
        _served(("a", "b", "c"), 40.0, 900.0),
        _served(("c",), 70.0, None),  # another single node than the preview's b
        _served(("a", "b"), 30.0, None, sharding="tensor"),  # not asked for
        _served(("a", "d"), 30.0, None),  # a node that is gone
        _served(("c", "b"), 30.0, None, model="x"),
    ]  # another model
    got = preview(config, nodes, {}, PlacementOptions(2048, 4, shardings=("pipeline",)), model_id="m", served=served)
    listed = {c.node_ids: c for c in got}
    assert set(listed) == {("b",), ("b", "c"), ("b", "c", "a"), ("a", "b", "c"), ("c",)}
    assert listed[("a", "b", "c")].predicted_decode_tokens_per_s == 40.0
    assert listed[("a", "b", "c")].decode_basis == "measured"
    assert listed[("c",)].decode_basis == "measured"
    assert listed[("b", "c", "a")].decode_basis == "scaled"
    # bounds still hold: at most two nodes leaves the measured three out
    capped = preview(
        config, nodes, {}, PlacementOptions(2048, 4, shardings=("pipeline",), max_nodes=2), model_id="m", served=served
    )
    assert {c.node_ids for c in capped} == {("b",), ("b", "c"), ("c",)}


@pytest.mark.parametrize(
    "nodes, want",
    [
        # three one-thread nodes on one 2-CPU host: 3 threads over 2 CPUs
        ([("h", 2, 1), ("h", 2, 1), ("h", 2, 1)], [1.5, 1.5, 1.5]),
        # two nodes on two machines, or on one with CPUs to spare: nothing shared
        ([("h", 2, 1), ("g", 2, 1)], [1.0, 1.0]),
        ([("h", 8, 2), ("h", 8, 2)], [1.0, 1.0]),
        # torch's default threads (0) use every CPU: two such nodes on one host double up
        ([("h", 4, 0), ("h", 4, 0), ("g", 4, 0)], [2.0, 2.0, 1.0]),
        # an unknown host or CPU count shares with none
        ([("", 2, 1), ("", 2, 1)], [1.0, 1.0]),
        ([("h", 0, 1), ("h", 0, 1)], [1.0, 1.0]),
    ],
)
def test_oversubscription(nodes, want):
    profiles = [
        NodeProfile(f"n{i}", GB, 10e9, 1e12, host_id=h, cpu_count=c, threads=t) for i, (h, c, t) in enumerate(nodes)
    ]
    assert oversubscription(profiles) == pytest.approx(want)


def test_nodes_sharing_a_machine_slow_overlapped_prefill_not_pipeline_decode():
    config = _smollm2()
    shares = [RankShare(0, 10), RankShare(10, 20), RankShare(20, config.num_layers)]

    def nodes(host):
        return [
            NodeProfile(f"n{i}", 64 * GB, 10e9, 1e11, 2e-4, host_id=host(i), cpu_count=2, threads=1) for i in range(3)
        ]

    long = 100 * 512  # so many chunks that the slowest stage alone bounds the rate
    apart = predict_tokens_per_s(config, "pipeline", nodes(lambda i: f"h{i}"), shares, {}, 2048, prompt_tokens=long)
    together = predict_tokens_per_s(config, "pipeline", nodes(lambda i: "h"), shares, {}, 2048, prompt_tokens=long)
    assert together[0] == pytest.approx(apart[0])  # one sequence's stages run in turn
    assert together[1] == pytest.approx(apart[1] / 1.5, rel=0.02)  # the slowest stage, 1.5x slower
    # a prompt of one chunk runs its stages in turn: no overlap, nothing shared
    one = [
        predict_tokens_per_s(config, "pipeline", nodes(h), shares, {}, 2048, prompt_tokens=512)
        for h in (lambda i: f"h{i}", lambda i: "h")
    ]
    assert one[0][1] == pytest.approx(one[1][1])
    stage = (
        1
        / predict_tokens_per_s(
            config, "pipeline", nodes(lambda i: f"h{i}")[:1], [shares[0]], {}, 2048, prompt_tokens=512
        )[1]
    )
    hop = 1e-3 / 512 + 576 * 2 / 100e6  # the default link: latency a token, then bytes
    assert 1 / one[0][1] == pytest.approx(3 * stage + 2 * hop)  # 3 equal stages in turn, 2 hops
    ring_apart = predict_tokens_per_s(
        config, "ring", nodes(lambda i: f"h{i}")[:2], [RankShare(0, config.num_layers)] * 2, {}, 2048
    )
    ring_together = predict_tokens_per_s(
        config, "ring", nodes(lambda i: "h")[:2], [RankShare(0, config.num_layers)] * 2, {}, 2048
    )
    assert ring_together == pytest.approx(ring_apart)  # 2 threads on 2 CPUs: no contention


def test_a_long_prompt_prefills_slower_by_its_attention():
    config = _smollm2()
    one = [RankShare(0, config.num_layers)]
    node = [NodeProfile("a", 64 * GB, 10e9, 1e11)]
    chunk = predict_tokens_per_s(config, "pipeline", node, one, {}, 4096)
    assert predict_tokens_per_s(config, "pipeline", node, one, {}, 4096, prompt_tokens=300) == chunk
    long = predict_tokens_per_s(config, "pipeline", node, one, {}, 4096, prompt_tokens=2560)
    assert long[0] == chunk[0]
    extra = config.num_layers * attention_flops(config.num_heads * config.head_dim, 2560) / 1e11
    assert 1 / long[1] - 1 / chunk[1] == pytest.approx(extra)
    assert attention_flops(config.num_heads * config.head_dim, 2560) == pytest.approx(4 * 576 * (2560 - 512) / 2)


def test_record_keeps_each_prefill_samples_prompt_length():
    speed = record(None, KEY, None, 900.0, 0.0, 1.0, prompt_tokens=300)
    speed = record(speed, KEY, 50.0, None, 40.0, 2.0, prompt_tokens=20)  # no prefill sample
    speed = record(speed, KEY, None, 700.0, 0.0, 3.0, prompt_tokens=2600)
    speed = record(speed, KEY, None, 800.0, 0.0, 4.0, prompt_tokens=1000)
    assert speed.prefill_lengths == (300, 2600, 1000) and speed.prompt_tokens == 1000
    assert ServedSpeed.from_dict(speed.to_dict()) == speed
    assert ServedSpeed(KEY).prompt_tokens is None


def test_one_node_of_a_machine_measures_it_at_a_time(tmp_path):
    """The profile lock: a second holder is refused while the first measures, and gets it
    after; no cache file, nothing shared."""
    from shardline.node.speeds import _machine_lock

    cache = tmp_path / "host-profile.json"
    with _machine_lock(cache) as first:
        with _machine_lock(cache) as second:
            assert first and not second
    with _machine_lock(cache) as again:
        assert again
    with _machine_lock(None) as alone:
        assert alone


@pytest.mark.parametrize("sharding, feasible", [("tensor", True), ("ring", False)])
def test_one_node_under_tensor_or_ring_alone_is_listed(sharding, feasible):
    """Tensor on one node places (one rank) and ring refuses it; the preview listed
    neither, and the CLI said "no placement fits" with no reason."""
    config = _smollm2()
    [got] = preview(config, [_node("a")], {}, PlacementOptions(2048, 4, shardings=(sharding,)))
    assert (got.sharding, got.node_ids, got.feasible) == (sharding, ("a",), feasible)
    assert feasible or "at least 2 nodes" in got.error
    both = preview(config, [_node("a")], {}, PlacementOptions(2048, 4, shardings=("pipeline", sharding)))
    assert [c.sharding for c in both] == ["pipeline"]  # the same placement, listed once
