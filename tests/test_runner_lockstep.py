"""Real runner processes of a pipeline instance (tiny random model, gloo on 127.0.0.1).

Each rank's inbox is fed directly, in a different order per rank, as the network might
deliver it. If ranks started tasks in local arrival order, their send/recv shapes would
disagree (the prompts have different lengths) and the instance would fail or hang.
"""

from __future__ import annotations

import queue
import random
import time
from dataclasses import dataclass, field

import pytest
import tiny_models as tm
import torch
from conftest import free_port_block

from shardline.models.config import RankShare, Sharding
from shardline.node.runner_processes import Worker
from shardline.runner.protocol import (
    Cancel,
    EngineStats,
    Failed,
    Loaded,
    PrefillProgress,
    RunnerSpec,
    SamplingParams,
    Task,
    Tokens,
)

NODE = "test-node"


@dataclass
class Rank:
    """One runner's messages: Loaded/Failed/Tokens in ``inbox``; the last EngineStats."""

    worker: Worker | None = None
    inbox: "queue.Queue[object]" = field(default_factory=queue.Queue)
    stats: EngineStats | None = None
    history: list[EngineStats] = field(default_factory=list)

    def receive(self, message: object) -> None:
        if isinstance(message, EngineStats):
            self.stats = message
            self.history.append(message)
        else:
            self.inbox.put(message)


class Instance:
    """``world`` runner processes forming one pipeline instance; one Worker per rank
    (``spec``: more :class:`RunnerSpec` fields)."""

    def __init__(
        self,
        model_dir,
        world: int,
        max_batch: int = 4,
        context: int = 96,
        prefill_step_tokens: int = 1024,
        progress_timeout_s: float = 60,
        kv_tokens: int = 0,
        **spec,
    ) -> None:
        self.ranks = []
        port = free_port_block(1)
        layers = 4
        bounds = [round(i * layers / world) for i in range(world + 1)]
        whole = spec.get("sharding", Sharding.PIPELINE) != Sharding.PIPELINE  # every layer on every rank
        chunk = spec.pop("prefill_chunk", 8)
        for r in range(world):
            rank = Rank()
            rank.worker = Worker(lambda _inst, msg, rank=rank: rank.receive(msg))
            rank.worker.start(
                RunnerSpec(
                    instance_id="inst",
                    node_id=NODE,
                    model_path=str(model_dir),
                    rank=r,
                    world_size=world,
                    share=RankShare(0, layers) if whole else RankShare(bounds[r], bounds[r + 1]),
                    master_addr="127.0.0.1",
                    master_port=port,
                    dtype="float32",
                    max_batch=max_batch,
                    context=context,
                    kv_tokens=kv_tokens,
                    prefill_chunk=chunk,
                    threads=1,
                    prefill_step_tokens=prefill_step_tokens,
                    prefill_burst_tokens=prefill_step_tokens,
                    collective_timeout_s=30,
                    progress_timeout_s=progress_timeout_s,
                    **spec,
                )
            )
            self.ranks.append(rank)
        for r, rank in enumerate(self.ranks):
            message = self._next(rank, (Loaded, Failed), 120)
            assert isinstance(message, Loaded), f"rank {r} failed to load: {message}"

    @staticmethod
    def _next(rank: Rank, kinds, timeout: float):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                message = rank.inbox.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                break
            if isinstance(message, Failed):
                return message
            if isinstance(message, kinds):
                return message
        raise TimeoutError(f"no {kinds} within {timeout} s")

    def send(self, r: int, message: object) -> None:
        assert self.ranks[r].worker.runners["inst"].send(message)

    def collect(self, task_ids: set[int], timeout: float = 60) -> list[dict[int, list]]:
        """Per rank: task id -> [(token, finish_reason), ...] until every task finished
        (prefill progress is skipped)."""
        results = []
        for r, rank in enumerate(self.ranks):
            out: dict[int, list] = {t: [] for t in task_ids}
            done: set[int] = set()
            deadline = time.time() + timeout
            while done != task_ids:
                message = self._next(rank, (Tokens,), deadline - time.time())
                assert not isinstance(message, Failed), f"rank {r} failed: {message.error}"
                for event in message.events:
                    if isinstance(event, PrefillProgress):
                        continue
                    out[event.task_id].append((event.token_id, event.finish_reason))
                    if event.finish_reason is not None:
                        done.add(event.task_id)
            results.append(out)
        return results

    def wait_stats(self, r: int, check, timeout: float = 10) -> EngineStats:
        """Wait until rank r's latest EngineStats satisfies ``check``; return it."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            stats = self.ranks[r].stats
            if stats is not None and check(stats):
                return stats
            time.sleep(0.005)
        raise AssertionError(f"rank {r} stats never matched; last: {self.ranks[r].stats}")

    def stop(self) -> None:
        for rank in self.ranks:
            rank.worker.stop_all()


def make_tasks(n: int, seed: int = 0, max_tokens: int = 12) -> list[Task]:
    rng = random.Random(seed)
    return [
        Task(
            task_id=1000 + i,
            origin=NODE,
            prompt=tuple(rng.randrange(tm.VOCAB) for _ in range(3 + 5 * i)),
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=0.0),
        )
        for i in range(n)
    ]


def reference_tokens(model_dir, tasks: list[Task]) -> dict[int, list[int]]:
    """Each task's greedy tokens from the one-shard model in this process."""
    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights

    shard = load_shard(open_weights(model_dir), 0, 4, dtype=torch.float32)
    return {t.task_id: tm.greedy(shard, list(t.prompt), t.max_tokens)[0] for t in tasks}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_tasks_delivered_in_different_orders_per_rank_all_complete(model_dir, world):
    tasks = make_tasks(5)
    instance = Instance(model_dir, world)
    try:
        orders = [list(tasks) for _ in range(world)]
        for r, order in enumerate(orders):
            random.Random(r).shuffle(order)
        orders[0] = list(reversed(tasks))  # rank 0 sees the newest first
        assert len({tuple(t.task_id for t in o) for o in orders}) > 1
        for i in range(len(tasks)):  # interleave delivery, with delays, rank by rank
            for r in range(world):
                instance.send(r, orders[r][i])
                time.sleep(0.01 * r)
        results = instance.collect({t.task_id for t in tasks})
        expected = reference_tokens(model_dir, tasks)
        for r in range(world):
            for task in tasks:
                events = results[r][task.task_id]
                assert [tok for tok, _ in events] == expected[task.task_id]
                assert events[-1][1] == "length"
    finally:
        instance.stop()


