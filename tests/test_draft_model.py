"""Speculative decoding with a draft model (:mod:`shardline.runner.draft_model`): the
sampling rank's draft model guesses a sequence's next tokens, the exchange carries them
to every rank, and a step checks them as it checks prompt lookup's: the text is the text
without drafts, in fewer steps where the draft model guesses right (one engine in this
process, tiny random models; the runner processes of a pipeline and a tensor instance in
the slow tier)."""

from __future__ import annotations

import queue
from dataclasses import replace

import pytest
import tiny_models as tm
import torch
from test_speculative_decoding import GREEDY, every_rank_takes_the_greedy_tokens, repeating_prompt, run

from shardline.parallel.pipeline import PipelineStage
from shardline.runner.draft_model import NO_TOKEN, DraftModel, ModelDrafts, common_prefix
from shardline.runner.engine import Engine
from shardline.runner.protocol import SamplingParams, Task

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny float32 Llama (torch's layers): every path gives the same bits for a row."""
    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights

    path = tmp_path_factory.mktemp("tiny-llama-target")
    tm.save_hf(tm.hf_model("llama", num_layers=2, seed=3), path)
    return load_shard(open_weights(path), 0, 2, dtype=torch.float32)


@pytest.fixture(scope="module")
def stranger(tmp_path_factory):
    """Another tiny Llama of the same vocabulary, other weights: a draft model that
    guesses badly."""
    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights

    path = tmp_path_factory.mktemp("tiny-llama-stranger")
    tm.save_hf(tm.hf_model("llama", num_layers=2, seed=9), path)
    return load_shard(open_weights(path), 0, 2, dtype=torch.float32)


def drafting(shard) -> dict:
    """An engine's arguments for drafts by ``shard``."""
    cache = tm.new_cache(shard, slots=4, context=1024)
    return {"model_drafts": True, "draft_model": DraftModel(shard, cache, 64, tm.VOCAB)}


ALWAYS = replace(GREEDY, draft_p_min=0.0)  # a tiny random model is never sure: drafts k tokens


def test_drafts_from_the_target_itself_give_its_text_in_fewer_steps(target):
    prompt = tuple(range(5, 45))  # nothing to look up: only a model guesses
    plain, plain_steps = run(target, [Task(1, "n", prompt, 60, GREEDY)])
    drafted, drafted_steps = run(
        target, [Task(1, "n", prompt, 60, replace(ALWAYS, draft_tokens=4))], **drafting(target)
    )
    assert drafted == plain
    assert drafted_steps < plain_steps / 2, (drafted_steps, plain_steps)  # nearly every draft taken


def test_the_compiled_decode_layers_draft_for_themselves(blocks_of_32):
    """int4 with the fused layers where they are built: the draft's rows computed one by
    one, the check's several at once; the text is still the target's."""
    prompt = repeating_prompt(2)
    plain, plain_steps = run(blocks_of_32, [Task(1, "n", prompt, 50, GREEDY)])
    drafted, drafted_steps = run(
        blocks_of_32, [Task(1, "n", prompt, 50, replace(ALWAYS, draft_tokens=4))], **drafting(blocks_of_32)
    )
    assert drafted == plain
    assert drafted_steps < plain_steps, (drafted_steps, plain_steps)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.8, seed=5)])
def test_a_bad_draft_model_changes_no_text(target, stranger, sampling):
    """Its guesses refused, greedy and seeded sampling give the text without drafts."""
    prompt = tuple(range(3, 70))
    plain, _ = run(target, [Task(1, "n", prompt, 40, sampling)])
    drafted, _ = run(
        target, [Task(1, "n", prompt, 40, replace(sampling, draft_tokens=5, draft_p_min=0.0))], **drafting(stranger)
    )
    assert drafted == plain and len(set(plain[1])) > 1


