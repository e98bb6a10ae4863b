"""A slot's pages go back to the system where its positions leave the KV pool's count, and
no system call is spent where they stay within it: a conversation's next turn admitted to
its own cached slot gives nothing back (its reservation counts the cached positions, and
it rewrites them as it grows), and when it ends every page past the prefix its slot keeps
is back, the old prefix's past its own rows too. (One engine in this process, a tiny
random bfloat16 model.)"""

from __future__ import annotations

import mmap
import queue
import random

import pytest
import tiny_models as tm
import torch
from model_shapes import smollm2

from shardline.models.kv_cache import KVCache
from shardline.parallel.pipeline import PipelineStage
from shardline.runner.engine import Engine
from shardline.runner.protocol import Cancel, SamplingParams, Task, TokenEvent, Tokens

pytestmark = pytest.mark.timeout(120)

if not hasattr(mmap, "MADV_DONTNEED"):
    pytest.skip("pages go back by MADV_DONTNEED", allow_module_level=True)

GREEDY = SamplingParams(temperature=0.0)


class CountedMapping:
    """A cache's mapping whose ``madvise`` calls are counted."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self.mapping, self.calls = mapping, 0

    def madvise(self, *args) -> None:
        self.calls += 1
        self.mapping.madvise(*args)


def test_a_release_to_an_end_gives_back_only_the_blocks_between():
    cache = KVCache(smollm2(), 30, 2, 1000, torch.bfloat16)  # blocks of 32 positions
    for t in cache.k + cache.v:
        t[1, :, :1000] = 1
    cache.release(1, 100, 300)  # 128 .. 320
    for t in (cache.k[0], cache.v[29], cache.k[11]):
        assert t[1, :, :128].min().item() == 1
        assert t[1, :, 128:320].abs().sum().item() == 0
        assert t[1, :, 320:1000].min().item() == 1
    counted = cache._mapping = CountedMapping(cache._mapping)  # type: ignore[assignment]
    cache.release(1, 200, 200)  # nothing between: no call
    cache.release(1, 300, 290)
    assert counted.calls == 0
    cache.release(0, 0, 64)  # each (layer, K or V, head)
    assert counted.calls == 30 * 2 * 3


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights

    path = tmp_path_factory.mktemp("tiny-llama")
    tm.save_hf(tm.hf_model("llama", num_layers=2, seed=5), path)
    return load_shard(open_weights(path), 0, 2, dtype=torch.bfloat16)


class OneSlot:
    """An engine of one slot of 1,024 positions with prefix caching; its cache's
    ``madvise`` calls counted."""

    def __init__(self, shard) -> None:
        self.sent: list = []
        self.cache = tm.new_cache(shard, slots=1, context=1024)
        assert self.cache.block_tokens == 128  # bfloat16 heads of 16
        self.counted = self.cache._mapping = CountedMapping(self.cache._mapping)  # type: ignore[assignment]
        stage = PipelineStage(shard, self.cache, 0, 1)
        self.engine = Engine(stage, queue.Queue(), self.sent.append, "n", None, 1, 1024, 64, 64, 4096)

    def run(self, task: Task, cancel_after: int = 0) -> tuple[list[int], int, int]:
        """``task`` run to its end (cancelled after ``cancel_after`` tokens, where given):
        its tokens, its cached tokens, and the ``madvise`` calls before its first token."""
        self.engine.inbox.put(task)
        tokens: list[int] = []
        calls = None
        for _ in range(500):
            self.engine.step()
            for message in self.sent:
                for event in message.events if isinstance(message, Tokens) else ():
                    if isinstance(event, TokenEvent):
                        calls = self.counted.calls if calls is None else calls
                        if len(tokens) + 1 == cancel_after:
                            self.engine.inbox.put(Cancel(task.task_id))
                        tokens.append(event.token_id)
                        if event.finish_reason is not None:
                            self.sent.clear()
                            return tokens, event.cached_tokens, calls
            self.sent.clear()
        raise AssertionError("the task did not end")

    def idle(self) -> None:
        """Steps with nothing to do: the last answer is cached meanwhile."""
        for _ in range(8):
            self.engine.step()

    def written(self) -> list[int]:
        """Positions of the slot past which every layer's keys and values read zero."""
        ends = []
        for t in self.cache.k + self.cache.v:
            nonzero = t[0].abs().sum(dim=(0, 2)).nonzero()
            ends.append(int(nonzero[-1]) + 1 if len(nonzero) else 0)
        return ends


def test_a_next_turn_in_its_cached_slot_gives_nothing_back_until_it_ends(shard):
    rng = random.Random(3)
    first = tuple(rng.randrange(tm.VOCAB) for _ in range(300))
    one = OneSlot(shard)
    one.engine.idle_wait_s = 0.0
    answer, cached, _ = one.run(Task(1, "n", first, 20, GREEDY))
    assert cached == 0
    one.idle()
    assert max(one.written()) == 320  # the prompt and its answer, cached
    # The next turn: the whole conversation and a new message; its reservation (prompt
    # and max_tokens) covers the cached positions.
    second = first + tuple(answer) + tuple(rng.randrange(tm.VOCAB) for _ in range(40))
    before = one.counted.calls
    tokens, cached, calls = one.run(Task(2, "n", second, 30, GREEDY))
    assert cached >= 256 and calls == before  # resumed; no page given back before its first token
    assert max(one.written()) == 384  # its prompt's 360 rows kept (their 3 blocks), its answer's pages back
    # A prompt that shares only 100 tokens, in the one slot, whose reservation covers the
    # old prefix's positions, cancelled after a few tokens: those positions past its own
    # rows (it wrote 130 and its few) go back when it ends.
    third = first[:100] + tuple(rng.randrange(tm.VOCAB) for _ in range(30))
    tokens, cached, _ = one.run(Task(3, "n", third, 600, GREEDY), cancel_after=3)
    assert cached == 100 and tokens[-1] == -1 and len(tokens) < 10  # the cancellation's event last
    assert max(one.written()) <= 256  # the kept prefix's whole blocks (130 rows: 256), nothing past


def test_a_sequence_that_ends_gives_back_every_page_it_wrote(shard):
    """Without the cache the slot is emptied: its prompt's, answer's and drafts' pages."""
    rng = random.Random(4)
    piece = tuple(rng.randrange(tm.VOCAB) for _ in range(40))
    one = OneSlot(shard)
    one.engine.prefix_cache = False
    one.run(Task(1, "n", piece * 5, 60, SamplingParams(temperature=0.0, draft_tokens=8)))
    assert max(one.written()) == 0
