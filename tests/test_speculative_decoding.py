"""Speculative decoding by prompt lookup (``SamplingParams.draft_tokens``): a sequence's
drafted tokens ride in the decode rows, and it takes the tokens decoding would have given
(greedy's, or a seeded sample's, drawn as decoding draws them), so its text is the text
without speculation, alone or beside others, in fewer steps where its output repeats (one engine in this process, tiny random
models: int4 with the compiled decode layers where they are built, bfloat16 and float32
through torch's)."""

from __future__ import annotations

import queue
import random
from dataclasses import replace

import pytest
import tiny_models as tm
import torch

from shardline.parallel.pipeline import PipelineStage
from shardline.runner.engine import Engine
from shardline.runner.protocol import EngineStats, SamplingParams, Task, TokenEvent, Tokens
from shardline.runner.speculation import MAX_DRAFT_TOKENS, accepted, default_drafts

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def torch_layers(request, tmp_path_factory):
    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights

    path = tmp_path_factory.mktemp("tiny-llama")
    tm.save_hf(tm.hf_model("llama", num_layers=2, seed=3), path)
    return load_shard(open_weights(path), 0, 2, dtype=getattr(torch, request.param))


def run(shard, tasks: list[Task], default_drafts: int = 0, **engine_args) -> tuple[dict[int, list[int]], int]:
    """``tasks`` sent together to a fresh engine (4 slots, 64-token chunks; a request that
    names no draft drafts ``default_drafts``; ``engine_args``: more of its arguments), run
    to their ends: each one's tokens, and the steps it took."""
    sent: list = []
    stage = PipelineStage(shard, tm.new_cache(shard, slots=4, context=1024), 0, 1)
    engine = Engine(
        stage, queue.Queue(), sent.append, "n", None, 4, 1024, 64, 64, 4096, draft_tokens=default_drafts, **engine_args
    )
    for task in tasks:
        engine.inbox.put(task)
    tokens: dict[int, list[int]] = {t.task_id: [] for t in tasks}
    ended: set[int] = set()
    for step in range(1, 1000):
        engine.step()
        for message in sent:
            for event in message.events if isinstance(message, Tokens) else ():
                if isinstance(event, TokenEvent):
                    tokens[event.task_id].append(event.token_id)
                    if event.finish_reason is not None:
                        ended.add(event.task_id)
        sent.clear()
        if len(ended) == len(tasks):
            return tokens, step
    raise AssertionError("the tasks did not end")


def repeating_prompt(seed: int) -> tuple[int, ...]:
    """A prompt that says the same 40 tokens three times: the model's greedy output tends
    to go on repeating, which drafts guess."""
    rng = random.Random(seed)
    piece = tuple(rng.randrange(tm.VOCAB) for _ in range(40))
    return piece * 3


def check_the_same_text_in_fewer_steps(shard) -> None:
    prompt = repeating_prompt(1)
    plain, plain_steps = run(shard, [Task(1, "n", prompt, 60, GREEDY)])
    drafted, drafted_steps = run(shard, [Task(1, "n", prompt, 60, replace(GREEDY, draft_tokens=5))])
    assert drafted == plain
    assert drafted_steps < plain_steps, (drafted_steps, plain_steps)  # drafts were taken


def test_a_speculating_sequence_gives_the_same_text_in_fewer_steps(torch_layers):
    check_the_same_text_in_fewer_steps(torch_layers)


def test_with_the_compiled_decode_layers_too(blocks_of_32):
    check_the_same_text_in_fewer_steps(blocks_of_32)


def test_a_request_that_names_no_draft_takes_the_instances_default(blocks_of_32):
    """On by default (a dense model's instance drafts :func:`default_drafts` tokens for a
    request that names none): the same text in fewer steps; a request's 0 turns it off."""
    prompt = repeating_prompt(1)
    plain, plain_steps = run(blocks_of_32, [Task(1, "n", prompt, 60, replace(GREEDY, draft_tokens=0))], 8)
    default, default_steps = run(blocks_of_32, [Task(1, "n", prompt, 60, GREEDY)], 8)
    off, off_steps = run(blocks_of_32, [Task(1, "n", prompt, 60, GREEDY)], 0)
    assert default == plain == off
    assert default_steps < plain_steps == off_steps