def test_beside_other_sequences_and_one_that_does_not_speculate(target):
    """Sequences drafting by the model (one near its max_tokens, whose drafts shrink to
    fit), a seeded sample and one asking for log-probabilities (no drafts) give each
    one's text alone."""
    tasks = [
        Task(1, "n", tuple(range(10, 60)), 30, replace(ALWAYS, draft_tokens=6)),
        Task(2, "n", repeating_prompt(4), 3, replace(ALWAYS, draft_tokens=6)),
        Task(3, "n", tuple(range(40, 100)), 25, SamplingParams(temperature=0.7, seed=2, draft_tokens=3, draft_p_min=0)),
        Task(4, "n", tuple(range(20, 50)), 20, replace(GREEDY, logprobs=1)),
    ]
    together, _ = run(target, tasks, **drafting(target))
    for task in tasks:
        alone, _ = run(target, [task])
        assert together[task.task_id] == alone[task.task_id], task.task_id
        assert len(alone[task.task_id]) == task.max_tokens


def test_a_draft_computes_only_what_its_slot_does_not_hold(target):
    """A slot's second draft computes the tokens past those it shares with the first's
    (a refused guess rewritten), and gives what a fresh draft model gives."""
    model = drafting(target)["draft_model"]
    tokens = list(range(7, 47))
    first = model.draft(0, tokens, 4, p_min=0.0)
    assert len(first) == 4 and model.held[0] == tokens + first[:3]
    longer = tokens + [first[0], (first[1] + 1) % tm.VOCAB]  # took one, then another token
    again = model.draft(0, longer, 3, p_min=0.0)
    fresh = drafting(target)["draft_model"].draft(2, longer, 3, p_min=0.0)
    assert again == fresh
    assert model.held[0] == longer + again[:2]


def test_releasing_a_slot_keeps_what_its_cached_prefix_keeps(target):
    model = drafting(target)["draft_model"]
    model.draft(1, list(range(40)), 4, p_min=0.0)
    model.release(1, 32)
    assert model.held[1] == list(range(32))
    model.release(1)
    assert 1 not in model.held


def test_a_draft_ends_where_its_cache_does(target):
    model = DraftModel(target, tm.new_cache(target, slots=1, context=64), 64, tm.VOCAB)
    positions = model.positions
    assert len(model.draft(0, list(range(positions - 2)), 8, p_min=0.0)) == 2
    assert model.draft(0, list(range(positions)), 8, p_min=0.0) == []


def test_a_draft_ends_before_an_id_the_target_lacks(target):
    """A draft model whose vocabulary runs past the target's: its guess of an id the
    target has no row for ends the draft."""
    model = DraftModel(target, tm.new_cache(target, slots=1, context=256), 64, vocab=1)
    assert model.draft(0, list(range(1, 30)), 4, p_min=0.0) == []


@pytest.mark.fast
@pytest.mark.parametrize(
    "places,room,pending,drafted,taken,n",
    [
        ([5, 6, 7, NO_TOKEN], 8, (5, 6, 7), 3, (5, 6, 9), 2),
        ([5, 6, 7, 8], 2, (5, 6), 2, (5, 6, 1), 2),  # cut to the room it has
        ([NO_TOKEN] * 4, 8, (), 0, (4,), 0),  # the draft model doubted its first guess
        ([5, 6, 7, NO_TOKEN], 0, (), 0, (3,), 0),
    ],
)
def test_a_sequences_model_drafts(places, room, pending, drafted, taken, n):
    drafts = ModelDrafts(4)
    drafts.received(places)
    assert drafts.draft(room) == pending
    assert drafts.took(drafted, taken) == n
    assert drafts.draft(8) == ()  # the next comes with the exchange


@pytest.mark.fast
@pytest.mark.parametrize("a,b,n", [([1, 2, 3], [1, 2, 4], 2), ([], [1], 0), ([1, 2], [1, 2, 3], 2), ([2], [1], 0)])
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == n


def test_the_sampling_rank_needs_the_draft_model(target):
    stage = PipelineStage(target, tm.new_cache(target, slots=4, context=1024), 0, 1)
    with pytest.raises(ValueError, match="draft model"):
        Engine(stage, queue.Queue(), lambda _: None, "n", None, 4, 1024, 64, 64, 4096, model_drafts=True)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sharding", ["pipeline", "tensor"])
