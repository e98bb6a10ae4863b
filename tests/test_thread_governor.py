"""The decode steps' thread count (:mod:`shardline.runner.threads`): a table of measured
step times in, the count of each next step out."""

import pytest

from shardline.runner.threads import PROBE_EVERY, PROBE_MOST, TRIAL, ThreadGovernor

pytestmark = pytest.mark.fast


def run(governor: ThreadGovernor, times: dict[int, float], steps: int, rows: int = 1) -> list[int]:
    """The counts ``steps`` decode steps ran at, each taking ``times[count]`` seconds."""
    ran = []
    for _ in range(steps):
        ran.append(governor.threads)
        governor.timed(rows, times[governor.threads])
    return ran


def test_a_quiet_machine_keeps_every_thread_but_for_a_probe_every_128_steps():
    governor = ThreadGovernor(2)
    ran = run(governor, {2: 0.010, 1: 0.016}, 3 * PROBE_EVERY + 10)
    assert ran.count(1) <= 3 and governor.threads == 2
    assert all(ran[i] == 2 for i in range(PROBE_EVERY))  # the first probe after 128 steps


def test_a_busy_core_drops_a_thread_at_once_and_keeps_one():
    """Two threads' steps jump from 10 ms to 400 ms (a core taken): after two such steps
    one thread is probed, 20 ms, and kept; later probes of two lose and their wait
    doubles."""
    governor = ThreadGovernor(2)
    run(governor, {2: 0.010, 1: 0.016}, 20)
    ran = run(governor, {2: 0.400, 1: 0.020}, 2000)
    assert ran[:4] == [2, 2, 1, 1] and governor.threads == 1
    probes = [i for i, t in enumerate(ran) if t == 2][1:]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 2 * gaps[0]  # backing off
    assert governor.interval <= PROBE_MOST


def test_when_the_core_is_free_again_a_probe_takes_two_threads_back():
    governor = ThreadGovernor(2)
    run(governor, {2: 0.010, 1: 0.016}, 20)
    run(governor, {2: 0.400, 1: 0.020}, 50)
    assert governor.threads == 1
    run(governor, {2: 0.010, 1: 0.016}, PROBE_MOST + 10)
    assert governor.threads == 2


def test_another_batch_size_starts_the_history_and_a_probe_across_it_goes_back():
    governor = ThreadGovernor(2)
    run(governor, {2: 0.010, 1: 0.016}, PROBE_EVERY)  # the next step is a probe at 1
    assert governor.threads == 1 and governor.probing == 2
    governor.timed(3, 0.005)  # a step of 3 rows: not compared with 1-row steps
    assert governor.threads == 2 and governor.probing is None and governor.recent == {}