@pytest.mark.timeout(180)
def test_a_small_kv_pool_runs_tasks_as_blocks_free_up_with_the_same_tokens(model_dir):
    """A pool of 128 tokens (two blocks of 64 float32 positions of the tiny model's
    16-wide heads) with 4 slots: each task reserves one block, so at most two run at once
    and the rest wait; every task still gets the one-shard model's tokens, and the pool is
    whole again at the end."""
    tasks = make_tasks(5)
    instance = Instance(model_dir, 2, kv_tokens=128)
    try:
        for r in range(2):
            for task in tasks:
                instance.send(r, task)
        results = instance.collect({t.task_id for t in tasks})
        expected = reference_tokens(model_dir, tasks)
        for r in range(2):
            for task in tasks:
                assert [tok for tok, _ in results[r][task.task_id]] == expected[task.task_id]
            instance.wait_stats(r, lambda s: s.running == () and s.free_kv_tokens == 128)
            history = instance.ranks[r].history
            assert max(len(s.running) for s in history) == 2
            assert any(s.waiting and s.free_slots >= 2 for s in history)  # waiting for blocks
    finally:
        instance.stop()


@pytest.mark.timeout(180)
def test_a_cancel_seen_by_one_rank_ends_the_task_on_all_ranks_at_the_same_step(model_dir):
    long, other = make_tasks(2, seed=3, max_tokens=300)
    other = Task(other.task_id, other.origin, other.prompt, 60, other.sampling)
    instance = Instance(model_dir, 3, context=320)
    try:
        for r in range(3):
            instance.send(r, long)
            instance.send(r, other)
        instance.wait_stats(2, lambda s: long.task_id in s.running)
        instance.send(2, Cancel(long.task_id))  # only the last rank hears of it
        results = instance.collect({long.task_id, other.task_id})
        ends = [results[r][long.task_id] for r in range(3)]
        assert all(e[-1] == (-1, "cancelled") for e in ends)
        assert ends[0] == ends[1] == ends[2]  # same tokens, cancelled at the same step
        assert len(ends[0]) - 1 < 300
        assert all(len(results[r][other.task_id]) == 60 for r in range(3))
        for r in range(3):
            instance.wait_stats(r, lambda s: s.running == () and s.free_slots == 4, timeout=1)
    finally:
        instance.stop()


