"""Constrained decoding and log-probabilities on the sampling rank.

Unit level: :class:`shardline.runner.constraint.Constraint` with SmolLM2's tokenizer on
random logits. Engine level: real runner processes (tests/test_runner_lockstep.py's
Instance) serving a tiny random llama with SmolLM2's vocabulary and tokenizer: a
constrained sequence in a batch of 8 leaves the other 7 greedy sequences' tokens as they
are without it, and the emitting ranks of a pipeline get the log-probabilities one rank
computes.
"""

from __future__ import annotations

import json
import math
import queue
import random
import time

import pytest
import tiny_models as tm
import torch
from test_runner_lockstep import NODE, Instance

from shardline.api.structured import json_grammar, lark_grammar
from shardline.runner.constraint import Constraint, GrammarTokenizer
from shardline.runner.protocol import Failed, PrefillProgress, SamplingParams, Task, TokenEvent, Tokens
from shardline.runner.sampling import Sampler

IM_END = 2  # SmolLM2's <|im_end|>, its end-of-turn token
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tm.save_with_tokenizer(tmp_path_factory.mktemp("tiny-smol"), seed=11)


@pytest.fixture(scope="module")
def grammar_tokenizer(model_dir):
    return GrammarTokenizer(str(model_dir))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from shardline.models.tokenizer import Tokenizer

    return Tokenizer(model_dir)


