"""Each rank's share of a model for a sharding: the one entry point the coordinator calls."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardline.models.config import ModelConfig, Quantize, RankShare, Sharding
from shardline.models.store import ModelNotFoundError
from shardline.placement.layer_ranges import MemoryShortError, NodeCapacity, PlacementError, pipeline_layer_ranges
from shardline.placement.memory import RUNTIME_BASELINE_BYTES, prefill_scratch_bytes
from shardline.placement.ring import ring_admission, ring_working_bytes
from shardline.placement.tensor import tensor_placement, tensor_rank_bytes

SHARDINGS = tuple(Sharding)
SHARDING_NAMES = tuple(s.value for s in Sharding)
"""The shardings' names, as the CLI takes and shows them."""


def shardings_named(name: str) -> tuple[Sharding, ...]:
    """The shardings a placement request names: one, or every one for ``"auto"``.

    Raises:
        PlacementError: no sharding has that name.
    """
    if name == "auto":
        return SHARDINGS
    if name not in SHARDINGS:
        raise PlacementError(f"sharding {name!r} is not supported (supported: auto, {', '.join(SHARDINGS)})")
    return (Sharding(name),)


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class PlacementOptions:
    """What a placement is asked for besides the model and its nodes (the body of ``POST
    /cluster/instances``, ``shardline place``'s flags, a failed instance's own settings when
    it is placed again): what every step of placing reads.

    Attributes:
        context: tokens per sequence; None: the node's default, at most the model's
            trained context (:meth:`resolved`).
        max_batch: sequences at once; None: the node's default.
        dtype: the ranks' compute dtype (``"bfloat16"``, ``"float16"``, ``"float32"``).
        shardings: those weighed: one, or several (the best predicted of them).
        min_nodes, max_nodes: the fewest and most nodes a placement chosen among
            candidates uses (None: 1, and every node given); either set, it is chosen
            among candidates even under one sharding.
        kv_cache_bytes: the KV pool, the whole model's (all ranks together); None:
            ``max_batch`` sequences of ``context`` tokens, or as much as fits.
        quantize: 16- or 32-bit weights quantized on load to these bits; None: as the
            files hold them.
        force: memory admission skipped (the user knows better than the measured memory).
        prefix_cache: the ranks keep finished prompts for later ones that start the same.
        draft_model: a model of the same tokenizer that the sampling rank holds whole
            beside its shard to draft tokens for speculative decoding (its id;
            :mod:`shardline.runner.draft_model`); None: drafts by prompt lookup.
    """

    context: int | None = None
    max_batch: int | None = None
    dtype: str = "bfloat16"
    shardings: tuple[Sharding, ...] = SHARDINGS
    min_nodes: int | None = None
    max_nodes: int | None = None
    kv_cache_bytes: int | None = None
    quantize: Quantize | None = None
    force: bool = False
    prefix_cache: bool = True
    draft_model: str | None = None

    def resolved(self, trained: int, model: str, default_context: int, default_max_batch: int) -> "PlacementOptions":
        """These options with ``context`` (default: ``default_context``, at most the
        model's ``trained`` context) and ``max_batch`` set.

        Raises:
            ContextRequestError: a context over ``trained`` (:func:`check_context`).
        """
        context = self.context or min(default_context, trained)
        check_context(context, trained, model)
        return replace(self, context=context, max_batch=self.max_batch or default_max_batch)

    def sizes(self) -> tuple[int, int]:
        """``(context, max_batch)``, set (:meth:`resolved`).

        Raises:
            ValueError: one is not set.
        """
        if self.context is None or self.max_batch is None:
            raise ValueError("a placement needs its context and max_batch (PlacementOptions.resolved)")
        return self.context, self.max_batch

    def kv_tokens(self, config: ModelConfig) -> int | None:
        """The KV pool's tokens ``kv_cache_bytes`` asks for (:func:`kv_tokens_for_bytes`),
        or None.

        Raises:
            KVCacheRequestError: fewer than one sequence of the context.
        """
        if self.kv_cache_bytes is None:
            return None
        return kv_tokens_for_bytes(config, self.kv_cache_bytes, self.dtype, self.sizes()[0])


def ring_prefill_chunk(world_size: int, per_rank: int = 512) -> int:
    """Prompt tokens per ring prefill chunk: ``per_rank`` for each rank."""
    return per_rank * world_size


