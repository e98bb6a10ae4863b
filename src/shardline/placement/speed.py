"""The speed model of a placement: predicted decode and prefill tokens/s.

:func:`predict_tokens_per_s` turns a placement (a sharding, its nodes in rank order and
their shares) and what the nodes measured of themselves (:class:`NodeProfile`: memory
bandwidth, matmul FLOP/s, a decode layer's fixed cost, the machine they share) and of
their links (:class:`Link`) into a rough, first-order estimate, documented formula by
formula in its docstring and its shardings' (:func:`_pipeline_speed`, :func:`_tensor_speed`,
:func:`_ring_speed`): good enough to rank candidates
(:mod:`shardline.placement.preview`), not a benchmark. What a placement then measures
while serving corrects it (:mod:`shardline.placement.served`).

Everything here is pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from shardline.models.config import ModelConfig, RankShare, Sharding, TensorShare
from shardline.placement.layer_ranges import PlacementError
from shardline.placement.ranks import DTYPE_BYTES, SHARDINGS, ring_prefill_chunk

POINT_TO_POINT_BYTES = 128 * 1024
"""The largest all-reduce (bytes, in the sum's dtype) a gloo group takes with
point-to-point sends (:func:`shardline.parallel.point_to_point.all_reduce`) rather than
gloo's ring all-reduce: a decode step's (8 rows of a 4,096 hidden size in
float32). ``scripts/collective_costs.py``, 3 ranks on a 2-vCPU VM: 128 KiB 1.50 ms by
gloo, 0.65 point-to-point; a 512-row chunk of SmolLM2's (1.2 MB) 2.7 against 4.3."""

DECODE_WEIGHT_BYTES = 1.0
"""Bytes decode reads per weight element where the caller gives none (8-bit weights)."""

PREFILL_CHUNK_TOKENS = 512
"""Prompt tokens per prefill chunk (per rank under ring); latencies are paid once a chunk."""

PREFILL_ACTIVATION_BYTES = 64.0
"""Bytes of memory traffic a prompt token's prefill costs per layer and per activation
element (``hidden_size + intermediate_size``) besides its products: the norms, rotary,
SiLU, products of gates, residual adds and causal attention over a 512-token chunk.
Fitted with torch.profiler on a 2-vCPU VM (SmolLM2-135M, one thread: 0.26 s of a
512-token chunk's 0.44 s of CPU time outside the products, ~8 ns an element at ~8 GB/s)."""

STEP_LAYERS = 3.0
"""What a decode step costs beyond its layers on the rank that samples, in a layer's fixed
cost on the host's CPU (``NodeProfile.host_layer_s``, else ``decode_layer_s``): the
embedding lookup, the final norm, the LM head's call and its float32 refinement (a top-k:
~0.4 ms a step on a 2-vCPU VM), the sampler, the engine loop and the token's way to the
node. An estimate from torch.profiler's count of those ops, not a fit (the served speeds
correct what it misses: :mod:`shardline.placement.served`). On a GPU the lookup, norm
and head run in the step's CUDA graph and the rest runs on the host, so the step's cost
beside its layers scales with the host CPU's layer cost, not with the GPU's replayed one
(on the H200 machine the two were alike: 0.05-0.07 ms)."""


@dataclass(frozen=True)
class NodeProfile:
    """A node as the preview sees it.

    Attributes:
        node_id: the node's id.
        available_bytes: bytes of memory the node can give a model.
        memory_bandwidth_bytes_per_s: bytes/s the node reads from memory (decode is bound
            by the weights and KV cache read per token).
        matmul_flops: floating-point operations/s the node sustains in matrix products
            (prefill is bound by these).
        decode_layer_s: seconds a decoder layer costs a one-sequence decode step besides
            reading its weights (its small ops; ``HostProfile.decode_layer_s``); 0:
            unknown, counted as nothing.
        decode_weight_bytes_per_s: resident weight bytes/s the runner's one-row product
            reads (``HostProfile.decode_weight_bytes_per_s``): decode reads weights at
            this rate (:attr:`weight_read_bytes_per_s`); 0: unknown, the bandwidth.
        host_id: the machine the node runs on (``HostProfile.host_id``); nodes with the
            same non-empty id share its CPUs; ``""``: unknown, shared with none.
        cpu_count: the CPUs the node may run on (0: unknown).
        threads: the threads a runner of the node computes with, which its rates were
            measured with (0: torch's default, every CPU).
        host_layer_s: the CPU's fixed cost of a decode layer (``HostProfile.host_layer_s``:
            on a CPU node ``decode_layer_s``; on a GPU node the host's, which the step's
            work on the host scales with); 0: unknown, ``decode_layer_s`` counts.
    """

    node_id: str
    available_bytes: int
    memory_bandwidth_bytes_per_s: float
    matmul_flops: float
    decode_layer_s: float = 0.0
    decode_weight_bytes_per_s: float = 0.0
    host_id: str = ""
    cpu_count: int = 0
    threads: int = 0
    host_layer_s: float = 0.0

    @property
    def step_host_s(self) -> float:
        """Seconds a decode step costs the sampling rank beside its layers
        (:data:`STEP_LAYERS` of the host's layer cost)."""
        return STEP_LAYERS * (self.host_layer_s or self.decode_layer_s)

    @property
    def weight_read_bytes_per_s(self) -> float:
        """Bytes/s decode reads weights at: the product's own rate where measured (timed
        over more weights than any cache holds, so the memory's read rate is in it), else
        the memory bandwidth. Not the lower of the two: the bandwidth is a copy's (read
        and write), which a 2-vCPU VM measured at 9.6 GB/s beside a starting runner while
        its decode product read 22.9 GB/s, and the preview predicted a Qwen3-30B-A3B-shaped
        model's decode at 40 tokens/s where it decoded 83."""
        rate = self.decode_weight_bytes_per_s
        return rate if rate > 0 else self.memory_bandwidth_bytes_per_s


@dataclass(frozen=True)
class Link:
    """A network link between two nodes: one-way latency (s) and bandwidth (bytes/s)."""

    latency_s: float
    bandwidth_bytes_per_s: float


DEFAULT_LINK = Link(latency_s=1e-3, bandwidth_bytes_per_s=100e6)
"""Assumed for a pair of nodes missing from ``links``: 1 ms, 100 MB/s."""


def link_between(links: Mapping[tuple[str, str], Link] | None, a: str, b: str) -> Link:
    """The link between nodes ``a`` and ``b`` (either key order), else :data:`DEFAULT_LINK`."""
    links = links or {}
    return links.get((a, b)) or links.get((b, a)) or DEFAULT_LINK


def check_dtype(dtype: str) -> None:
    """Refuse a compute dtype the model does not know.

    Raises:
        PlacementError: ``dtype`` is not one of :data:`~shardline.placement.ranks.DTYPE_BYTES`.
    """
    if dtype not in DTYPE_BYTES:
        raise PlacementError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPE_BYTES)})")


