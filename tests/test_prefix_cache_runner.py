"""Prefix caching in real runner processes (tiny random float32 model, gloo on 127.0.0.1):
a prompt that starts with a finished one's takes its slot, prefills only the rest, reports
the cached tokens and gives the tokens of a cold prefill; cached slots make way for new
tasks and never for running ones; with caching off nothing is cached."""

from __future__ import annotations

import random
import time

import pytest
import tiny_models as tm
from test_runner_lockstep import NODE, Instance, reference_tokens

from shardline.models.config import Sharding
from shardline.runner.prefix_cache import reuse
from shardline.runner.protocol import Failed, PrefillProgress, SamplingParams, Task, TokenEvent, Tokens

BLOCK = 64  # float32 positions of the tiny model's 16-wide heads in a 4 KiB block
rng = random.Random(43)
SYSTEM = tuple(rng.randrange(tm.VOCAB) for _ in range(150))  # two whole blocks and a part of one


def task(task_id: int, prompt: tuple[int, ...], max_tokens: int = 6) -> Task:
    return Task(task_id, NODE, prompt, max_tokens, SamplingParams(temperature=0.0))


def tail(n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(tm.VOCAB) for _ in range(n))


def send(instance: Instance, tasks: list[Task]) -> None:
    for r in range(len(instance.ranks)):
        for t in tasks:
            instance.send(r, t)


def collect(instance: Instance, task_ids: set[int], timeout: float = 60) -> list[dict[int, list]]:
    """Per rank, each task's events until it finished."""
    results = []
    for r, rank in enumerate(instance.ranks):
        out: dict[int, list] = {t: [] for t in task_ids}
        done: set[int] = set()
        deadline = time.time() + timeout
        while done != task_ids:
            message = instance._next(rank, (Tokens,), deadline - time.time())
            assert not isinstance(message, Failed), f"rank {r} failed: {message.error}"
            for event in message.events:
                out[event.task_id].append(event)
                if isinstance(event, TokenEvent) and event.finish_reason is not None:
                    done.add(event.task_id)
        results.append(out)
    return results


def run(instance: Instance, tasks: list[Task]) -> list[dict[int, list]]:
    send(instance, tasks)
    return collect(instance, {t.task_id for t in tasks})


def tokens(events: list) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [1, 2])
def test_a_prompt_sharing_a_finished_ones_blocks_resumes_there_with_the_cold_tokens(model_dir, world):
    first = task(100, SYSTEM + tail(20))
    second = task(101, SYSTEM + tail(30))  # shares 150 tokens: two whole blocks and 22 of the third
    instance = Instance(model_dir, world, max_batch=2, context=256)
    try:
        expected = reference_tokens(model_dir, [first, second])
        one = run(instance, [first])[-1]
        assert tokens(one[100]) == expected[100]
        assert all(e.cached_tokens == 0 for e in one[100] if isinstance(e, TokenEvent))
        # its prompt, then (computed while idle) its answer: 176 tokens in three blocks
        stats = instance.wait_stats(world - 1, lambda s: s.running == () and s.cached_tokens == 176)
        assert stats.cached_slots == 1 and stats.free_slots == 2
        results = run(instance, [second])
        for r in range(world):
            events = results[r][101]
            assert tokens(events) == expected[101]  # the cold prefill's tokens
            assert {e.cached_tokens for e in events if isinstance(e, TokenEvent)} == {150}
        progress = [e for e in results[-1][101] if isinstance(e, PrefillProgress)]
        assert progress[0].done == 152 and {p.cached for p in progress} == {150}  # to the chunk's end
        stats = instance.wait_stats(world - 1, lambda s: s.running == () and s.reused_tokens > 0)
        assert stats.prompt_tokens == len(first.prompt) + len(second.prompt)
        assert stats.reused_tokens == 150
        # The same prompt again resumes at its last token (its logits are computed).
        again = task(102, second.prompt)
        results = run(instance, [again])
        assert tokens(results[-1][102]) == expected[101]
        assert results[-1][102][-1].cached_tokens == 179
    finally:
        instance.stop()