def _vocab_params(config: ModelConfig) -> int:
    """Weight elements of the embedding and an untied head."""
    return config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)


def model_param_count(config: ModelConfig) -> int:
    """Weight elements of the whole model: layers, embedding, and an untied head."""
    return config.num_layers * config.layer_param_count() + _vocab_params(config)


def resident_bytes_per_weight(
    config: ModelConfig, weight_file_bytes: int, dtype: str, quantize: Quantize | None = None
) -> float:
    """Bytes a weight element takes in a runner's memory, on average.

    Quantized GGUF weights stay in the file's bits (:mod:`shardline.models.linear`): about
    the file's bytes per weight, up to 15% more (Q4_K takes 5 bits of its 4.5, Q6_K 7 of
    its 6.56; two int4 planes hold Q8_0 in 10 of its 8.5). 16-bit and float32 files are held in ``dtype``, or
    with ``quantize`` in its bits (:attr:`Quantize.bytes_per_weight`).
    ``weight_file_bytes`` 0 (unknown) counts a 16-bit file.
    """
    held = float(DTYPE_BYTES[dtype]) if quantize is None else quantize.bytes_per_weight
    if weight_file_bytes <= 0:
        return held
    per_weight = weight_file_bytes / model_param_count(config)
    if per_weight >= 1.9:  # a 16- or 32-bit file: held in the compute dtype (or quantized)
        return held
    return min(1.15 * per_weight, float(DTYPE_BYTES[dtype]))


def held_bytes_per_weight(
    config: ModelConfig, weight_file_bytes: int, dtype: str, quantize: Quantize | None = None
) -> tuple[float, float]:
    """:func:`resident_bytes_per_weight` of the layers' weights and of the embedding and LM
    head, which quantizing on load keeps in int8 at least (:attr:`Quantize.vocab`)."""
    return (
        resident_bytes_per_weight(config, weight_file_bytes, dtype, quantize),
        resident_bytes_per_weight(config, weight_file_bytes, dtype, quantize.vocab if quantize else None),
    )


def _runtime_and_scratch(config: ModelConfig, baseline_bytes: int, dtype: str) -> int:
    """What every rank holds besides weights and KV cache: its runtime and the scratch of
    a prefill chunk in ``dtype``."""
    largest = 2 * config.intermediate_size * config.hidden_size  # the fused gate/up
    return baseline_bytes + prefill_scratch_bytes(
        config.hidden_size, config.intermediate_size, largest, DTYPE_BYTES[dtype]
    )


def _pipeline_fixed(config: ModelConfig, rank: int, world_size: int, vocab_bytes: float) -> int:
    """Bytes a pipeline rank holds outside its layers: the embedding on the first, the
    final norm and head on the last (a tied head on a one-rank shard shares the embedding)."""
    embed = config.vocab_size * config.hidden_size * vocab_bytes
    held = embed if rank == 0 else 0
    if rank == world_size - 1 and not (config.tie_word_embeddings and world_size == 1):
        held += embed
    return int(held)


def _ring_working(config: ModelConfig, world_size: int, kv_bytes: int) -> int:
    """Bytes of a ring prefill's working set on each of ``world_size`` ranks."""
    return ring_working_bytes(
        ring_prefill_chunk(world_size),
        world_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.hidden_size,
        config.intermediate_size,
        kv_bytes,
    )


def _kv_hint(kv_cache: int, kv_tokens: int) -> str:
    return (
        f"a KV cache of {kv_tokens} tokens is {kv_cache} bytes for the whole model: a "
        f"smaller kv_cache_bytes, context or max_batch needs less"
    )


class PlacementRequestError(ValueError):
    """A placement request that no cluster could satisfy (a 400, where a cluster without
    room for it is a :class:`~shardline.placement.layer_ranges.PlacementError`)."""


class DraftModelError(PlacementRequestError):
    """A draft model that cannot draft for the model: another tokenizer."""


class DraftModelNotFoundError(ModelNotFoundError):
    """No live node holds the draft model a placement names."""


class KVCacheRequestError(PlacementRequestError):
    """A ``kv_cache_bytes`` that cannot hold one sequence of the instance's context."""


class ContextRequestError(PlacementRequestError):
    """A context longer than the model was trained for."""


