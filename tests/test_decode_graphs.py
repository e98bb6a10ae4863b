"""The decode step a CUDA graph captures (``models/decode_graphs.py``): its key spans,
where it runs, and on the CPU its fixed-shape step against the eager decode (same hidden
states to rounding, same keys and values written); on a GPU, the captured graphs against
the eager step."""

import pytest
import tiny_models as tm
import torch

from shardline.models import decode_graphs
from shardline.models.decode_graphs import DecodeGraphs, key_span, key_spans, padded_decode
from shardline.models.kv_cache import KVCache
from shardline.models.shard_loader import load_shard
from shardline.models.weights import open_weights

pytestmark = [pytest.mark.fast, pytest.mark.timeout(60)]

LAYERS = 3


@pytest.mark.parametrize(
    "longest, positions, span",
    [
        (1, 4096, 256),
        (256, 4096, 256),
        (257, 4096, 512),
        (1000, 4096, 1024),
        (4096, 4096, 4096),
        (300, 320, 320),
        (5000, 8192, 8192),
    ],
)
def test_key_span_is_the_least_power_of_two_bucket_that_holds_the_longest_row(longest, positions, span):
    assert key_span(longest, positions) == span


@pytest.mark.parametrize(
    "positions, spans",
    [
        (96, [96]),
        (256, [256]),
        (257, [256, 257]),
        (4096, [256, 512, 1024, 2048, 4096]),
        (3000, [256, 512, 1024, 2048, 3000]),
    ],
)
def test_key_spans_are_every_span_a_cache_gives(positions, spans):
    assert key_spans(positions) == spans
    assert {key_span(n, positions) for n in range(1, positions + 1)} == set(spans)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    model = tm.hf_model(request.param, num_layers=LAYERS, rope_theta=10000.0, seed=9)
    return tm.save_hf(model, tmp_path_factory.mktemp(request.param))


def _shards(directory, dtype, bounds):
    source = open_weights(directory)
    return [load_shard(source, a, b, dtype=dtype) for a, b in bounds]


def test_a_cpu_shard_is_not_captured(model_dir):
    (shard,) = _shards(model_dir, torch.float32, [(0, LAYERS)])
    assert shard.graphs is None
    assert "not CUDA" in decode_graphs.refusal(shard)


def _prefilled(shards, lengths, context=96):
    """Caches of a pipeline of ``shards`` whose slot i holds a prompt of ``lengths[i]``."""
    caches = [tm.new_cache(s, slots=len(lengths) + 1, context=context) for s in shards]
    for slot, length in enumerate(lengths):
        tokens = torch.randint(0, tm.VOCAB, (length,), generator=torch.Generator().manual_seed(slot))
        tm.run_pipeline(shards, caches, tokens, lambda s: s.prefill_batch(slot, 0, length, True))
    return caches


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_the_fixed_shape_step_matches_the_eager_decode(model_dir, dtype, tolerance):
    """Rows of several lengths in shuffled slots, through a whole shard and through a
    pipeline's second stage (hidden-state inputs): the hidden states agree to rounding, and
    both write the same keys and values."""
    lengths = [5, 40, 17]
    slots, positions = [2, 0, 1], [lengths[2], lengths[0], lengths[1]]
    for bounds in ([(0, LAYERS)], [(0, 1), (1, LAYERS)]):
        shards = _shards(model_dir, dtype, bounds)
        last = shards[-1]
        caches = _prefilled(shards, lengths)
        inputs = torch.tensor([11, 12, 13])
        for shard, cache in zip(shards[:-1], caches):  # earlier stages run eagerly
            inputs = shard(inputs, shard.decode_batch(slots, positions), cache)
        cache = caches[-1]
        eager_cache = _prefilled(shards, lengths)[-1]
        batch = last.decode_batch(slots, positions)
        with torch.inference_mode():
            h = last.embed(inputs) if last.embed is not None else inputs
            for i, layer in enumerate(last.layers):
                h = layer(h, batch, eager_cache.k[i], eager_cache.v[i])
            rows = torch.tensor([slots, [p + 1 for p in positions]])
            padded = padded_decode(last, inputs, rows, key_span(max(positions) + 1, 96), cache)
        spread = h.float().std()
        assert float((padded.float() - h.float()).abs().max() / spread) < tolerance
        for k, eager_k in zip(cache.k + cache.v, eager_cache.k + eager_cache.v):
            assert float((k.float() - eager_k.float()).abs().max()) <= tolerance * float(eager_k.float().abs().max())