def test_a_batch_that_changes_every_few_steps_still_gets_its_probes():
    """Stuck at one thread after a busy spell, on a machine quiet again, with the batch
    changing every 3 steps: a probe of two threads still comes, and wins."""
    governor = ThreadGovernor(2, threads=1)
    for step in range(3 * PROBE_MOST):
        governor.timed(1 + step // 3 % 2, {2: 0.010, 1: 0.016}[governor.threads])
    assert governor.threads == 2


@pytest.mark.parametrize("most", [0, 1])
def test_one_thread_is_never_governed(most):
    governor = ThreadGovernor(most)
    assert run(governor, {1: 0.5}, 300) == [1] * 300


def test_a_probe_that_won_by_luck_goes_back_after_its_trial():
    """Under a busy core, one probe step at two threads falls in a quiet slice (8 ms
    against one thread's 20): adopted, then the next steps at two take 400 ms, and the
    governor goes back to one once :data:`TRIAL` steps at two (the probe's among them)
    are timed."""
    governor = ThreadGovernor(2, threads=1)
    run(governor, {1: 0.020}, PROBE_EVERY)  # the next step is a probe at 2
    assert governor.threads == 2 and governor.probing == 1
    governor.timed(1, 0.008)
    assert governor.threads == 2 and governor.trial is not None
    ran = run(governor, {2: 0.400, 1: 0.020}, 50)
    assert ran[: TRIAL - 1] == [2] * (TRIAL - 1) and ran[TRIAL - 1 :] == [1] * (51 - TRIAL)
    assert governor.interval == 2 * PROBE_EVERY


def test_one_slow_step_is_a_hiccup_not_a_busy_core():
    governor = ThreadGovernor(2)
    run(governor, {2: 0.010, 1: 0.016}, 20)
    governor.timed(1, 0.300)  # a collection, say
    assert run(governor, {2: 0.010, 1: 0.016}, 50) == [2] * 50


def test_prefill_and_decode_give_the_same_bits_at_one_and_two_threads(tmp_path):
    """What lets the governor change the count between steps: a tiny int4-plane model's
    prefill chunks (96 tokens through the prefill products, then 12 through the fused
    layers) and decode steps, at 2 threads and at 1, are the same bits."""
    import tiny_models as tm
    import torch

    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights

    model = tm.hf_model("qwen3", num_layers=2, seed=4)
    names = tuple(
        f"blk.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    )
    source = open_weights(tm.write_gguf(model, tmp_path / "m.gguf", arch="qwen3", q8_0=names))
    shard = load_shard(source, 0, 2, dtype=torch.bfloat16)
    tokens = torch.randint(0, tm.VOCAB, (108,), generator=torch.Generator().manual_seed(1)).tolist()
    held = torch.get_num_threads()
    results = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            cache = tm.new_cache(shard, context=128)
            with torch.inference_mode():
                first = tm.prefill(shard, cache, tokens[:96])
                second = tm.prefill(shard, cache, tokens[96:], start=96)
                step = tm.decode(shard, cache, [5], [0], [108])
            results.append((first, second, step))
    finally:
        torch.set_num_threads(held)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_the_governor_times_no_step_that_carried_drafts(tmp_path):
    """A speculating sequence's steps have 1 to 16 rows more than it has sequences: the
    engine times only its steps without drafts for the governor (a tiny model whose
    greedy output repeats its prompt, drafted by prompt lookup)."""
    import queue
    import random
    from dataclasses import replace

    import tiny_models as tm
    import torch

    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights
    from shardline.parallel.pipeline import PipelineStage
    from shardline.runner.engine import Engine
    from shardline.runner.protocol import SamplingParams, Task, TokenEvent, Tokens

    tm.save_hf(tm.hf_model("llama", num_layers=2, seed=3), tmp_path)
    shard = load_shard(open_weights(tmp_path), 0, 2, dtype=torch.float32)
    rng = random.Random(1)
    prompt = tuple(rng.randrange(tm.VOCAB) for _ in range(40)) * 3

    def steps(drafts: int) -> tuple[int, int, int]:
        """Tokens drafted, decode steps the engine timed and decode steps it ran (all
        but the prompt's), for one task of 60 tokens."""
        stage = PipelineStage(shard, tm.new_cache(shard, slots=2, context=512), 0, 1)
        governor = ThreadGovernor(1)
        timed: list[int] = []
        governor.timed = lambda rows, seconds: timed.append(rows) or 1  # type: ignore[method-assign]
        sent: list = []
        engine = Engine(stage, queue.Queue(), sent.append, "n", None, 2, 512, 64, 64, 1024, threads=governor)
        params = replace(SamplingParams(temperature=0.0), draft_tokens=drafts)
        engine.inbox.put(Task(1, "n", prompt, 60, params))
        for step in range(1, 200):
            engine.step()
            if any(
                isinstance(e, TokenEvent) and e.finish_reason for m in sent if isinstance(m, Tokens) for e in m.events
            ):
                return engine.drafted_tokens, len(timed), step - 1
        raise AssertionError("the task did not end")

    assert steps(0) == (0, 59, 59)  # every decode step after the prefill's token
    drafted, timed, ran = steps(8)
    assert drafted > 0 and timed < ran


def test_a_governor_without_times_takes_the_free_cpus_count_until_its_steps_say_otherwise():
    governor = ThreadGovernor(2)
    assert governor.unseeded
    assert governor.seed(1) == 1 and not governor.unseeded  # one core taken elsewhere
    ran = run(governor, {2: 0.400, 1: 0.020}, 300)
    assert ran.count(2) == 1 and governor.threads == 1  # one probe of two, lost
    assert ThreadGovernor(2).seed(5) == 2 and ThreadGovernor(2).seed(0) == 1


class Reading:
    """The other processes' load as the engine reads it (``OtherLoad``'s part it uses):
    ``others`` busy cores of 2, None while no reading spans 0.1 s."""

    cpus = 2

    def __init__(self, others: float | None) -> None:
        self.others = others

    def cores(self) -> float | None:
        return self.others

    def sample(self) -> None:
        pass


@pytest.fixture
def fresh_engine(tmp_path):
    """A function that gives a tiny model's engine with a fresh governor of two threads
    and ``load`` for its readings, one task queued (torch's thread count restored after)."""
    import queue

    import tiny_models as tm
    import torch

    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights
    from shardline.parallel.pipeline import PipelineStage
    from shardline.runner.engine import Engine
    from shardline.runner.protocol import SamplingParams, Task

    tm.save_hf(tm.hf_model("llama", num_layers=2, seed=3), tmp_path)
    shard = load_shard(open_weights(tmp_path), 0, 2, dtype=torch.float32)

    def make(governor: ThreadGovernor | None, load: Reading, prompt: tuple[int, ...] = (5, 6, 7, 8)) -> Engine:
        stage = PipelineStage(shard, tm.new_cache(shard, slots=2, context=256), 0, 1)
        engine = Engine(
            stage, queue.Queue(), lambda m: None, "n", None, 2, 256, 64, 64, 1024, threads=governor, other_load=load
        )  # type: ignore[arg-type]
        engine.inbox.put(Task(1, "n", prompt, 8, SamplingParams(temperature=0.0)))
        return engine

    before = torch.get_num_threads()
    yield make
    torch.set_num_threads(before)


def test_a_fresh_runner_decodes_at_the_count_the_free_cpus_give(fresh_engine):
    """The first decode steps of a runner whose machine has a core busy elsewhere run at
    one thread, not at the configured two."""
    import torch

    governor = ThreadGovernor(2)
    engine = fresh_engine(governor, Reading(1.0))
    engine.step()  # the prefill
    engine.step()  # the first decode step
    assert governor.seeded and governor.threads == 1 and torch.get_num_threads() == 1


def test_a_fresh_runner_without_a_reading_yet_keeps_its_count_and_seeds_later(fresh_engine):
    """A decode step before the free-CPU reading spans 0.1 s runs at the configured
    count and leaves the governor unseeded, so a later step seeds it."""
    governor = ThreadGovernor(2)
    governor.timed = lambda rows, seconds: governor.threads  # type: ignore[method-assign]
    load = Reading(None)
    engine = fresh_engine(governor, load)
    engine.step()  # the prefill
    engine.step()  # a decode step: no reading yet
    assert governor.unseeded and governor.threads == 2
    load.others = 1.0
    engine.step()
    assert governor.seeded and governor.threads == 1


def threads_of_forwards(engine) -> list[int]:
    """The torch thread count of each forward pass of ``engine``'s shard, as they run."""
    import torch

    counts: list[int] = []
    shard = engine.stage.shard
    forward = shard.forward

    def counted(*args, **kwargs):
        counts.append(torch.get_num_threads())
        return forward(*args, **kwargs)

    shard.forward = counted  # type: ignore[method-assign]
    return counts


def test_a_prompt_prefilled_in_one_step_reads_the_free_cpus_at_each_chunk(fresh_engine):
    """A step that prefills a prompt in several chunks reads the free CPUs again before
    each chunk after the first: a core taken when the step began (a client's burst just
    before its request) costs the first chunk a thread, not the whole prompt."""
    readings = iter([1.0] + [0.0] * 50)
    load = Reading(None)
    load.cores = lambda: next(readings)  # type: ignore[method-assign]
    engine = fresh_engine(ThreadGovernor(2), load, tuple(3 + i % 50 for i in range(200)))
    counts = threads_of_forwards(engine)
    engine.step()  # the whole prompt: chunks of 64, 64, 64, 8 rows
    assert counts == [1, 2, 2, 2]


@pytest.mark.parametrize("others, prefill_threads", [(0.0, 2), (1.0, 1), (None, 1)])
def test_a_pipeline_stage_prefills_on_the_free_cpus_and_decodes_at_its_count(fresh_engine, others, prefill_threads):
    """A rank of several has no governor: its prefill steps ask for the threads the free
    CPUs give, its decode steps run at the count it started with (the configured one)."""
    import torch

    torch.set_num_threads(1)
    engine = fresh_engine(None, Reading(others))
    counts = threads_of_forwards(engine)
    engine.step()  # the prefill
    engine.step()  # a decode step
    assert counts == [prefill_threads, 1] and torch.get_num_threads() == 1


@pytest.mark.parametrize("held_elsewhere, prefill_threads", [(0, 2), (1, 1)])
def test_a_pipeline_stage_computes_on_the_slots_the_others_leave(
    fresh_engine, tmp_path, held_elsewhere, prefill_threads
):
    """The prefill's two threads are two compute slots of one thread: where another
    runner of the machine computes in one of them, the stage takes the other alone."""
    import contextlib

    import torch

    from shardline.parallel.compute_slots import ComputeSlots

    torch.set_num_threads(1)
    engine = fresh_engine(None, Reading(0.0))
    engine.stage.slots = ComputeSlots(2, tmp_path / "slots", threads=1)
    other = ComputeSlots(2, tmp_path / "slots")
    counts = threads_of_forwards(engine)
    with other.held() if held_elsewhere else contextlib.nullcontext():
        engine.step()
    assert counts == [prefill_threads] and torch.get_num_threads() == 2  # the step's, asked for