def check_context(context: int, trained: int, model: str) -> None:
    """Refuse a ``context`` (tokens) over the model's trained context (``trained``: its
    ``max_position_embeddings``, or GGUF's ``context_length``, already the extended one
    where the config scales RoPE): positions past it were never trained, and nothing here
    scales RoPE further (llama.cpp warns; vLLM refuses such a ``max_model_len``).

    Raises:
        ContextRequestError: ``context`` is over ``trained``.
    """
    if context > trained:
        raise ContextRequestError(
            f"context {context} is over {model}'s trained context of {trained} tokens: ask for {trained} or fewer"
        )


def kv_pool_tokens(context: int, max_batch: int, kv_tokens: int | None = None) -> int:
    """Tokens an instance's KV pool holds: ``kv_tokens`` when set, at most ``max_batch``
    sequences of ``context`` tokens (what the batch can use); else exactly that."""
    full = max_batch * context
    return full if kv_tokens is None else min(kv_tokens, full)


def kv_tokens_for_bytes(config: ModelConfig, kv_cache_bytes: int, dtype: str, context: int) -> int:
    """Tokens a KV pool of ``kv_cache_bytes`` (the whole model's, all ranks together)
    holds in ``dtype``.

    Raises:
        KVCacheRequestError: fewer tokens than one sequence of ``context`` tokens.
    """
    per_token = config.kv_bytes_per_token(DTYPE_BYTES[dtype])
    tokens = kv_cache_bytes // per_token
    if tokens < context:
        raise KVCacheRequestError(
            f"kv_cache_bytes {kv_cache_bytes} holds {tokens} tokens of this model "
            f"({per_token} bytes each in {dtype}), fewer than one sequence of the context "
            f"({context} tokens): give at least {context * per_token} or a smaller context"
        )
    return tokens


def rank_bytes(
    config: ModelConfig,
    sharding: Sharding,
    shares: list[RankShare],
    rank: int,
    context: int,
    max_batch: int,
    dtype: str = "bfloat16",
    weight_file_bytes: int = 0,
    baseline_bytes: int = RUNTIME_BASELINE_BYTES,
    kv_tokens: int | None = None,
    quantize: Quantize | None = None,
) -> int:
    """Bytes rank ``rank`` of a placement (``shares``, one per rank) holds in memory: its
    runtime (``baseline_bytes``), prefill scratch, weights at
    :func:`resident_bytes_per_weight` each (``quantize``: quantized on load), and its
    part of a KV pool of
    :func:`kv_pool_tokens` tokens in ``dtype`` (its layers; a tensor rank only its KV
    heads); ring adds the ring prefill's working set. The same figure
    :func:`place_ranks` admits by.
    """
    tokens = kv_pool_tokens(context, max_batch, kv_tokens)
    world = len(shares)
    kv_bytes = DTYPE_BYTES[dtype]
    weight_bytes, vocab_bytes = held_bytes_per_weight(config, weight_file_bytes, dtype, quantize)
    fixed = _runtime_and_scratch(config, baseline_bytes, dtype)
    share = shares[rank]
    if sharding in (Sharding.TENSOR, Sharding.EXPERT):
        assert share.tensor_share is not None
        return fixed + tensor_rank_bytes(
            config,
            share.tensor_share,
            kv_tokens=tokens,
            weight_bytes=weight_bytes,
            kv_element_bytes=kv_bytes,
            vocab_bytes=vocab_bytes,
        )
    kv_per_layer = tokens * config.kv_bytes_per_token(kv_bytes) // config.num_layers
    if sharding == Sharding.RING:
        return (
            fixed
            + _ring_weights(config, weight_bytes, vocab_bytes)
            + kv_per_layer * config.num_layers
            + _ring_working(config, world, kv_bytes)
        )
    per_layer = int(weight_bytes * config.layer_param_count()) + kv_per_layer
    return fixed + _pipeline_fixed(config, rank, world, vocab_bytes) + share.num_layers * per_layer


def draft_model_bytes(config: ModelConfig, weight_file_bytes: int, options: PlacementOptions, kv_tokens: int) -> int:
    """Bytes the sampling rank holds for a draft model of ``config`` (its file
    ``weight_file_bytes``) beside its shard, placed under ``options`` (resolved): every
    weight at :func:`held_bytes_per_weight`, keys and values of ``kv_tokens`` positions
    in the compute dtype (the target's KV pool: its cache has the engine's slots, whose
    pages are written only as far as the sequences' tokens, which the pool bounds) and
    its prefill chunk's scratch."""
    weight_bytes, vocab_bytes = held_bytes_per_weight(config, weight_file_bytes, options.dtype, options.quantize)
    kv = kv_tokens * config.kv_bytes_per_token(DTYPE_BYTES[options.dtype])
    return _ring_weights(config, weight_bytes, vocab_bytes) + kv + _runtime_and_scratch(config, 0, options.dtype)


