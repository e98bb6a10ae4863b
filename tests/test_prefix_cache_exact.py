"""A prompt resumed from a cached prefix gives the bits a cold prefill of it gives: its
first token's logits and the keys and values of its prompt (one engine in this process,
a tiny random model in bfloat16, 512-token chunks as the runners cut them)."""

from __future__ import annotations

import queue
import random

import pytest
import tiny_models as tm
import torch

from shardline.parallel.pipeline import PipelineStage
from shardline.runner.engine import Engine
from shardline.runner.protocol import SamplingParams, Task, TokenEvent, Tokens

pytestmark = pytest.mark.timeout(120)


class Recording(Engine):
    """An engine that keeps the logits each sequence's first token was sampled from, and
    the rows of each micro-batch it computed."""

    first_logits: dict[int, torch.Tensor]
    micro_rows: list[int]

    def _compute(self, micro, computed, decoding, timed):
        self.micro_rows += [int(tokens.shape[0]) for tokens, _ in micro]
        return super()._compute(micro, computed, decoding, timed)

    def _sample_and_advance(self, plan, seqs, logits):
        for seq, row in zip(seqs, logits):
            if not seq.generated:
                self.first_logits[seq.task.task_id] = row.clone()
        super()._sample_and_advance(plan, seqs, logits)


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights

    path = tmp_path_factory.mktemp("tiny-llama")
    tm.save_hf(tm.hf_model("llama", num_layers=2, seed=3), path)
    return load_shard(open_weights(path), 0, 2, dtype=torch.bfloat16)


def engine(shard, prefix_cache: bool = True, stages: int = 1) -> tuple[Recording, list]:
    """An engine of one rank; ``stages``: the micro-batches it plans for (a pipeline's
    world size: its chunks cut in pieces, :func:`~shardline.runner.step_plan.fill_stages`)."""
    sent: list = []
    stage = PipelineStage(shard, tm.new_cache(shard, slots=2, context=1536), 0, 1)
    stage.stages = stages
    e = Recording(stage, queue.Queue(), sent.append, "n", None, 2, 1536, 512, 512, 4096, prefix_cache=prefix_cache)
    e.first_logits, e.micro_rows = {}, []
    return e, sent


def run(e: Recording, sent: list, t: Task, generated: list[int] | None = None) -> int:
    """Run ``t`` to its end; the cached tokens it reported (its tokens into ``generated``)."""
    e.inbox.put(t)
    for _ in range(200):
        e.step()
        for message in sent:
            if isinstance(message, Tokens):
                for event in message.events:
                    if isinstance(event, TokenEvent) and generated is not None:
                        generated.append(event.token_id)
                    if isinstance(event, TokenEvent) and event.finish_reason is not None:
                        sent.clear()
                        return event.cached_tokens
        sent.clear()
    raise AssertionError("the task did not end")