@pytest.mark.timeout(180)
def test_a_conversation_sharing_only_a_header_leaves_the_other_cached(model_dir):
    """Two conversations take turns, sharing only their first 10 tokens (a chat
    template's header): the second copies those into an empty slot rather than take the
    first's (which holds less than a chunk past them), so the first's next request finds
    its whole prompt cached again."""
    first = task(300, SYSTEM + tail(20))
    other = task(301, SYSTEM[:10] + tail(100))
    again = task(302, first.prompt)
    instance = Instance(model_dir, 1, max_batch=2, context=512, prefill_chunk=256)
    try:
        expected = reference_tokens(model_dir, [first, other])
        run(instance, [first])
        instance.wait_stats(0, lambda s: s.running == () and s.cached_slots == 1)
        results = run(instance, [other])[0]
        assert tokens(results[301]) == expected[301]
        assert results[301][-1].cached_tokens == 10
        instance.wait_stats(0, lambda s: s.running == () and s.cached_slots == 2)
        results = run(instance, [again])[0]
        assert tokens(results[302]) == expected[300]
        # as far as a resumed prefill keeps a cold one's bits (its slot holds all 170)
        assert results[302][-1].cached_tokens == reuse(len(first.prompt), len(first.prompt), 256) > 10
    finally:
        instance.stop()


@pytest.mark.timeout(180)
def test_cached_slots_make_way_for_new_tasks_and_running_ones_keep_theirs(model_dir):
    """Two slots and a pool of eight blocks: a cached prefix holds a slot and two blocks,
    a long task the other slot and six. A new task that shares nothing needs a slot and a
    block: the cached slot is evicted (nothing of the running task's), and every task gets
    its cold tokens."""
    cached = task(200, SYSTEM)
    running = task(201, tail(40), max_tokens=300)  # 340 tokens: six blocks
    newcomer = task(202, tail(30), max_tokens=20)  # one block
    instance = Instance(model_dir, 2, max_batch=2, context=512, kv_tokens=8 * BLOCK)
    try:
        expected = reference_tokens(model_dir, [cached, running, newcomer])
        run(instance, [cached])
        instance.wait_stats(1, lambda s: s.running == () and s.cached_slots == 1)
        send(instance, [running])
        instance.wait_stats(1, lambda s: s.running == (201,))
        send(instance, [newcomer])
        results = collect(instance, {201, 202})
        for r in range(2):
            assert tokens(results[r][201]) == expected[201]
            assert tokens(results[r][202]) == expected[202]
        history = instance.ranks[1].history
        assert any(set(s.running) == {201, 202} and s.cached_slots == 0 for s in history)
        stats = instance.wait_stats(1, lambda s: s.running == ())
        assert stats.free_kv_tokens == 8 * BLOCK  # cached prefixes' tokens count as free
    finally:
        instance.stop()


@pytest.mark.timeout(180)
def test_a_prefix_copied_from_and_evicted_in_one_step_is_copied_first(model_dir):
    """Two slots, one holding a cached prefix: two tasks come together, the first sharing
    that prefix's first block (copied into the free slot: the prefix holds far more), the
    second sharing nothing (it takes the prefix's slot, evicted). The copy reads the
    prefix before the eviction releases it (the engine applied every eviction first, and
    failed), and both get their cold tokens."""
    long_prompt = task(400, SYSTEM + tail(40))  # three whole blocks cached
    sharer = task(401, SYSTEM[:BLOCK] + tail(30))
    stranger = task(402, tail(50))
    instance = Instance(model_dir, 1, max_batch=2, context=256)
    try:
        expected = reference_tokens(model_dir, [sharer, stranger])
        run(instance, [long_prompt])
        instance.wait_stats(0, lambda s: s.running == () and s.cached_slots == 1)
        results = run(instance, [sharer, stranger])
        assert tokens(results[0][401]) == expected[401]
        assert tokens(results[0][402]) == expected[402]
        assert any(isinstance(e, TokenEvent) and e.cached_tokens == BLOCK for e in results[0][401])
    finally:
        instance.stop()


@pytest.mark.timeout(120)
def test_with_prefix_caching_off_every_prompt_is_prefilled_whole(model_dir):
    first, second = task(300, SYSTEM + tail(20)), task(301, SYSTEM + tail(30))
    instance = Instance(model_dir, 1, max_batch=2, context=256, prefix_cache=False)
    try:
        expected = reference_tokens(model_dir, [first, second])
        for t in (first, second):
            events = run(instance, [t])[0][t.task_id]
            assert tokens(events) == expected[t.task_id]
            assert {e.cached_tokens for e in events if isinstance(e, TokenEvent)} == {0}
            assert [e.done for e in events if isinstance(e, PrefillProgress)][0] == 8  # from the start
        stats = instance.wait_stats(0, lambda s: s.running == ())
        assert stats.cached_slots == 0 and stats.reused_tokens == 0 and stats.free_slots == 2
    finally:
        instance.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sharding", [Sharding.TENSOR, Sharding.RING])