def run_constrained(sampler: Sampler, seed: int, steps: int = 60) -> list[int]:
    """Tokens a sampler picks from random logits until a stop token (at most ``steps``)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(steps):
        logits = torch.randn(tm.SMOLLM2_VOCAB, generator=gen) * 3
        before = logits.clone()
        token = sampler.sample(logits)
        assert torch.equal(logits, before)  # the row itself is never modified
        out.append(token)
        if token == IM_END:
            break
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_json_schema_constraint_gives_json_matching_the_schema_then_the_stop_token(
    grammar_tokenizer, tokenizer, seed
):
    constraint = Constraint.start(json_grammar(SCHEMA), grammar_tokenizer, (IM_END,))
    assert constraint.failed is None
    sampler = Sampler(SamplingParams(temperature=0.0), constraint=constraint)
    tokens = run_constrained(sampler, seed)
    assert tokens[-1] == IM_END, tokenizer.decode(tokens)
    value = json.loads(tokenizer.decode(tokens[:-1]))
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
    assert constraint.finished
    assert torch.nonzero(constraint.allowed(tm.SMOLLM2_VOCAB)).flatten().tolist() == [IM_END]


@pytest.mark.timeout(60)
def test_a_sampled_constraint_stays_within_a_lark_grammar(grammar_tokenizer, tokenizer):
    grammar = lark_grammar('start: ("yes" | "no") " " /[a-z]{2,4}/')
    for seed in range(3):
        sampler = Sampler(
            SamplingParams(temperature=1.0, seed=seed),
            constraint=Constraint.start(grammar, grammar_tokenizer, (IM_END,)),
        )
        tokens = run_constrained(sampler, 100 + seed)
        assert tokens[-1] == IM_END
        first, rest = tokenizer.decode(tokens[:-1]).split(" ")
        assert first in ("yes", "no") and rest.isalpha() and 2 <= len(rest) <= 4


@pytest.mark.timeout(60)
def test_a_grammar_that_does_not_compile_ends_the_sequence_without_raising(grammar_tokenizer):
    constraint = Constraint.start('{"grammars": [{"lark_grammar": "start: nope"}]}', grammar_tokenizer, (IM_END, 0))
    assert constraint.failed is not None and "nope" in constraint.failed
    allowed = constraint.allowed(tm.SMOLLM2_VOCAB)
    assert torch.nonzero(allowed).flatten().tolist() == [0, IM_END]
    sampler = Sampler(SamplingParams(temperature=0.0), constraint=constraint)
    assert sampler.sample(torch.randn(tm.SMOLLM2_VOCAB)) in (0, IM_END)

    def broken():
        raise RuntimeError("no tokenizer files")

    constraint = Constraint.start(json_grammar(None), broken, (IM_END,))
    assert "no tokenizer files" in (constraint.failed or "")
    # Without stop tokens nothing could end it: it runs unconstrained (and says so in the log).
    assert bool(Constraint.start("junk", broken, ()).allowed(10).all())


# -- engine level -------------------------------------------------------------------------


def collect_events(instance: Instance, task_ids: set[int], timeout: float = 90) -> list[dict[int, list[TokenEvent]]]:
    """Per rank: task id -> its TokenEvents until each finished."""
    results = []
    for r, rank in enumerate(instance.ranks):
        out: dict[int, list[TokenEvent]] = {t: [] for t in task_ids}
        done: set[int] = set()
        deadline = time.time() + timeout
        while done != task_ids:
            try:
                message = rank.inbox.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                raise TimeoutError(f"rank {r}: tasks {task_ids - done} unfinished") from None
            assert not isinstance(message, Failed), f"rank {r} failed: {message.error}"
            if not isinstance(message, Tokens):
                continue
            for event in message.events:
                if isinstance(event, PrefillProgress):
                    continue
                out[event.task_id].append(event)
                if event.finish_reason is not None:
                    done.add(event.task_id)
        results.append(out)
    return results


def prompts(n: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, tm.SMOLLM2_VOCAB) for _ in range(4 + 3 * i)) for i in range(n)]


@pytest.mark.timeout(300)
def test_a_constrained_sequence_in_a_batch_of_8_leaves_the_other_7_unchanged(model_dir, tokenizer):
    greedy = [
        Task(6000 + i, NODE, p, 16, SamplingParams(temperature=0.0), (IM_END,))
        for i, p in enumerate(prompts(7, seed=1))
    ]
    constrained = Task(
        6100, NODE, prompts(1, seed=2)[0], 24, SamplingParams(temperature=0.0, grammar=json_grammar(SCHEMA)), (IM_END,)
    )
    broken = Task(6200, NODE, (5, 6, 7), 8, SamplingParams(temperature=0.0, grammar="junk"), (IM_END,))
    instance = Instance(model_dir, 2, max_batch=8, context=96)
    try:

        def run(tasks: list[Task]) -> dict[int, list[TokenEvent]]:
            for r in range(2):
                for task in tasks:
                    instance.send(r, task)
            per_rank = collect_events(instance, {t.task_id for t in tasks})
            assert per_rank[0] == per_rank[1]  # every rank ends each sequence alike
            return per_rank[0]

        together = run(greedy + [constrained])
        alone = run(greedy)
        for task in greedy:
            assert [e.token_id for e in together[task.task_id]] == [e.token_id for e in alone[task.task_id]]
            assert len(alone[task.task_id]) == 16  # the random model never picks <|im_end|> here
        events = together[constrained.task_id]
        assert events[-1].finish_reason == "stop" and events[-1].token_id == IM_END
        value = json.loads(tokenizer.decode([e.token_id for e in events[:-1]]))
        assert set(value) == {"ok", "n"}
        # A grammar the runner cannot compile ends that sequence; the runner serves on.
        assert [(e.token_id, e.finish_reason) for e in run([broken])[broken.task_id]] == [(IM_END, "stop")]
        again = run(greedy[:1])
        assert [e.token_id for e in again[greedy[0].task_id]] == [e.token_id for e in alone[greedy[0].task_id]]
    finally:
        instance.stop()


@pytest.mark.timeout(300)
def test_the_emitting_ranks_of_a_pipeline_get_the_logprobs_one_rank_computes(model_dir):
    ps = prompts(4, seed=3)
    tasks = [
        Task(7000, NODE, ps[0], 6, SamplingParams(temperature=0.0, logprobs=3), (IM_END,)),
        Task(7001, NODE, ps[1], 6, SamplingParams(temperature=0.0), (IM_END,)),
        Task(7002, NODE, ps[2], 6, SamplingParams(temperature=0.0, logprobs=0), (IM_END,)),
        Task(
            7003, NODE, ps[3], 6, SamplingParams(temperature=0.9, seed=5, logprobs=20, frequency_penalty=0.5), (IM_END,)
        ),
    ]
    results = {}
    for world in (1, 3):
        instance = Instance(model_dir, world, max_batch=4, context=96)
        try:
            for r in range(world):
                for task in tasks:
                    instance.send(r, task)
            results[world] = collect_events(instance, {t.task_id for t in tasks})
        finally:
            instance.stop()
    one = results[1][0]
    for r in range(3):
        assert results[3][r] == results[3][0]  # every emitting rank alike
        for task in tasks:
            got, expected = results[3][r][task.task_id], one[task.task_id]
            assert [e.token_id for e in got] == [e.token_id for e in expected]
            for g, e in zip(got, expected):
                if task.sampling.logprobs is None:
                    assert g.logprob is None and g.top_logprobs == ()
                    continue
                assert g.logprob == pytest.approx(e.logprob, abs=1e-4)
                assert [t for t, _ in g.top_logprobs] == [t for t, _ in e.top_logprobs]
                assert len(g.top_logprobs) == task.sampling.logprobs
                assert sum(math.exp(lp) for _, lp in g.top_logprobs) <= 1 + 1e-5
                if task.sampling.temperature == 0 and g.top_logprobs:
                    assert g.top_logprobs[0] == (g.token_id, g.logprob)
