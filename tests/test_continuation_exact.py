"""A continuation (a stream's prompt and the output it gave, run again on another
instance: ``SamplingParams.resumed``) computes that output's rows as the interrupted
decode steps did, so in bfloat16 its next tokens' logits have the bits the undisturbed
run's had (one engine in this process; a tiny int4 Qwen3 whose decode steps and chunks of
up to 64 rows run the compiled layers, where they are built)."""

from __future__ import annotations

import queue
import random
from dataclasses import replace

import pytest
import tiny_models as tm
import torch

from shardline.models.kernel_library import kernels
from shardline.parallel.pipeline import PipelineStage
from shardline.runner.engine import Engine
from shardline.runner.protocol import SamplingParams, Task, TokenEvent, Tokens

pytestmark = pytest.mark.timeout(120)


class Recording(Engine):
    """An engine that keeps every row of logits each task's tokens were sampled from."""

    sampled: dict[int, list[torch.Tensor]]

    def _sample_and_advance(self, plan, seqs, logits):
        for seq, row in zip(seqs, logits):
            self.sampled.setdefault(seq.task.task_id, []).append(row.clone())
        super()._sample_and_advance(plan, seqs, logits)


def run(shard, task: Task) -> tuple[list[int], list[torch.Tensor]]:
    """``task`` run alone to its end on a fresh engine (512-token chunks, the prefix cache
    on): its tokens and the logits each was sampled from."""
    sent: list = []
    stage = PipelineStage(shard, tm.new_cache(shard, slots=2, context=1536), 0, 1)
    engine = Recording(stage, queue.Queue(), sent.append, "n", None, 2, 1536, 512, 512, 4096, prefix_cache=True)
    engine.sampled = {}
    engine.inbox.put(task)
    tokens: list[int] = []
    for _ in range(400):
        engine.step()
        for message in sent:
            for event in message.events if isinstance(message, Tokens) else ():
                if isinstance(event, TokenEvent):
                    tokens.append(event.token_id)
                    if event.finish_reason is not None:
                        return tokens, engine.sampled[task.task_id]
        sent.clear()
    raise AssertionError("the task did not end")


@pytest.mark.skipif(kernels() is None, reason="no compiled kernels: decode and chunks take the torch layers")
@pytest.mark.parametrize("prompt_len, given", [(300, 25), (530, 90), (200, 1)], ids=lambda v: str(v))
def test_a_continuation_gives_the_undisturbed_runs_bits(blocks_of_32, prompt_len, given):
    rng = random.Random(prompt_len)
    prompt = tuple(rng.randrange(tm.VOCAB) for _ in range(prompt_len))
    greedy = SamplingParams(temperature=0.0)
    tokens, logits = run(blocks_of_32, Task(1, "n", prompt, given + 20, greedy))
    assert len(tokens) == given + 20
    cont = Task(2, "n", prompt + tuple(tokens[:given]), 20, replace(greedy, resumed=given))
    rest, rest_logits = run(blocks_of_32, cont)
    assert rest == tokens[given:]
    for mine, theirs in zip(rest_logits, logits[given:], strict=True):
        assert torch.equal(mine, theirs)  # bit for bit: the given rows had decode's bits