def test_tensor_and_ring_ranks_resume_from_the_same_cached_prefix(model_dir, sharding):
    """256-token chunks (a ring chunk takes at least 128 a rank): the second prompt resumes
    after the 600 tokens it shares with the first's 646 cached (its prompt and answer) and
    its rest, 600..1299, is prefilled in chunks cut at multiples of 256, those of 256
    tokens ring-prefilled on a ring."""
    system = tuple(random.Random(44).randrange(tm.VOCAB) for _ in range(600))
    first = task(400, system + tail(40))
    second = task(401, system + tail(700))
    instance = Instance(
        model_dir, 2, max_batch=2, context=1536, sharding=sharding, prefill_chunk=256, prefill_step_tokens=1024
    )
    try:
        expected = reference_tokens(model_dir, [first, second])
        results = run(instance, [first])
        assert all(tokens(results[r][400]) == expected[400] for r in range(2))
        instance.wait_stats(0, lambda s: s.running == () and s.cached_tokens == 646)
        results = run(instance, [second])
        for r in range(2):
            assert tokens(results[r][401]) == expected[401]
            assert results[r][401][-1].cached_tokens == 600
        progress = [e.done for e in results[0][401] if isinstance(e, PrefillProgress)]
        assert progress == [768, 1024, 1280, 1300]
    finally:
        instance.stop()


@pytest.mark.timeout(180)
def test_two_conversations_sharing_a_system_prompt_both_hit_and_keep_their_own(model_dir):
    """A's first turn is cached; B's shares only the system prompt with it, so B copies
    those tokens into a slot of its own and A's cached turn stays: each second turn then
    resumes after its own first turn's prompt (2 slots, 8-token chunks: A keeps 60 tokens
    or more past the shared 150, more than a chunk)."""
    a1, b1 = task(500, SYSTEM + tail(60)), task(501, SYSTEM + tail(50))
    a2, b2 = task(502, a1.prompt + tail(40)), task(503, b1.prompt + tail(40))
    instance = Instance(model_dir, 2, max_batch=2, context=256)
    try:
        expected = reference_tokens(model_dir, [a1, b1, a2, b2])
        cached = {}
        for t in (a1, b1, a2, b2):
            results = run(instance, [t])
            for r in range(2):
                assert tokens(results[r][t.task_id]) == expected[t.task_id]
            cached[t.task_id] = results[1][t.task_id][-1].cached_tokens
            instance.wait_stats(1, lambda s, t=t: s.running == () and s.prompt_tokens >= len(t.prompt))
        assert cached == {500: 0, 501: 150, 502: 210, 503: 200}
    finally:
        instance.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "sharding, chunk, prompt_len, answer, kept, grown",
    [
        (Sharding.PIPELINE, 8, 170, 60, 170, 230),
        (Sharding.TENSOR, 8, 170, 60, 170, 230),
        (Sharding.RING, 256, 640, 140, 640, 780),
    ],
    ids=["pipeline", "tensor", "ring"],
)
def test_an_answer_is_cached_while_idle_and_the_next_turn_resumes_after_it(
    model_dir, sharding, chunk, prompt_len, answer, kept, grown
):
    """A finished turn's slot keeps its prompt's rows; while nothing runs, every
    rank computes its answer's rows as a cold prefill would and the cached prefix grows
    over them; the next turn (prompt, answer, a new message) resumes after them and gets
    the tokens of a cold prefill."""
    first = task(600, tuple(random.Random(45).randrange(tm.VOCAB) for _ in range(prompt_len)), max_tokens=answer)
    instance = Instance(
        model_dir, 2, max_batch=2, context=1536, sharding=sharding, prefill_chunk=chunk, prefill_step_tokens=1024
    )
    try:
        results = run(instance, [first])
        said = tokens(results[0][600])
        assert len(said) == answer
        second = task(601, first.prompt + tuple(said) + tail(200))
        expected = reference_tokens(model_dir, [first, second])
        assert said == expected[600]
        for r in range(2):
            instance.wait_stats(r, lambda s: s.running == () and s.cached_tokens == grown)
        results = run(instance, [second])
        for r in range(2):
            assert tokens(results[r][601]) == expected[601]
            assert results[r][601][-1].cached_tokens == grown > kept  # not only the first turn's prompt
    finally:
        instance.stop()