@pytest.mark.parametrize(
    "model, prefix, total, cached",
    [
        ("shard", 803, 1197, 803),  # the prefix's last chunk (512..802) read its window's keys, as a cold one
        ("shard", 475, 655, 475),  # resumed inside the first chunk: 37 rows computed as its 512
        ("shard", 600, 1030, 600),  # the prefix's 88-row last chunk cached once idle, computed as a whole chunk
        ("shard", 1000, 1030, 1000),  # an agent's short turn: 24 rows as their chunk, then the 6-row last chunk
        # int4, where 64 rows or fewer take the fused layers: 9 and 24 rows computed as their chunk
        ("blocks_of_32", 1015, 1100, 1015),
        ("blocks_of_32", 1000, 1030, 1000),
        # where the compiled prefill attention runs, a piece that runs on into the short
        # last chunk: 221 + 173 and 24 + 106 rows
        ("blocks_of_32", 803, 1197, 803),
        ("blocks_of_32", 1000, 1130, 1000),
    ],
    ids=lambda v: str(v),
)
def test_a_resumed_prompt_gets_a_cold_prefills_bits(request, model, prefix, total, cached):
    shard = request.getfixturevalue(model)
    rng = random.Random(prefix)
    prompt = tuple(rng.randrange(tm.VOCAB) for _ in range(total))
    greedy = SamplingParams(temperature=0.0)
    cold, cold_sent = engine(shard)
    warm, warm_sent = engine(shard)
    assert run(cold, cold_sent, Task(1, "n", prompt, 1, greedy)) == 0
    assert run(warm, warm_sent, Task(2, "n", prompt[:prefix], 1, greedy)) == 0
    assert run(warm, warm_sent, Task(3, "n", prompt, 1, greedy)) == cached
    assert torch.equal(warm.first_logits[3], cold.first_logits[1])
    # the slots keep what they cache (the prompt's exact rows), the same bits
    (mine,), (theirs,) = warm.cached.values(), cold.cached.values()
    kept = len(mine.token_ids)
    assert kept == len(theirs.token_ids) > cached
    for layer in range(len(warm.stage.cache.k)):
        for kv in (warm.stage.cache.k, warm.stage.cache.v):
            other = (cold.stage.cache.k if kv is warm.stage.cache.k else cold.stage.cache.v)[layer]
            assert torch.equal(kv[layer][mine.slot, :, :kept], other[theirs.slot, :, :kept])


def test_ranks_that_compute_prefill_rows_apart_run_a_hit_on_into_the_short_last_chunk(blocks_of_32, shard):
    """The compiled prefill attention (64-wide heads, where it is built) computes each row
    apart from the rows beside it: a hit's 24 rows to the chunk's end and the prompt's
    106-row last chunk run as one micro-batch; torch's attention (16-wide heads) reads as
    many keys as its chunk, so there the two stay apart."""
    from shardline.models import prefill_attention

    rng = random.Random(5)
    prompt = tuple(rng.randrange(tm.VOCAB) for _ in range(1130))
    greedy = SamplingParams(temperature=0.0)
    for model, apart in ((blocks_of_32, prefill_attention.built()), (shard, False)):
        e, sent = engine(model)
        assert e.rows_apart == apart
        run(e, sent, Task(1, "n", prompt[:1000], 1, greedy))
        e.micro_rows.clear()
        assert run(e, sent, Task(2, "n", prompt, 1, greedy)) == 1000
        hit = [rows for rows in e.micro_rows if rows > 1][:2]  # (not the cached answer's 1-row extension)
        assert hit == ([130] if apart else [24, 106])
    assert not engine(blocks_of_32, prefix_cache=False)[0].rows_apart


def test_tensor_ranks_of_three_or_more_do_not_compute_rows_apart(blocks_of_32):
    """Their sums of a piece's rows go by gloo's ring all-reduce, in an order its size
    decides: a tensor stage computes rows apart on one or two ranks only (its ranks'
    count read alone here)."""
    from shardline.models import prefill_attention
    from shardline.parallel.tensor import TensorStage

    stage = TensorStage(blocks_of_32, tm.new_cache(blocks_of_32, slots=2, context=1536), 0, 1)
    for world_size, apart in ((1, prefill_attention.built()), (2, prefill_attention.built()), (3, False)):
        stage.world_size = world_size
        assert stage.prefill_rows_apart() == apart