def test_every_rank_takes_the_draft_models_tokens(model_dir, sharding):
    """Two runner processes (float32, gloo), the model its own draft model on the
    sampling rank: every rank takes the sampling rank's tokens, the one-shard model's
    greedy ones, and the drafts were taken."""
    from test_runner_lockstep import NODE

    asks = replace(GREEDY, draft_tokens=4, draft_p_min=0.0)  # a tiny random model is never sure
    tasks = [Task(800 + i, NODE, tuple(range(3 + i, 40 + i)), 40, asks) for i in range(2)]
    stats = every_rank_takes_the_greedy_tokens(
        model_dir, sharding, tasks, model_drafts=True, draft_model_path=str(model_dir)
    )
    for s in stats:
        assert 0 < s.accepted_tokens <= s.drafted_tokens, s


@pytest.mark.fast
def test_openai_speculative_p_min_reaches_the_task():
    """llama.cpp's per-request ``speculative.p_min`` (0 to 1) goes with the request's
    sampling; out of range it is refused, naming it."""
    from pydantic import ValidationError

    from shardline.api.openai import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    asked = ChatCompletionRequest.model_validate({**body, "speculative.p_min": 0.5, "speculative.n_max": 8})
    assert (asked.sampling().draft_p_min, asked.sampling().draft_tokens) == (0.5, 8)
    assert ChatCompletionRequest.model_validate(body).sampling().draft_p_min is None
    with pytest.raises(ValidationError, match="speculative.p_min"):
        ChatCompletionRequest.model_validate({**body, "speculative.p_min": 1.5})


def test_a_draft_ends_before_a_guess_it_doubts(target):
    """At ``p_min`` 0.75 a tiny random model (its guesses under it) drafts nothing; at
    the default, llama.cpp's 0, the whole ``k``."""
    model = drafting(target)["draft_model"]
    assert model.draft(0, list(range(5, 40)), 4, p_min=0.75) == []
    assert len(model.draft(0, list(range(5, 40)), 4)) == 4


@pytest.mark.fast
def test_a_draft_model_drafts_llama_cpps_three_tokens_by_default():
    from shardline.runner.speculation import DRAFT_MODEL_TOKENS, MAX_DRAFT_TOKENS, default_drafts

    assert default_drafts(moe=False, draft_model=True) == DRAFT_MODEL_TOKENS == 3
    assert default_drafts(moe=False) == MAX_DRAFT_TOKENS
    assert default_drafts(moe=True, draft_model=True) == 0


@pytest.fixture(scope="module")
def smollm2_tokenizer_dir(tmp_path_factory):
    from shardline.models.store import default_model_path
    from shardline.models.tokenizer import Tokenizer

    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    Tokenizer(default_model_path()).save(directory)
    return directory


def _edited(source, target, edit) -> object:
    """A copy of the tokenizer files in ``source`` with ``edit(name, text) -> text``
    applied to each, loaded."""
    import shutil

    from shardline.models.tokenizer import Tokenizer

    shutil.copytree(source, target)
    for path in target.iterdir():
        path.write_text(edit(path.name, path.read_text()))
    return Tokenizer(target)


def _swap_two_tokens(name: str, text: str) -> str:
    import json

    if name != "tokenizer.json":
        return text
    data = json.loads(text)
    vocab = data["model"]["vocab"]
    a, b = "Paris", "London"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return json.dumps(data)


def _other_end(name: str, text: str) -> str:
    return text.replace('"eos_token_id": [2]', '"eos_token_id": [0]') if name == "generation_config.json" else text


@pytest.mark.parametrize(
    "edit,reason", [(lambda _name, text: text, None), (_swap_two_tokens, "token"), (_other_end, "end-of-sequence ids")]
)
def test_a_draft_model_needs_the_targets_tokenizer(smollm2_tokenizer_dir, tmp_path, edit, reason):
    """llama.cpp's check: the same pieces for the same ids, and the same end ids."""
    from shardline.models.tokenizer import Tokenizer, draft_mismatch

    target = Tokenizer(smollm2_tokenizer_dir)
    mismatch = draft_mismatch(target, _edited(smollm2_tokenizer_dir, tmp_path / "draft", edit))
    assert (mismatch is None) if reason is None else (reason in mismatch)