@pytest.mark.timeout(180)
def test_a_task_cancelled_while_queued_produces_no_tokens(model_dir):
    running, queued = make_tasks(2, seed=5, max_tokens=150)
    instance = Instance(model_dir, 2, max_batch=1, context=192)
    try:
        for r in range(2):
            instance.send(r, running)
            instance.send(r, queued)
        instance.wait_stats(0, lambda s: s.running == (running.task_id,) and s.waiting == (queued.task_id,))
        instance.send(0, Cancel(queued.task_id))
        results = instance.collect({running.task_id, queued.task_id})
        for r in range(2):
            assert results[r][queued.task_id] == [(-1, "cancelled")]
            assert len(results[r][running.task_id]) == 150
    finally:
        instance.stop()


@pytest.mark.timeout(180)
def test_a_task_cancelled_before_it_arrives_never_starts(model_dir):
    (task,) = make_tasks(1, seed=9)
    instance = Instance(model_dir, 2)
    try:
        instance.send(1, Cancel(task.task_id))
        time.sleep(0.3)  # the cancellation is agreed before any rank holds the task
        for r in range(2):
            instance.send(r, task)
        (later,) = make_tasks(1, seed=10)
        later = Task(task_id=2000, origin=NODE, prompt=later.prompt, max_tokens=3, sampling=later.sampling)
        for r in range(2):
            instance.send(r, later)
        results = instance.collect({later.task_id})
        for r in range(2):
            assert len(results[r][later.task_id]) == 3
        for r in range(2):
            stats = instance.wait_stats(r, lambda s: s.running == ())
            assert task.task_id not in stats.running + stats.waiting + stats.held
    finally:
        instance.stop()


def progress_until(instance: Instance, r: int, task_id: int, done: int, timeout: float = 30) -> int:
    """Read rank r's messages until its prefill of ``task_id`` reached ``done`` tokens."""
    deadline = time.time() + timeout
    while True:
        message = instance._next(instance.ranks[r], (Tokens,), deadline - time.time())
        assert not isinstance(message, Failed), message.error
        for event in message.events:
            assert event.task_id == task_id
            assert isinstance(event, PrefillProgress), f"prefill ended before {done} tokens: {event}"
            if event.done >= done:
                return event.done


@pytest.mark.timeout(240)
def test_cancel_during_pipelined_prefill_at_several_chunks_then_serve_correctly(model_dir):
    # 8-token chunks, 2 per step: a 240-token prompt takes 15 steps of 2 overlapped chunks.
    instance = Instance(model_dir, 3, context=320, prefill_step_tokens=16)
    long_prompt = tuple(random.Random(11).randrange(tm.VOCAB) for _ in range(240))
    try:
        for i, chunk in enumerate([1, 6, 14]):
            task = Task(
                task_id=3000 + i,
                origin=NODE,
                prompt=long_prompt,
                max_tokens=5,
                sampling=SamplingParams(temperature=0.0),
            )
            for r in range(3):
                instance.send(r, task)
            reached = progress_until(instance, 2, task.task_id, chunk * 8)
            instance.send(1, Cancel(task.task_id))  # a middle rank hears of it
            results = instance.collect({task.task_id})
            for r in range(3):
                # the cancel came mid-prefill: no token was generated
                assert results[r][task.task_id] == [(-1, "cancelled")], (chunk, reached)
            for r in range(3):
                instance.wait_stats(r, lambda s: s.running == () and s.free_slots == 4)
            (after,) = make_tasks(1, seed=20 + i)
            after = Task(task_id=4000 + i, origin=NODE, prompt=after.prompt, max_tokens=8, sampling=after.sampling)
            for r in range(3):
                instance.send(r, after)
            results = instance.collect({after.task_id})
            expected = reference_tokens(model_dir, [after])[after.task_id]
            for r in range(3):
                assert [tok for tok, _ in results[r][after.task_id]] == expected
    finally:
        instance.stop()


