"""More conversations stay cached than the batch has places: a CPU rank's KV cache maps
:func:`~shardline.models.kv_cache.cache_slots` slots (address space until written), the
finished prompts keep the ones no sequence runs in, and the batch still runs at most
``max_batch`` sequences at once. (One engine in this process, a tiny random bfloat16
model.)"""

from __future__ import annotations

import queue
import random

import pytest
import tiny_models as tm
import torch

from shardline.models.kv_cache import cache_slots
from shardline.parallel.pipeline import PipelineStage
from shardline.runner.engine import Engine
from shardline.runner.protocol import SamplingParams, Task, TokenEvent, Tokens

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights

    path = tmp_path_factory.mktemp("tiny-llama")
    tm.save_hf(tm.hf_model("llama", num_layers=2, seed=6), path)
    return load_shard(open_weights(path), 0, 2, dtype=torch.bfloat16)


def engine(shard, slots: int) -> tuple[Engine, list]:
    """An engine of a batch of 2 over a cache of ``slots`` slots of 512 positions (a pool
    of 2 x 512 tokens)."""
    sent: list = []
    stage = PipelineStage(shard, tm.new_cache(shard, slots=slots, context=512), 0, 1)
    return Engine(stage, queue.Queue(), sent.append, "n", None, 2, 512, 64, 64, 4096, idle_wait_s=0.0), sent


def run(engine: Engine, sent: list, tasks: list[Task]) -> dict[int, tuple[list[int], int]]:
    """``tasks`` sent together, run to their ends (and the engine's idle steps after, which
    cache the answers): each one's tokens and cached tokens; never more than the batch
    running."""
    for t in tasks:
        engine.inbox.put(t)
    out: dict[int, tuple[list[int], int]] = {t.task_id: ([], 0) for t in tasks}
    ended: set[int] = set()
    while len(ended) < len(tasks):
        engine.step()
        assert len(engine.running) <= 2
        for event in (e for m in sent if isinstance(m, Tokens) for e in m.events if isinstance(e, TokenEvent)):
            out[event.task_id][0].append(event.token_id)
            out[event.task_id] = (out[event.task_id][0], event.cached_tokens)
            if event.finish_reason is not None:
                ended.add(event.task_id)
        sent.clear()
    for _ in range(6):
        engine.step()
    return out


def conversations(shard, slots: int) -> tuple[list[int], dict[int, list[int]]]:
    """Six conversations taking turns, three turns each, one request at a time, then the
    last turns of all six at once: the cached tokens of every turn after each
    conversation's first, and every request's tokens."""
    rng = random.Random(5)
    prompts = [tuple(rng.randrange(tm.VOCAB) for _ in range(60)) for _ in range(6)]
    eng, sent = engine(shard, slots)
    cached, texts, ids = [], {}, iter(range(1, 100))
    for turn in range(3):
        for c in range(6):
            task_id = next(ids)
            tokens, got = run(eng, sent, [Task(task_id, "n", prompts[c], 8, GREEDY)])[task_id]
            texts[task_id] = tokens
            if turn:
                cached.append(got)
            prompts[c] = prompts[c] + tuple(tokens) + tuple(rng.randrange(tm.VOCAB) for _ in range(20))
    together = [Task(next(ids), "n", p, 8, GREEDY) for p in prompts]
    for task_id, (tokens, _) in run(eng, sent, together).items():
        texts[task_id] = tokens
    return cached, texts


def test_six_conversations_stay_cached_on_a_batch_of_two(shard):
    assert cache_slots(2, "cpu") == 8
    wide, wide_texts = conversations(shard, slots=8)
    narrow, narrow_texts = conversations(shard, slots=2)
    # each turn resumes after its conversation's previous prompt and answer (68+ tokens)
    assert min(wide) >= 64, wide
    # with as many slots as the batch, the two most recent conversations' alone
    assert sum(c >= 64 for c in narrow) == 0, narrow
    assert wide_texts == narrow_texts  # the same greedy text, hit or not