@pytest.mark.fast
@pytest.mark.parametrize(
    "params,default,drafts",
    [
        (GREEDY, 16, 16),  # names none: the instance's
        (GREEDY, 0, 0),
        (replace(GREEDY, draft_tokens=0), 16, 0),  # asked off
        (replace(GREEDY, draft_tokens=4), 0, 4),  # asked on where the default is off
        (SamplingParams(temperature=0.7, seed=1), 16, 16),  # sampled too
        (replace(GREEDY, logprobs=2), 16, 0),  # each drafted row would need its own
        (replace(GREEDY, grammar="start: /a+/", draft_tokens=4), 16, 0),
    ],
)
def test_drafts_a_request_may_make(params, default, drafts):
    assert params.drafts(default) == drafts


@pytest.mark.fast
@pytest.mark.parametrize(
    "draft,taken,n",
    [
        ((5, 6, 7), (5, 6, 9), 2),  # two matched, then the one sampled after them
        ((5, 6, 7), (5, 6, 7, 8), 3),  # the whole draft, and one more
        ((5, 6, 7), (4,), 0),
        ((5, 6, 7), (5,), 1),  # finished on the first drafted token
        ((), (4,), 0),
    ],
)
def test_accepted_counts_the_drafted_tokens_taken(draft, taken, n):
    assert accepted(draft, taken) == n


def test_the_engine_counts_drafted_and_accepted_tokens(blocks_of_32):
    sent: list = []
    stage = PipelineStage(blocks_of_32, tm.new_cache(blocks_of_32, slots=4, context=1024), 0, 1)
    engine = Engine(stage, queue.Queue(), sent.append, "n", None, 4, 1024, 64, 64, 4096, draft_tokens=8)
    engine.inbox.put(Task(1, "n", repeating_prompt(1), 60, GREEDY))
    for _ in range(200):
        engine.step()
        stats = [m for m in sent if isinstance(m, EngineStats)]
        if stats and stats[-1].running == () and stats[-1].steps > 1:
            break
    last = stats[-1]
    assert 0 < last.accepted_tokens <= last.drafted_tokens, last
    assert (last.drafted_tokens, last.accepted_tokens) == (engine.drafted_tokens, engine.accepted_tokens)


@pytest.mark.fast
def test_on_by_default_for_dense_models_only():
    assert default_drafts(moe=False) == MAX_DRAFT_TOKENS
    assert default_drafts(moe=True) == 0


@pytest.mark.parametrize("temperature", [0.05, 0.8])
def test_a_seeded_sample_is_the_same_text_with_drafts(blocks_of_32, temperature):
    """A seeded sample drafts too: each row is sampled as decoding samples it, one draw a
    token taken, so the text is the same; nearly greedy, drafts are taken (fewer steps)."""
    prompt = repeating_prompt(6)
    seeded = SamplingParams(temperature=temperature, seed=11)
    plain, plain_steps = run(blocks_of_32, [Task(1, "n", prompt, 60, seeded)])
    drafted, drafted_steps = run(blocks_of_32, [Task(1, "n", prompt, 60, replace(seeded, draft_tokens=5))])
    assert drafted == plain and len(set(plain[1])) > 1
    if temperature < 0.1:
        assert drafted_steps < plain_steps, (drafted_steps, plain_steps)