def with_draft_model(
    sharding: Sharding, nodes: list[NodeCapacity], draft_bytes: int
) -> tuple[list[NodeCapacity], list[int]]:
    """``nodes`` (in rank order) with what each can give the model's shares once the
    sampling rank's node (:meth:`Sharding.sampling_rank
    <shardline.models.config.Sharding.sampling_rank>`) holds ``draft_bytes`` of a draft
    model (:func:`draft_model_bytes`; at least 0 left), and those bytes per rank (all on
    the sampling rank; 0 each without a draft model).

    Raises:
        PlacementError: with a draft model, an unknown sharding.
    """
    if not draft_bytes:
        return list(nodes), [0] * len(nodes)
    if sharding not in SHARDINGS:
        shardings_named(sharding)  # raises: no sharding of that name
    sampler = Sharding(sharding).sampling_rank(len(nodes))
    drafts = [draft_bytes if r == sampler else 0 for r in range(len(nodes))]
    return [NodeCapacity(n.node_id, max(0, n.available_bytes - d)) for n, d in zip(nodes, drafts)], drafts


def draft_hint(draft_bytes: int) -> str:
    """What a refusal adds where a draft model's bytes were set aside first ("" without)."""
    if not draft_bytes:
        return ""
    return f"; the sampling rank's node also holds the draft model, {draft_bytes / 2**20:,.0f} MiB"


def _ring_weights(config: ModelConfig, weight_bytes: float, vocab_bytes: float) -> int:
    """Bytes of the whole model's weights (what every ring rank holds)."""
    return int(weight_bytes * config.num_layers * config.layer_param_count() + vocab_bytes * _vocab_params(config))


def place_ranks(
    config: ModelConfig,
    sharding: Sharding,
    nodes: list[NodeCapacity],
    context: int,
    max_batch: int,
    dtype: str = "bfloat16",
    admit: bool = True,
    weight_file_bytes: int = 0,
    baseline_bytes: int = RUNTIME_BASELINE_BYTES,
    kv_tokens: int | None = None,
    quantize: Quantize | None = None,
) -> list[RankShare]:
    """Each node's share (node i is rank i) of a model under ``sharding``.

    Each rank must fit :func:`rank_bytes` (runtime, prefill scratch, weights in the file's
    quantization from ``weight_file_bytes``, its part of the KV pool of
    :func:`kv_pool_tokens` tokens, ring's working set) in its node's
    available bytes; a memory refusal also says what the KV cache takes. Without
    ``admit`` (a forced placement) memory refuses nothing: pipeline layer ranges still
    follow the nodes' available bytes, and shapes that cannot split are refused.

    Raises:
        PlacementError: an unknown sharding, or a model that does not fit or split; the
            message names the node and the shortfall in bytes, or the shape that cannot split.
    """
    tokens = kv_pool_tokens(context, max_batch, kv_tokens)
    try:
        return _place(
            config,
            sharding,
            nodes,
            tokens,
            dtype,
            admit,
            held_bytes_per_weight(config, weight_file_bytes, dtype, quantize),
            baseline_bytes,
        )
    except MemoryShortError as exc:
        kv = tokens * config.kv_bytes_per_token(DTYPE_BYTES[dtype])
        raise MemoryShortError(f"{exc}; {_kv_hint(kv, tokens)}") from None


def ranks_bytes(
    config: ModelConfig,
    sharding: Sharding,
    shares: list[RankShare],
    options: PlacementOptions,
    weight_file_bytes: int,
    baseline_bytes: int,
    kv_tokens: int,
) -> tuple[int, ...]:
    """:func:`rank_bytes` of every rank of ``shares``, placed under ``options`` (resolved)
    with a KV pool of ``kv_tokens`` (:func:`place_with_kv_pool`'s)."""
    context, max_batch = options.sizes()
    return tuple(
        rank_bytes(
            config,
            sharding,
            shares,
            r,
            context,
            max_batch,
            options.dtype,
            weight_file_bytes,
            baseline_bytes,
            kv_tokens=kv_tokens,
            quantize=options.quantize,
        )
        for r in range(len(shares))
    )


