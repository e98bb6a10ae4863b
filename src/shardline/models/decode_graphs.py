"""A shard's decode step captured as CUDA graphs: one launch a step instead of one per
kernel.

On a GPU a small model's decode step is bound by launching its kernels from Python, not
by reading its weights: SmolLM2-135M's 30 layers took 16.1 ms a step on an H200 (0.4% of
its memory bandwidth), the 1B shape's 16 layers 10.7 ms. A CUDA graph records the step's
kernels once and replays them with one call (NVIDIA, "CUDA Graphs", CUDA C++ Programming
Guide; ``torch.cuda.CUDAGraph``), the way vLLM and gpt-fast run decode.

A graph replays fixed shapes and addresses, so the captured step (:func:`padded_decode`)
reads its varying parts from static input tensors: the rows' token ids (or hidden
states), slots and lengths, copied in before each replay. On the last shard the graph
also holds the final norm and the LM head with its float32 refinement
(:func:`captures_head`): the step's logits come out of the replay, and the step's
:class:`~shardline.models.llama.ForwardBatch` is built on the host (it carries only the
rows). Each row attends the first
``span`` positions of its slot, those past its length masked (:func:`key_span` buckets
the longest row's length to a power of two, so a graph serves many steps); a graph is
captured per (rows, span), all of them as the rank loads (:meth:`DecodeGraphs.warm`), any
other when first needed. The eager decode attends exactly each row's
prefix instead: the two agree to rounding (not bit for bit), which is why the CPU, whose
decode keeps each row's bits whatever its batch, does not take this path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from shardline.models.kv_cache import KVCache

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from shardline.models.llama import DecoderShard

LEAST_KEY_SPAN = 256
"""Keys the shortest span reads: steps at positions under it share one graph per row count."""

GRAPH_MAX_ROWS = 32
"""Decode steps of more rows run eagerly: their launches are spread over enough work."""

T = TypeVar("T")


def capture(
    device: torch.device, step: Callable[[], T], pool: _POOL_HANDLE | None = None
) -> tuple[torch.cuda.CUDAGraph, T]:
    """``step`` captured as a CUDA graph on ``device`` (in ``pool`` where given), having
    run it once eagerly on a side stream first (CUDA's lazy initialisations must not be
    captured); the graph and what the captured ``step`` returned (tensors the graph
    writes on each replay). The graph is not replayed yet."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the runner's other threads (its inbox) may use the CUDA API meanwhile
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = step()
    return graph, out


def key_span(longest: int, positions: int) -> int:
    """Keys per row a captured decode step attends: the smallest power of two times
    :data:`LEAST_KEY_SPAN` that holds ``longest`` (the longest row's length, tokens), at
    most ``positions`` (the cache's positions per slot)."""
    span = LEAST_KEY_SPAN
    while span < longest:
        span *= 2
    return min(span, positions)


def refusal(shard: DecoderShard) -> str | None:
    """Why ``shard``'s decode steps cannot be captured as CUDA graphs, or None."""
    if shard.device.type != "cuda":
        return f"on {shard.device.type}, not CUDA"
    if shard.share is not None:
        return "tensor-parallel: its all-reduce runs between the layers"
    if shard.fused is not None:
        return "its decode runs the fused CPU layers"
    if shard.config.is_moe:
        return "mixture-of-experts layers: which experts run depends on the step's values"
    return None


def key_spans(positions: int) -> list[int]:
    """Every key span a cache of ``positions`` positions a slot gives (:func:`key_span`'s
    values), shortest first."""
    spans = [key_span(1, positions)]
    while spans[-1] < positions:
        spans.append(key_span(spans[-1] + 1, positions))
    return spans


def captures_head(shard: DecoderShard) -> bool:
    """Whether a captured step of ``shard`` includes its final norm and LM head (logits
    out): the shard has them and its LM head is one weight part (the float32 refinement
    of a head of several parts picks each id's part with shapes that depend on the ids,
    which a graph cannot replay)."""
    return shard.norm is not None and shard.lm_head is not None and len(shard.lm_head.parts) == 1