def test_speculation_beside_other_sequences_changes_no_text(blocks_of_32):
    """A speculating sequence, a plain greedy one, a seeded sample and one asking for
    log-probabilities (which does not speculate) together give each one's text alone."""
    rng = random.Random(2)
    other = tuple(rng.randrange(tm.VOCAB) for _ in range(70))
    tasks = [
        Task(1, "n", repeating_prompt(3), 50, replace(GREEDY, draft_tokens=4)),
        Task(2, "n", other, 30, GREEDY),
        Task(3, "n", repeating_prompt(4), 40, SamplingParams(temperature=0.8, seed=5, draft_tokens=4)),
        Task(4, "n", repeating_prompt(5), 40, replace(GREEDY, draft_tokens=4, logprobs=2)),
    ]
    together, _ = run(blocks_of_32, tasks)
    for task in tasks:
        alone, _ = run(blocks_of_32, [task])
        assert together[task.task_id] == alone[task.task_id], task.task_id
        assert len(alone[task.task_id]) == task.max_tokens


def test_two_sequences_draft_side_by_side(blocks_of_32):
    """Up to SPECULATE_MAX_BATCH sequences decoding, drafts ride beside another's row:
    the same texts in fewer steps (more, and drafts wait: the test above)."""
    prompts = (repeating_prompt(3), repeating_prompt(4))
    plain, plain_steps = run(blocks_of_32, [Task(i, "n", p, 50, GREEDY) for i, p in enumerate(prompts)])
    drafted, drafted_steps = run(
        blocks_of_32, [Task(i, "n", p, 50, replace(GREEDY, draft_tokens=4)) for i, p in enumerate(prompts)]
    )
    assert drafted == plain
    assert drafted_steps < plain_steps, (drafted_steps, plain_steps)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sharding", ["pipeline", "tensor"])
def test_every_rank_takes_the_same_drafted_tokens(model_dir, sharding):
    """Two runner processes (float32, gloo): every rank drafts alike and takes the
    sampling rank's tokens, which are the one-shard model's greedy ones."""
    from test_runner_lockstep import NODE

    tasks = [Task(700 + i, NODE, repeating_prompt(10 + i), 40, replace(GREEDY, draft_tokens=4)) for i in range(2)]
    every_rank_takes_the_greedy_tokens(model_dir, sharding, tasks)


def every_rank_takes_the_greedy_tokens(model_dir, sharding: str, tasks: list[Task], **spec) -> list:
    """Run ``tasks`` on an instance of two runner processes (float32, gloo; ``spec``: more
    :class:`RunnerSpec` fields) and check that every rank streams the one-shard model's
    greedy tokens; each rank's last EngineStats once the tasks ended."""
    from test_prefix_cache_runner import run as run_on
    from test_prefix_cache_runner import tokens
    from test_runner_lockstep import Instance, reference_tokens

    from shardline.models.config import Sharding

    instance = Instance(model_dir, 2, max_batch=2, context=512, sharding=Sharding(sharding), **spec)
    try:
        expected = reference_tokens(model_dir, tasks)
        results = run_on(instance, tasks)
        for r in range(2):
            for task in tasks:
                assert tokens(results[r][task.task_id]) == expected[task.task_id]
        return [instance.wait_stats(r, lambda s: s.running == ()) for r in range(2)]
    finally:
        instance.stop()


def test_each_token_says_how_many_draft_rows_its_step_carried(torch_layers):
    """``TokenEvent.drafted``: what the streaming node times plain decode steps by."""
    sent: list = []
    stage = PipelineStage(torch_layers, tm.new_cache(torch_layers, slots=4, context=1024), 0, 1)
    engine = Engine(stage, queue.Queue(), sent.append, "n", None, 4, 1024, 64, 64, 4096)
    engine.inbox.put(Task(1, "n", repeating_prompt(1), 60, replace(GREEDY, draft_tokens=5)))
    events: list[TokenEvent] = []
    while not events or events[-1].finish_reason is None:
        engine.step()
        events += [e for m in sent if isinstance(m, Tokens) for e in m.events if isinstance(e, TokenEvent)]
        sent.clear()
    assert events[0].drafted == 0  # the prefill's token
    drafted = [e.drafted for e in events[1:]]
    assert max(drafted) > 0 and set(drafted) <= set(range(6))  # up to 5 rows a step
    assert 0 in drafted  # and plain steps between (none the repetition's n-grams match)