class _Uncaptured:
    """A stand-in for a shard's :class:`DecodeGraphs` on the CPU: each step runs what a
    graph would capture (:func:`padded_decode`) without capturing it."""

    def __init__(self, shard):
        self.shard, self.head = shard, decode_graphs.captures_head(shard)

    def run(self, inputs, rows, cache):
        meta = torch.tensor([[slot for slot, _ in rows], [length for _, length in rows]])
        span = key_span(max(length for _, length in rows), cache.k[0].shape[2])
        return padded_decode(self.shard, inputs, meta, span, cache, self.head)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_a_step_the_graphs_take_whole_gives_the_eager_logits(model_dir, dtype, tolerance):
    """On the last shard the captured step ends in the final norm and LM head (its float32
    refinement included): the batch it is given is built without device tensors, and
    the logits agree with the eager step's to rounding, the same top token in each row."""
    lengths = [5, 40, 17]
    slots, positions = [2, 0, 1], [lengths[2], lengths[0], lengths[1]]
    (shard,) = _shards(model_dir, dtype, [(0, LAYERS)])
    assert decode_graphs.captures_head(shard)
    shard.fused = None  # the eager torch ops a CUDA shard runs (not the CPU's fused layers)
    eager_cache, graph_cache = _prefilled([shard], lengths)[0], _prefilled([shard], lengths)[0]
    inputs = torch.tensor([11, 12, 13])
    eager = shard(inputs, shard.decode_batch(slots, positions), eager_cache)
    shard.graphs = _Uncaptured(shard)
    batch = shard.decode_batch(slots, positions)
    assert batch.graphed and batch.cos.numel() == 0 and batch.rows == [(2, 18), (0, 6), (1, 41)]
    graphed = shard(inputs, batch, graph_cache)
    assert graphed.dtype == torch.float32 and graphed.shape == eager.shape
    assert float((graphed - eager).abs().max() / eager.std()) < tolerance
    assert torch.equal(graphed.argmax(-1), eager.argmax(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_captured_steps_match_the_eager_step_on_cuda(model_dir):
    """Graphs captured for two row counts and replayed over several steps give the eager
    step's logits; a new KV cache drops the graphs (they hold the old one's addresses)."""
    source = open_weights(model_dir)
    shard = load_shard(source, 0, LAYERS, dtype=torch.float32, device="cuda")
    assert isinstance(shard.graphs, DecodeGraphs)
    graphs, eager = shard.graphs, []
    for use_graphs in (True, False):
        shard.graphs = graphs if use_graphs else None
        cache = KVCache(shard.config, LAYERS, 3, 96, torch.float32, "cuda")
        logits = []
        for step in range(4):
            rows = [0] if step % 2 else [0, 2]
            logits.append(
                shard(
                    torch.tensor([5 + step] * len(rows), device="cuda"),
                    shard.decode_batch(rows, [step] * len(rows)),
                    cache,
                ).cpu()
            )
        eager.append(logits)
    assert len(graphs) == 2
    for captured, plain in zip(*eager):
        assert torch.allclose(captured, plain, atol=1e-4, rtol=1e-4)
    # warmed before the first request: every (rows, span) a 3-slot, 96-position cache gives
    cache = KVCache(shard.config, LAYERS, 3, 96, torch.float32, "cuda")
    assert graphs.warm(cache, 3) == (3, 3) and len(graphs) == 3