def _linear_per_layer(config: ModelConfig) -> int:
    """Linear weight elements of one whole decoder layer that a token reads (q, k, v, o,
    gate, up, down; of a mixture-of-experts layer the router and the experts a token is
    routed to, not the others)."""
    return config.active_layer_param_count() - 2 * config.hidden_size


def _tensor_linear_per_layer(config: ModelConfig, share: TensorShare) -> int:
    """Linear weight elements of one layer that a tensor rank reads for a token (its share
    of :func:`_linear_per_layer`: every expert's columns are split, or under expert sharding
    the rank's whole experts take their share of a token's k on average; the router is
    whole)."""
    d, hd = config.hidden_size, config.head_dim
    q, kv = share.num_heads * hd, share.num_kv_heads * hd
    experts: float = config.num_experts_per_tok or 1
    if share.experts is not None:  # whole experts: a token's k fall on this rank's share of them
        e0, e1 = share.experts
        experts *= (e1 - e0) / config.num_experts
    return int(d * (q + 2 * kv) + q * d + experts * 3 * d * share.num_columns + config.num_experts * d)


def _secs(num: float, rate: float) -> float:
    return num / rate if rate > 0 else float("inf")


def _per_s(seconds: float) -> float:
    return 1.0 / seconds if seconds > 0 else float("inf")


def _step_s(node: NodeProfile, weight_bytes: float, kv_bytes: float, layers: float) -> float:
    """Seconds ``node`` takes for its part of a one-sequence decode step: its weights at
    its weight-read rate, its KV cache at its memory bandwidth, ``layers`` layers' fixed
    cost."""
    return (
        _secs(weight_bytes, node.weight_read_bytes_per_s)
        + _secs(kv_bytes, node.memory_bandwidth_bytes_per_s)
        + layers * node.decode_layer_s
    )