def place_with_kv_pool(
    config: ModelConfig,
    sharding: Sharding,
    nodes: list[NodeCapacity],
    options: PlacementOptions,
    weight_file_bytes: int = 0,
    baseline_bytes: int = RUNTIME_BASELINE_BYTES,
) -> tuple[list[RankShare], int]:
    """:func:`place_ranks` under ``options`` (resolved: :meth:`PlacementOptions.sizes`)
    and the KV pool's tokens it was placed with.

    With ``kv_cache_bytes`` (or with ``force``) the pool is :func:`kv_pool_tokens`.
    Without, it is ``max_batch`` sequences of ``context`` tokens where that fits, else the
    most tokens that fit (found by bisection), at least one sequence of ``context``: the
    model is placed with a smaller pool rather than refused, and requests beyond the
    pool wait for blocks.

    Raises:
        PlacementError: as :func:`place_ranks`; the model does not fit even with a pool
            of one sequence of ``context`` tokens.
        KVCacheRequestError: ``kv_cache_bytes`` holds less than one sequence.
    """
    context, max_batch = options.sizes()
    kv_tokens = options.kv_tokens(config)

    def place(tokens: int) -> list[RankShare]:
        return place_ranks(
            config,
            sharding,
            nodes,
            context,
            max_batch,
            options.dtype,
            not options.force,
            weight_file_bytes,
            baseline_bytes,
            kv_tokens=tokens,
            quantize=options.quantize,
        )

    full = kv_pool_tokens(context, max_batch, kv_tokens)
    try:
        return place(full), full
    except MemoryShortError:
        if kv_tokens is not None:
            raise
    best = (place(context), context)  # raises: nothing fits
    low, high = context, full - 1  # the most tokens that fit lies in [low, high]
    while low < high:
        mid = (low + high + 1) // 2
        try:
            best, low = (place(mid), mid), mid
        except MemoryShortError:
            high = mid - 1
    return best


def _place(
    config: ModelConfig,
    sharding: Sharding,
    nodes: list[NodeCapacity],
    kv_tokens: int,
    dtype: str,
    admit: bool,
    held: tuple[float, float],
    baseline_bytes: int,
) -> list[RankShare]:
    """:func:`place_ranks` without the KV hint, weights at ``held`` bytes each (layers,
    embedding and head: :func:`held_bytes_per_weight`)."""
    weight_bytes, vocab_bytes = held
    layers = config.num_layers
    kv_bytes = DTYPE_BYTES[dtype]
    kv_cache = kv_tokens * config.kv_bytes_per_token(kv_bytes)
    fixed = _runtime_and_scratch(config, baseline_bytes, dtype)
    if sharding == Sharding.PIPELINE:
        per_layer = int(weight_bytes * config.layer_param_count()) + kv_cache // layers
        rank_fixed = [fixed + _pipeline_fixed(config, r, len(nodes), vocab_bytes) for r in range(len(nodes))]
        return [RankShare(s, e) for s, e in pipeline_layer_ranges(layers, nodes, per_layer, admit, rank_fixed)]
    if sharding in (Sharding.TENSOR, Sharding.EXPERT):
        shares = tensor_placement(
            config,
            nodes,
            kv_tokens=kv_tokens,
            weight_bytes=weight_bytes,
            kv_element_bytes=kv_bytes,
            vocab_bytes=vocab_bytes,
            admit=admit,
            fixed_bytes=fixed,
            whole_experts=sharding == Sharding.EXPERT,
        )
        return [RankShare(0, layers, share) for share in shares]
    if sharding == Sharding.RING:
        if config.attention_sinks or config.sliding_window:
            raise PlacementError(
                f"ring sharding does not run {config.architecture}'s attention "
                "(sinks, sliding window) yet: place it as pipeline or tensor"
            )
        weights = _ring_weights(config, weight_bytes, vocab_bytes) + fixed
        ring_admission(nodes, weights, kv_cache, _ring_working(config, len(nodes), kv_bytes), admit)
        return [RankShare(0, layers) for _ in nodes]
    raise PlacementError(f"sharding {sharding!r} is not supported (supported: {', '.join(SHARDINGS)})")