def padded_decode(
    shard: DecoderShard, inputs: torch.Tensor, rows: torch.Tensor, span: int, cache: KVCache, head: bool = False
) -> torch.Tensor:
    """One decode step through ``shard``'s embedding (if it has one) and layers, and with
    ``head`` its final norm and LM head, with shapes that depend only on the row count and
    ``span``: what a graph captures.

    Args:
        inputs: int64 token ids ``[N]`` (first shard) or hidden states ``[N, hidden]``.
        rows: int64 ``[2, N]``: each row's KV-cache slot, then its length with the new
            token (its position plus one).
        span: keys each row attends (:func:`key_span`); positions at or past a row's
            length are masked.
        cache: the shard's KV cache; the new tokens' keys and values are written to it.
        head: also the final norm and LM head (:func:`captures_head` must hold).

    Returns:
        Hidden states after the last layer, ``[N, hidden]`` in the compute dtype, or with
        ``head`` float32 logits ``[N, vocab]`` (as :meth:`DecoderShard.logits`).
    """
    from shardline.models.llama import ForwardBatch

    slots, lengths = rows[0], rows[1]
    positions = lengths - 1
    cos, sin = shard.rope(positions)
    keys = torch.arange(span, device=rows.device)
    batch = ForwardBatch(
        prefill=False,
        slot=-1,
        start=0,
        slots=slots,
        positions=positions,
        cos=cos,
        sin=sin,
        attn_mask=None,
        kv_len=span,
        rows=[],
        logit_rows=keys[: len(slots)],
        key_span=span,
        key_mask=keys.unsqueeze(0) < lengths.unsqueeze(1),
    )
    h = shard.embed(inputs) if shard.embed is not None else inputs
    for i, layer in enumerate(shard.layers):
        h = layer(h, batch, cache.k[i], cache.v[i])
    if head:
        assert shard.norm is not None
        return shard.logits(shard.norm(h))
    return h


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # static: what padded_decode reads
    rows: torch.Tensor
    out: torch.Tensor  # static: what it wrote


class DecodeGraphs:
    """The CUDA graphs of one shard's decode steps, one per (rows, key span), captured by
    :meth:`warm` or when first needed, and kept while the shard runs with the same KV
    cache (a graph holds the cache's addresses). The graphs share one memory pool: they
    replay one at a time. Build it where :func:`refusal` is None."""

    def __init__(self, shard: DecoderShard) -> None:
        self.shard = shard
        self.head = captures_head(shard)
        """Whether the graphs' steps end in logits (the shard's final norm and LM head)."""
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._cache: KVCache | None = None
        self._pool: _POOL_HANDLE | None = None

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, inputs: torch.Tensor, rows: list[tuple[int, int]], cache: KVCache) -> torch.Tensor:
        """The decode step of ``rows`` (``(slot, length)`` each, as
        ``ForwardBatch.rows``) for ``inputs`` (see :func:`padded_decode`): hidden states
        ``[N, hidden]``, or float32 logits ``[N, vocab]`` where :attr:`head`, a tensor of
        the caller's own."""
        if cache is not self._cache:
            self._graphs.clear()
            self._cache = cache
        meta = torch.tensor([[slot for slot, _ in rows], [length for _, length in rows]], dtype=torch.long)
        span = key_span(max(length for _, length in rows), cache.k[0].shape[2])
        captured = self._graphs.get((len(rows), span))
        if captured is None:
            captured = self._graphs[(len(rows), span)] = self._capture(inputs, meta, span, cache)
        else:
            captured.rows.copy_(meta)
            captured.inputs.copy_(inputs)
            captured.graph.replay()
        return captured.out.clone()

    def warm(self, cache: KVCache, rows: int) -> tuple[int, int]:
        """Capture the steps of 1 to ``rows`` rows (at most :data:`GRAPH_MAX_ROWS`) at
        every key span of ``cache`` (:func:`key_spans`) now, before any request: each
        capture runs the step twice and builds a graph, which the first steps of each new
        batch shape paid for while they served. Writes keys and values at position 0 of
        slot 0, which a sequence's prefill writes before any step reads it. Returns the
        graphs captured and the most rows captured."""
        self._graphs.clear()
        self._cache = cache
        device, hidden = self.shard.device, self.shard.config.hidden_size
        spans = key_spans(cache.k[0].shape[2])
        most = min(rows, GRAPH_MAX_ROWS)
        for n in range(1, most + 1):
            inputs = (
                torch.zeros(n, dtype=torch.long)
                if self.shard.embed is not None
                else torch.zeros(n, hidden, dtype=self.shard.dtype, device=device)
            )
            meta = torch.tensor([[0] * n, [1] * n], dtype=torch.long)
            for span in spans:
                self._graphs[(n, span)] = self._capture(inputs, meta, span, cache)
        return len(self._graphs), most

    def _capture(self, inputs: torch.Tensor, meta: torch.Tensor, span: int, cache: KVCache) -> _Captured:
        """Capture the step for these inputs (:func:`capture`), then replay it once: the
        eager run before the capture writes the step's own keys and values, which the
        replay writes again, so the step runs as if once."""
        device = self.shard.device
        inputs, rows = inputs.to(device, copy=True), meta.to(device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, out = capture(
            device, lambda: padded_decode(self.shard, inputs, rows, span, cache, self.head), self._pool
        )
        graph.replay()
        return _Captured(graph, inputs, rows, out)


def for_shard(shard: DecoderShard) -> DecodeGraphs | None:
    """``shard``'s decode graphs, or None where :func:`refusal` says why not."""
    return None if refusal(shard) else DecodeGraphs(shard)