def _prefill_s(node: NodeProfile, flops: float, layers: float, activations: float) -> float:
    """Seconds ``node`` takes a prompt token for ``flops`` of products (attention's past a
    chunk's length included), ``activations`` (layer, element) of its layers' other work
    (norms, activation function, residuals, attention at a chunk's length:
    :data:`PREFILL_ACTIVATION_BYTES` each at its memory bandwidth) and ``layers`` layers'
    fixed cost, paid once a chunk."""
    return (
        _secs(flops, node.matmul_flops)
        + _secs(activations * PREFILL_ACTIVATION_BYTES, node.memory_bandwidth_bytes_per_s)
        + layers * node.decode_layer_s / PREFILL_CHUNK_TOKENS
    )


def attention_flops(query_width: int, prompt_tokens: int) -> float:
    """Floating-point operations a prompt token's causal attention costs in one layer past
    what :data:`PREFILL_ACTIVATION_BYTES` holds (attention over a chunk's first half, the
    fit's own prompt): ``4 * query_width * (prompt_tokens - PREFILL_CHUNK_TOKENS) / 2``
    (q·k and p·v, 2 operations a multiply-add, over the ``prompt_tokens / 2`` keys a
    token of the prompt sees on average), 0 for a prompt within one chunk.
    ``query_width``: the query heads' width (heads x head_dim) the rank computes."""
    return 2.0 * query_width * max(0, prompt_tokens - PREFILL_CHUNK_TOKENS)


def oversubscription(nodes: Sequence[NodeProfile]) -> list[float]:
    """For each node, how many times more threads its host's nodes among ``nodes`` run
    at once than the host has CPUs (at least 1): the factor a rank's compute slows by
    while all of them compute together (a tensor or ring step, or overlapped pipeline
    prefill). Nodes of one host: the same non-empty ``host_id``; a node's threads are
    ``threads``, else (torch's default) ``cpu_count``; a host's CPUs the most any of its
    nodes counts. Unknown hosts or CPUs: 1."""
    hosts: dict[str, list[NodeProfile]] = {}
    for node in nodes:
        if node.host_id and node.cpu_count > 0:
            hosts.setdefault(node.host_id, []).append(node)

    def factor(node: NodeProfile) -> float:
        group = hosts.get(node.host_id) if node.host_id else None
        if not group:
            return 1.0
        cpus = max(n.cpu_count for n in group)
        return max(1.0, sum(n.threads or n.cpu_count for n in group) / cpus)

    return [factor(n) for n in nodes]


@dataclass(frozen=True)
class _Terms:
    """What every sharding's speed formula reads (:func:`predict_tokens_per_s`'s notation).

    Attributes:
        config, nodes, shares, links: the placement, node i being rank i.
        e: bytes of a compute-dtype element.
        w: bytes a weight takes resident (``decode_weight_bytes``).
        n: prompt tokens of the prefill predicted.
        head: the LM head's weight elements (``vocab_size * d``).
        avg_tokens: the average context of a sequence that grows to ``context`` (tokens).
        kv_token: KV bytes per token, all layers, all KV heads.
        ids: the nodes' ids in rank order.
        lat_max, bw_min: the worst latency (s) and bandwidth (bytes/s) over all pairs of
            the placement's nodes (0 and infinity for one node).
        gather: 2 * lat_max with more than one rank, else 0 (s).
        act: ``A``, a token's activation elements in a layer (``d + intermediate_size``).
        attention: :func:`attention_flops` of all query heads at ``n`` (one layer).
        shared: each rank's :func:`oversubscription` ``s_r``.
    """

    config: ModelConfig
    nodes: Sequence[NodeProfile]
    shares: Sequence[RankShare]
    links: Mapping[tuple[str, str], Link] | None
    e: int
    w: float
    n: int
    head: int
    avg_tokens: float
    kv_token: int
    ids: list[str]
    lat_max: float
    bw_min: float
    gather: float
    act: int
    attention: float
    shared: list[float]

    @property
    def L(self) -> int:
        return self.config.num_layers

    @property
    def d(self) -> int:
        return self.config.hidden_size

    @property
    def P(self) -> int:
        return len(self.nodes)