@pytest.mark.parametrize("prefix, total", [(0, 700), (600, 1030)], ids=lambda v: str(v))
def test_a_pipelines_pieces_of_a_chunk_give_the_whole_chunks_bits(shard, prefix, total):
    """A 3-stage pipeline's plan cuts a chunk of 192-512 rows in pieces of 96-171: the same
    first logits and keys and values as the whole chunks, cold and on a hit."""
    rng = random.Random(total)
    prompt = tuple(rng.randrange(tm.VOCAB) for _ in range(total))
    greedy = SamplingParams(temperature=0.0)
    whole, whole_sent = engine(shard)
    cut, cut_sent = engine(shard, stages=3)
    for e, sent in ((whole, whole_sent), (cut, cut_sent)):
        if prefix:
            run(e, sent, Task(1, "n", prompt[:prefix], 1, greedy))
        assert run(e, sent, Task(2, "n", prompt, 1, greedy)) == prefix
    assert torch.equal(cut.first_logits[2], whole.first_logits[2])
    (mine,), (theirs,) = cut.cached.values(), whole.cached.values()
    assert len(mine.token_ids) == len(theirs.token_ids)
    for a, b in ((cut.stage.cache.k, whole.stage.cache.k), (cut.stage.cache.v, whole.stage.cache.v)):
        for layer in range(2):
            assert torch.equal(
                a[layer][mine.slot, :, : len(mine.token_ids)], b[layer][theirs.slot, :, : len(mine.token_ids)]
            )


def test_a_seeded_sample_is_the_same_with_and_without_a_hit(shard):
    rng = random.Random(5)
    prompt = tuple(rng.randrange(tm.VOCAB) for _ in range(700))
    seeded = SamplingParams(temperature=1.0, seed=11)
    cold, cold_sent = engine(shard)
    warm, warm_sent = engine(shard)
    mine: list[int] = []
    theirs: list[int] = []
    run(cold, cold_sent, Task(1, "n", prompt, 12, seeded), theirs)
    run(warm, warm_sent, Task(2, "n", prompt[:600], 1, seeded))
    assert run(warm, warm_sent, Task(3, "n", prompt, 12, seeded), mine) == 600
    assert mine == theirs and len(set(mine)) > 1


@pytest.mark.parametrize(
    "model, prompt_len, answer_len",
    [
        ("shard", 700, 100),  # blocks of 128: the answer's rows a whole chunk's class
        ("blocks_of_32", 520, 40),  # cached to 512, the answer's 48 rows computed as a whole chunk
        ("blocks_of_32", 700, 30),  # cached to 700 (a block part full), the answer's 30 rows after it
    ],
    ids=["blocks of 128", "short", "rest of the chunk"],
)
def test_an_answer_is_cached_while_idle_with_a_cold_prefills_bits(request, model, prompt_len, answer_len):
    """A conversation's next turn holds this turn's answer: computed while the engine idles,
    as a cold prefill computes it, it is cached too, and the next turn resumes after it
    with a cold prefill's logits and keys."""
    shard = request.getfixturevalue(model)
    rng = random.Random(7)
    prompt = tuple(rng.randrange(tm.VOCAB) for _ in range(prompt_len))
    greedy = SamplingParams(temperature=0.0)
    warm, warm_sent = engine(shard)
    answer: list[int] = []
    run(warm, warm_sent, Task(1, "n", prompt, answer_len, greedy), answer)
    (before,) = warm.cached.values()
    assert len(before.rest) == prompt_len + answer_len - len(before.token_ids)
    for _ in range(3):
        warm.step()  # idle: nothing runs or waits
    (after,) = warm.cached.values()
    grown = prompt_len + answer_len
    assert len(after.token_ids) == grown > len(before.token_ids)  # prompt and answer, a block part full
    turn = prompt + tuple(answer) + tuple(rng.randrange(tm.VOCAB) for _ in range(300))
    cold, cold_sent = engine(shard)
    assert run(cold, cold_sent, Task(2, "n", turn, 1, greedy)) == 0
    assert run(warm, warm_sent, Task(3, "n", turn, 1, greedy)) == grown
    assert torch.equal(warm.first_logits[3], cold.first_logits[2])
    (mine,), (theirs,) = warm.cached.values(), cold.cached.values()
    for layer in range(2):
        assert torch.equal(
            warm.stage.cache.k[layer][mine.slot, :, :grown], cold.stage.cache.k[layer][theirs.slot, :, :grown]
        )
        assert torch.equal(
            warm.stage.cache.v[layer][mine.slot, :, :grown], cold.stage.cache.v[layer][theirs.slot, :, :grown]
        )