@pytest.mark.timeout(120)
def test_pipelined_prefill_of_a_long_prompt_matches_one_shard_and_reports_progress(model_dir):
    prompt = tuple(random.Random(12).randrange(tm.VOCAB) for _ in range(83))  # not a chunk multiple
    task = Task(task_id=5000, origin=NODE, prompt=prompt, max_tokens=6, sampling=SamplingParams(temperature=0.0))
    instance = Instance(model_dir, 3, context=128, prefill_step_tokens=24)
    try:
        for r in range(3):
            instance.send(r, task)
        progress = []
        tokens = []
        deadline = time.time() + 60
        while not tokens or tokens[-1][1] is None:
            message = instance._next(instance.ranks[2], (Tokens,), deadline - time.time())
            assert not isinstance(message, Failed), message.error
            for event in message.events:
                if isinstance(event, PrefillProgress):
                    progress.append((event.done, event.total))
                else:
                    tokens.append((event.token_id, event.finish_reason))
        # 8-token chunks (3 per step); the last rank reports each chunk it has computed
        assert progress == [(d, 83) for d in range(8, 83, 8)] + [(83, 83)]
        assert [t for t, _ in tokens] == reference_tokens(model_dir, [task])[task.task_id]
    finally:
        instance.stop()


@pytest.mark.timeout(120)
def test_a_stalled_rank_fails_the_other_ranks_within_the_progress_timeout(model_dir):
    import os
    import signal

    (task,) = make_tasks(1, seed=13, max_tokens=2000)
    instance = Instance(model_dir, 3, context=2100, progress_timeout_s=2)
    victim = instance.ranks[1].worker.runners["inst"].process.pid
    try:
        for r in range(3):
            instance.send(r, task)
        instance.wait_stats(0, lambda s: task.task_id in s.running)
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        errors = []
        for r in (0, 2):
            message = instance._next(instance.ranks[r], (), timeout=15)
            assert isinstance(message, Failed), message
            errors.append(message.error)
            assert time.monotonic() - stopped < 8  # timeout 2 s; the node watchdog is 10 s
        # The first rank to time out exits, so the other may see it go first instead.
        assert any("no progress" in e and "progress timeout 2 s" in e for e in errors), errors
        assert all("no progress" in e or "lost contact" in e for e in errors), errors
    finally:
        os.kill(victim, signal.SIGCONT)
        instance.stop()


@pytest.mark.timeout(120)
def test_prompt_logprobs_reach_every_rank_and_match_one_shards_logits(model_dir):
    """A task asking for its prompt's log-probabilities, prefilled in 8-token chunks over a
    3-stage pipeline beside a task that decodes: every rank (rank 0 is not the sampling
    one) gets each prompt token's log-probability and top entries, in order, equal to the
    log-softmax of one shard's logits over the whole prompt; the tokens stay greedy's."""
    from shardline.models.kv_cache import KVCache
    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights

    prompt = tuple(random.Random(13).randrange(tm.VOCAB) for _ in range(29))
    scored = Task(
        task_id=6000,
        origin=NODE,
        prompt=prompt,
        max_tokens=4,
        sampling=SamplingParams(temperature=0.0, prompt_logprobs=3),
    )
    beside = make_tasks(1, seed=5)[0]
    instance = Instance(model_dir, 3, context=64)
    try:
        for r in range(3):
            instance.send(r, beside)
            instance.send(r, scored)
        for r in (0, 2):
            entries, tokens = [], []
            deadline = time.time() + 60
            while not tokens or tokens[-1][1] is None:
                message = instance._next(instance.ranks[r], (Tokens,), deadline - time.time())
                assert not isinstance(message, Failed), message.error
                for event in message.events:
                    if event.task_id != scored.task_id:
                        continue
                    if isinstance(event, PrefillProgress):
                        entries.extend(event.logprobs)
                    else:
                        tokens.append((event.token_id, event.finish_reason))
            assert [i for i, _, _ in entries] == list(range(1, len(prompt)))
            assert [t for t, _ in tokens] == reference_tokens(model_dir, [scored])[scored.task_id]
            shard = load_shard(open_weights(model_dir), 0, 4, dtype=torch.float32)
            cache = KVCache(shard.config, 4, 1, 64, torch.float32)
            hidden = shard(torch.tensor(prompt), shard.prefill_batch(0, 0, len(prompt), True, every_row=True), cache)
            logits = shard.logits(hidden)
            expected = torch.log_softmax(logits.float(), dim=-1)
            for i, logprob, top in entries:
                assert logprob == pytest.approx(expected[i - 1, prompt[i]].item(), abs=1e-4)
                values, ids = expected[i - 1].topk(3)
                assert [t for t, _ in top] == ids.tolist()
                assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
    finally:
        instance.stop()