def _terms(
    config: ModelConfig,
    nodes: Sequence[NodeProfile],
    shares: Sequence[RankShare],
    links: Mapping[tuple[str, str], Link] | None,
    context: int,
    dtype: str,
    decode_weight_bytes: float,
    prompt_tokens: int,
) -> _Terms:
    """The :class:`_Terms` of a placement. Raises :class:`PlacementError` for an unknown
    ``dtype``."""
    check_dtype(dtype)
    e = DTYPE_BYTES[dtype]
    ids = [n.node_id for n in nodes]
    pairs = [link_between(links, a, b) for i, a in enumerate(ids) for b in ids[i + 1 :]]
    lat_max = max((k.latency_s for k in pairs), default=0.0)
    return _Terms(
        config=config,
        nodes=nodes,
        shares=shares,
        links=links,
        e=e,
        w=decode_weight_bytes,
        n=prompt_tokens,
        head=config.vocab_size * config.hidden_size,
        avg_tokens=context / 2,
        kv_token=config.kv_bytes_per_token(e),
        ids=ids,
        lat_max=lat_max,
        bw_min=min((k.bandwidth_bytes_per_s for k in pairs), default=float("inf")),
        gather=2 * lat_max if len(nodes) > 1 else 0.0,  # proposals to the sampling rank 0 and back
        act=config.hidden_size + config.intermediate_size,
        attention=attention_flops(config.num_heads * config.head_dim, prompt_tokens),
        shared=oversubscription(nodes),
    )


def predict_tokens_per_s(
    config: ModelConfig,
    sharding: Sharding,
    nodes: Sequence[NodeProfile],
    shares: Sequence[RankShare],
    links: Mapping[tuple[str, str], Link] | None,
    context: int,
    dtype: str = "bfloat16",
    *,
    decode_weight_bytes: float = DECODE_WEIGHT_BYTES,
    prompt_tokens: int = PREFILL_CHUNK_TOKENS,
) -> tuple[float, float]:
    """Predicted (decode, prefill) tokens/s of a feasible placement (node i is rank i).

    Decode is for one sequence; prefill for one prompt of ``prompt_tokens``. Notation: ``P`` ranks,
    ``L = num_layers``, ``d = hidden_size``, ``e`` = bytes of a ``dtype`` element, ``w =
    decode_weight_bytes`` (bytes a weight takes resident), ``bw_r`` and ``F_r`` rank r's memory
    bandwidth (bytes/s) and matmul FLOP/s, ``wr_r`` the rate its decode product reads
    weights at (``NodeProfile.weight_read_bytes_per_s``: the int4 kernel's measured rate
    where measured, else ``bw_r``), ``o_r`` its ``decode_layer_s`` (the fixed cost of a layer
    in a decode step, s), ``L_r`` its layers, ``lat``/``bw`` a link's latency (s) and
    bandwidth (bytes/s), ``lat_max``/``bw_min`` the worst over all pairs of the placement's
    nodes.

    What rank r reads per decoded token::

        W_r = w * (linear weight elements of r a token reads, the LM head on the sampling
                   rank included; of a mixture-of-experts layer the router and the
                   num_experts_per_tok experts a token is routed to: Qwen3-30B-A3B's
                   3.3B of 30.5B)
        K_r = (KV bytes per token of r's layers or KV heads) * context / 2

    (the KV cache read at the average context of a sequence that grows to ``context``;
    embedding lookups are negligible). ``N_r`` is r's linear weight elements without the
    LM head (prefill computes logits for the last token only), ``A = d +
    intermediate_size`` a token's activation elements in a layer. A rank's decode step and
    a prompt token's prefill on it cost::

        T_r = W_r / wr_r + K_r / bw_r + L_r * o_r
        Q_r = (2*N_r + L_r * attention_flops(q_r, n)) / F_r
              + L_r * A * PREFILL_ACTIVATION_BYTES / bw_r + L_r * o_r / C
              (C = PREFILL_CHUNK_TOKENS: a chunk pays the layers' fixed cost once;
               n = prompt_tokens; q_r the query width r computes: all heads', or its
               heads' under tensor)

    Ranks whose nodes share a machine compute at once in a tensor or ring step and in
    overlapped pipeline prefill: each such ``T_r`` and ``Q_r`` is multiplied by its host's
    :func:`oversubscription` ``s_r`` (threads running at once over CPUs, at least 1; a
    local cluster of 3 one-thread nodes on 2 CPUs: 1.5). A one-sequence pipeline decode
    runs its stages one after another and pays none.

    plus ``STEP_LAYERS * h_r`` on the rank that samples (``h_r`` its ``host_layer_s``,
    else ``o_r``). A small model's decode on a CPU is bound by its per-layer small ops (norms,
    rotary, attention's reshapes, residuals: ~60 torch calls a layer) and by the int4 kernel's
    unpacking, not by memory bandwidth. On the 2-vCPU VM this was checked on (SmolLM2-135M int4,
    one runner thread, the machine loaded by others: load average 5-8), 102 MB of resident
    weights were read at the int4 product's 6-9 GB/s and a layer's fixed cost was 0.6-0.9 ms, so
    the fixed costs were about half of a ~50 ms step; the bandwidth-only model (``o = 0``,
    weights at the copy bandwidth) missed them.

    Each sharding's step and prefill formulas: :func:`_pipeline_speed`, :func:`_tensor_speed`
    (tensor and expert), :func:`_ring_speed`. A single node (P = 1) pays no link. Compute/transfer
    overlap and batching are ignored; attention is in ``PREFILL_ACTIVATION_BYTES`` at a chunk's
    length and in ``K_r`` for decode. With ``o_r = 0`` and no weight-read rate (a profile that
    did not measure them) decode is the bandwidth-bound model alone.

    Raises:
        PlacementError: an unknown sharding or dtype.
    """
    t = _terms(config, nodes, shares, links, context, dtype, decode_weight_bytes, prompt_tokens)
    if sharding == Sharding.PIPELINE:
        return _pipeline_speed(t)
    if sharding in (Sharding.TENSOR, Sharding.EXPERT):
        return _tensor_speed(t)
    if sharding == Sharding.RING:
        return _ring_speed(t)
    raise PlacementError(f"sharding {sharding!r} is not supported (supported: {', '.join(SHARDINGS)})")