def test_the_draft_model_follows_the_prompts_prefill_chunk_by_chunk(target):
    """A prompt's keys and values reach the draft model as the target's prefill chunks
    end (64 tokens each here), so its first draft computes one token, not the prompt."""
    args = drafting(target)
    model = args["draft_model"]
    caught_up: list[int] = []
    extend = model.extend
    model.extend = lambda slot, tokens: (caught_up.append(len(tokens)), extend(slot, tokens))
    prompt = tuple(3 + i % 120 for i in range(200))
    alone, _ = run(target, [Task(1, "n", prompt, 8, GREEDY)])
    drafted, _ = run(target, [Task(1, "n", prompt, 8, replace(ALWAYS, draft_tokens=3))], **args)
    assert drafted == alone
    assert caught_up == [64, 128, 192, 200]


def test_no_draft_is_made_for_a_step_that_carries_none(target):
    """Three sequences decoding: the next step carries no drafts (step_plan.draft_room),
    so the draft model drafts nothing for them."""
    args = drafting(target)
    model = args["draft_model"]
    asked: list[int] = []
    draft = model.draft
    model.draft = lambda slot, tokens, k, p_min: (asked.append(k), draft(slot, tokens, k, p_min))[1]
    tasks = [Task(i, "n", tuple(range(10 + i, 50 + i)), 12, replace(ALWAYS, draft_tokens=4)) for i in range(3)]
    together, _ = run(target, tasks, **args)
    assert asked and set(asked) == {0}
    for task in tasks:
        assert together[task.task_id] == run(target, [task])[0][task.task_id]


@pytest.mark.fast
@pytest.mark.parametrize("listed,refused", [("draft_model", True), ("model_id", True), (None, False)])
def test_removing_a_draft_models_files_is_refused_while_an_instance_drafts_with_it(
    tmp_path, monkeypatch, listed, refused
):
    """``shardline models remove`` keeps the files of a model an instance serves, as its
    model or its draft model (a node without them cannot place it again)."""
    import argparse

    from shardline import cluster_commands
    from shardline.cluster_commands import CommandError, _models_remove

    (tmp_path / "models" / "small").mkdir(parents=True)
    instance = {"instance_id": "abc", "model_id": "big", "draft_model": None, "status": "ready"}
    if listed is not None:
        instance[listed] = "small"
    monkeypatch.setattr(cluster_commands, "_request", lambda *a, **k: {"instances": [instance]})
    args = argparse.Namespace(model_id="small", data_dir=str(tmp_path), force=False)
    if refused:
        with pytest.raises(CommandError, match="abc"):
            _models_remove(args)
    else:
        _models_remove(args)
    assert (tmp_path / "models" / "small").exists() == refused


def test_a_draft_model_that_does_not_load_is_named_in_the_error(tmp_path, model_dir):
    """A rank's failure is reported by its text: a draft model whose files do not load
    says it is the draft model's."""
    from shardline.models.config import RankShare
    from shardline.runner.__main__ import DraftModelLoadError, load_draft_model
    from shardline.runner.protocol import RunnerSpec

    spec = RunnerSpec("i", "n", str(model_dir), 0, 1, RankShare(0, 4), "127.0.0.1", 1, draft_model_path=str(tmp_path))
    with pytest.raises(DraftModelLoadError, match=f"the draft model {tmp_path}"):
        load_draft_model(spec, torch.float32, torch.device("cpu"), tm.VOCAB)


@pytest.mark.fast
def test_shardline_instances_shows_the_draft_model(monkeypatch, capsys):
    import argparse

    from shardline import cluster_commands

    instance = {
        "instance_id": "abc",
        "model_id": "big",
        "draft_model": "small",
        "sharding": "pipeline",
        "dtype": "bfloat16",
        "status": "ready",
        "ranks": [],
    }
    monkeypatch.setattr(cluster_commands, "_request", lambda *a, **k: {"instances": [instance]})
    cluster_commands._instances(argparse.Namespace())
    assert "drafted by small" in capsys.readouterr().out