def _pipeline_speed(t: _Terms) -> tuple[float, float]:
    """(decode, prefill) tokens/s of a pipeline (:func:`predict_tokens_per_s`'s notation;
    the last rank samples and broadcasts the token id)::

        decode s/token  = sum_r T_r + STEP_LAYERS * h_last
                          + sum_hops (lat + d*e / bw) + lat(last -> others)
          (lat(last -> others): the others sent the step's proposals to the last rank
           while it computed; its sampled ids and the proposals reach them one hop later)
        H_r  = d*e / bw + lat / C     (the hop after stage r, a token's share)
        prefill s/token = (sum_r (Q_r + H_r) + (k - 1) * max_r max(s_r * Q_r, H_r)) / k
          (k = ceil(n / C) chunks: the first goes through every stage in turn, and each
           later one leaves the slowest stage or hop a chunk later, stages overlapping:
           a prompt of one chunk runs its stages one after another)
    """
    config, L, d, P, ids = t.config, t.L, t.d, t.P, t.ids
    decode = slowest = through = 0.0
    for rank, (node, share) in enumerate(zip(t.nodes, t.shares)):
        layers = share.num_layers
        linear = layers * _linear_per_layer(config)
        weights = t.w * (linear + (t.head if rank == P - 1 else 0))
        decode += _step_s(node, weights, t.kv_token * layers / L * t.avg_tokens, layers) + (
            node.step_host_s if rank == P - 1 else 0.0
        )
        stage = _prefill_s(node, 2 * linear + layers * t.attention, layers, layers * t.act)
        slowest = max(slowest, t.shared[rank] * stage)
        through += stage
    for a, b in zip(ids, ids[1:]):
        link = link_between(t.links, a, b)
        hop = _secs(d * t.e, link.bandwidth_bytes_per_s)
        decode += link.latency_s + hop
        slowest = max(slowest, hop + link.latency_s / PREFILL_CHUNK_TOKENS)
        through += hop + link.latency_s / PREFILL_CHUNK_TOKENS
    last_bcast = max((link_between(t.links, ids[-1], o).latency_s for o in ids[:-1]), default=0.0)
    chunks = max(1, -(-t.n // PREFILL_CHUNK_TOKENS))
    prefill = (through + (chunks - 1) * slowest) / chunks
    return _per_s(decode + last_bcast), _per_s(prefill)


def _tensor_speed(t: _Terms) -> tuple[float, float]:
    """(decode, prefill) tokens/s of tensor or expert sharding (:func:`predict_tokens_per_s`'s
    notation; expert: whole experts per rank, see :func:`_tensor_linear_per_layer`; two
    all-reduces a layer of float32 partial sums, rank 0 samples; a sum of at most
    ``POINT_TO_POINT_BYTES``, a decode step's, goes from every rank to every other in
    one hop on gloo (:func:`shardline.parallel.point_to_point.all_reduce`; NCCL's own
    small sum is counted alike, its links' latencies are microseconds); a larger one by gloo's
    ring all-reduce: a reduce-scatter and an all-gather of P-1 steps each, every step a
    message of 1/P of the sums to the next rank: Patarasuk and Yuan, "Bandwidth optimal
    all-reduce algorithms for clusters of workstations", JPDC 2009)::

        allreduce(n) = (P-1) * n*d*4 / bw_min + lat_max      where n*d*4 <= POINT_TO_POINT_BYTES
                     = 2*(P-1)/P * n*d*4 / bw_min + 2*(P-1) * lat_max    (n tokens) otherwise
        decode s/token  = max_r s_r * T_r + STEP_LAYERS * h_0 + 2*L * allreduce(1) + 2*lat_max
          (2*lat_max: the step's proposals to rank 0 and back, all ranks arriving at once)
        prefill s/token = max_r s_r * Q_r + 2*L * allreduce(C) / C
                          (Q_r with r's heads and columns: A = d + r's columns)
          (the heads and columns split by shape, not by speed: the slowest rank bounds)
    """
    config, L, d, P = t.config, t.L, t.d, t.P
    decode = prefill = 0.0
    for rank, (node, share) in enumerate(zip(t.nodes, t.shares)):
        ts = share.tensor_share
        assert ts is not None  # tensor placement gives every rank its share
        linear = L * _tensor_linear_per_layer(config, ts)
        weights = t.w * (linear + (t.head if rank == 0 else 0))
        kv = 2 * L * ts.num_kv_heads * config.head_dim * t.e * t.avg_tokens
        decode = max(decode, t.shared[rank] * _step_s(node, weights, kv, L))
        heads_attention = attention_flops(ts.num_heads * config.head_dim, t.n)
        prefill = max(
            prefill, t.shared[rank] * _prefill_s(node, 2 * linear + L * heads_attention, L, L * (d + ts.num_columns))
        )
    decode += t.nodes[0].step_host_s
    if P > 1:

        def allreduce(tokens: int) -> float:
            if tokens * d * 4 <= POINT_TO_POINT_BYTES:
                return (P - 1) * tokens * d * 4 / t.bw_min + t.lat_max
            return 2 * (P - 1) / P * tokens * d * 4 / t.bw_min + 2 * (P - 1) * t.lat_max

        decode += 2 * L * allreduce(1) + t.gather
        prefill += 2 * L * allreduce(PREFILL_CHUNK_TOKENS) / PREFILL_CHUNK_TOKENS
    return _per_s(decode), _per_s(prefill)


def _ring_speed(t: _Terms) -> tuple[float, float]:
    """(decode, prefill) tokens/s of ring sharding (:func:`predict_tokens_per_s`'s notation;
    every rank holds the whole model and decodes it; rank 0 samples)::

        decode s/token  = max_r s_r * T_r + STEP_LAYERS * h_0 + 2*lat_max   (the whole model)
        prefill s/token = max_r s_r * Q_r / P   (an even zig-zag split; Q_r of the whole
                                                 model, its fixed cost not divided)
                          + (P-1)/P * kv_bytes_per_token / bw_min   (k/v blocks round the ring)
                          + L*(P-1)*lat_max / (P * 512)      (a latency per layer and step)
    """
    L, P = t.L, t.P
    linear = L * _linear_per_layer(t.config)
    weights = t.w * (linear + t.head)
    decode = max(f * _step_s(n, weights, t.kv_token * t.avg_tokens, L) for n, f in zip(t.nodes, t.shared))
    decode += t.nodes[0].step_host_s + t.gather
    prefill = max(
        f * _prefill_s(n, (2 * linear + L * t.attention) / P, L, L * t.act / P) for n, f in zip(t.nodes, t.shared)
    )
    if P > 1:
        prefill += (P - 1) / P * _secs(t.kv_token, t.bw_min)
        prefill += L * (P - 1) * t.lat_max / ring_prefill_chunk(P, PREFILL_CHUNK_TOKENS)
    return _per_s(decode), _per_s(prefill)
