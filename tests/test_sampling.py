"""shardline.runner.sampling.Sampler: greedy, seeding, top-k, top-p, logit bias, penalties,
min_p and log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from shardline.runner.protocol import SamplingParams
from shardline.runner.sampling import Choice, Sampler

pytestmark = pytest.mark.fast

VOCAB = 50


def _logits(seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=g) * scale


@pytest.mark.timeout(10)
def test_temperature_zero_is_argmax():
    sampler = Sampler(SamplingParams(temperature=0.0, top_p=0.5, top_k=5, seed=1))
    assert sampler.generator is None
    for seed in range(20):
        logits = _logits(seed)
        assert sampler.sample(logits) == int(torch.argmax(logits))
    # Nearly flat logits: still the argmax, every time.
    flat = torch.zeros(VOCAB)
    flat[17] = 1e-4
    assert {sampler.sample(flat) for _ in range(20)} == {17}


@pytest.mark.timeout(10)
def test_same_seed_same_samples_and_other_seed_differs():
    logits = [_logits(s, scale=0.5) for s in range(64)]  # flat enough to sample widely

    def run(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.95, top_k=20, seed=seed))
        return [sampler.sample(x) for x in logits]

    first = run(1234)
    # Other samplers drawing in between (another sequence of the batch) change nothing.
    torch.manual_seed(0)
    torch.rand(100)
    assert run(1234) == first
    assert run(4321) != first
    assert len(set(first)) > 5


@pytest.mark.timeout(10)
def test_seeded_sampler_ignores_the_global_rng():
    logits = _logits(3, scale=0.5)
    a = Sampler(SamplingParams(temperature=1.0, seed=7))
    b = Sampler(SamplingParams(temperature=1.0, seed=7))
    out_a = []
    out_b = []
    for _ in range(50):
        out_a.append(a.sample(logits))
        torch.rand(3)  # global generator traffic between draws
        out_b.append(b.sample(logits))
    assert out_a == out_b


@pytest.mark.timeout(10)
def test_top_k_one_is_argmax():
    sampler = Sampler(SamplingParams(temperature=1.5, top_k=1, seed=5))
    for seed in range(50):
        logits = _logits(seed, scale=0.1)  # near-uniform: any sampling would stray
        assert sampler.sample(logits) == int(torch.argmax(logits))


@pytest.mark.timeout(10)
def test_small_top_p_keeps_only_the_top_token():
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=1e-3, seed=6))
    for seed in range(50):
        logits = _logits(seed, scale=0.1)
        assert sampler.sample(logits) == int(torch.argmax(logits))


@pytest.mark.timeout(10)
def test_top_p_keeps_the_smallest_nucleus():
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps exactly the first two
    # (0.5 < 0.75, 0.5 + 0.3 >= 0.75).
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=8))
    draws = [sampler.sample(probs.log()) for _ in range(2000)]
    assert set(draws) == {1, 3}
    share = draws.count(1) / len(draws)
    assert abs(share - 0.5 / 0.8) < 0.05


@pytest.mark.timeout(10)
@pytest.mark.parametrize("k", [2, 5, 10])
def test_samples_stay_within_top_k(k):
    logits = _logits(11, scale=0.3)  # flat: without the cut-off every token would appear
    allowed = set(torch.topk(logits, k).indices.tolist())
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=k, seed=k))
    draws = [sampler.sample(logits) for _ in range(3000)]
    assert set(draws) == allowed  # never outside the k best, and all of them reachable


@pytest.mark.timeout(10)
def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    cold = Sampler(SamplingParams(temperature=0.25, seed=9))
    hot = Sampler(SamplingParams(temperature=4.0, seed=9))
    cold_share = [cold.sample(logits) for _ in range(2000)].count(0) / 2000
    hot_share = [hot.sample(logits) for _ in range(2000)].count(0) / 2000
    expected_cold = torch.softmax(logits / 0.25, -1)[0].item()  # ~0.98
    expected_hot = torch.softmax(logits / 4.0, -1)[0].item()  # ~0.34
    assert abs(cold_share - expected_cold) < 0.03
    assert abs(hot_share - expected_hot) < 0.05


@pytest.mark.timeout(10)
def test_unseeded_samplers_are_independent():
    logits = _logits(12, scale=0.1)
    a = Sampler(SamplingParams(temperature=1.0))
    b = Sampler(SamplingParams(temperature=1.0))
    assert [a.sample(logits) for _ in range(30)] != [b.sample(logits) for _ in range(30)]


# -- issue 15: logit bias, penalties, min_p, logprobs -----------------------------------


@pytest.mark.timeout(10)
def test_defaults_leave_the_logits_untouched_and_argmax_bit_identical():
    sampler = Sampler(SamplingParams(temperature=0.0))
    assert not sampler.processed and sampler.counts is None and sampler.constraint is None
    for seed in range(20):
        logits = _logits(seed)
        before = logits.clone()
        assert sampler.choose(logits) == Choice(int(torch.argmax(before)))
        assert torch.equal(logits, before)


@pytest.mark.timeout(10)
def test_logit_bias_minus_100_removes_the_token_greedy_would_pick():
    logits = _logits(1)
    best = int(torch.argmax(logits))
    second = int(torch.topk(logits, 2).indices[1])
    sampler = Sampler(SamplingParams(temperature=0.0, logit_bias=((best, -100.0),)))
    assert sampler.sample(logits) == second
    assert int(torch.argmax(logits)) == best  # the model's logits are not modified
    boosted = Sampler(SamplingParams(temperature=0.0, logit_bias=((7, 100.0), (VOCAB + 5, 9.0))))
    assert boosted.sample(logits) == 7  # an id past the vocabulary is ignored


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "frequency,presence,repetition,last_n,expected",
    [
        # token 3: generated twice, in the prompt once; token 4: prompt only; token 5: never.
        (0.5, 0.0, 1.0, 0, {3: 2.0 - 2 * 0.5, 4: -1.0, 5: 1.0}),
        (0.0, 0.7, 1.0, 0, {3: 2.0 - 0.7, 4: -1.0, 5: 1.0}),
        (0.5, 0.7, 1.0, 0, {3: 2.0 - 1.0 - 0.7, 4: -1.0, 5: 1.0}),
        (-0.5, 0.0, 1.0, 0, {3: 2.0 + 1.0, 4: -1.0, 5: 1.0}),  # negative: encourages repeats
        (0.0, 0.0, 2.0, 0, {3: 2.0 / 2, 4: -1.0 * 2, 5: 1.0}),  # CTRL: divide > 0, multiply < 0
        (0.0, 0.0, 2.0, 2, {3: 2.0 / 2, 4: -1.0, 5: 1.0}),  # window of the last 2 of 4, 3, 3, 3: 4 out
        (0.0, 0.0, 2.0, 4, {3: 2.0 / 2, 4: -1.0 * 2, 5: 1.0}),  # 4, 3, 3, 3: all in
        (0.5, 0.0, 2.0, 0, {3: (2.0 - 1.0) / 2, 4: -2.0, 5: 1.0}),  # frequency first, then CTRL
    ],
)
def test_penalties_change_a_repeated_tokens_logit_by_the_right_amount(
    frequency, presence, repetition, last_n, expected
):
    sampler = Sampler(
        SamplingParams(
            temperature=0.0,
            frequency_penalty=frequency,
            presence_penalty=presence,
            repetition_penalty=repetition,
            repeat_last_n=last_n,
        ),
        prompt=(4, 3),
    )
    logits = torch.zeros(VOCAB)
    logits[[3, 4, 5]] = torch.tensor([2.0, -1.0, 1.0])
    for _ in range(2):  # the sampler counts what it picks: force token 3 twice
        forced = logits.clone()
        forced[3] = 1e6
        assert sampler.sample(forced) == 3
    processed = sampler.process(logits)
    for token, value in expected.items():
        assert processed[token].item() == pytest.approx(value), token
    assert processed[0].item() == 0.0  # unseen tokens untouched


@pytest.mark.timeout(10)
def test_repeat_last_n_window_forgets_old_tokens():
    from shardline.runner.sampling import TokenCounts

    counts = TokenCounts(VOCAB, prompt=(1, 2, 2, 3), last_n=3)
    assert counts.window.counts[[1, 2, 3]].tolist() == [0.0, 2.0, 1.0]
    assert sorted(counts.window.ids().tolist()) == [2, 3]
    for token in (4, 5, 6, VOCAB + 3):  # an id past the vocabulary is not counted
        counts.add(token)
    assert counts.window.counts[[2, 3, 4, 5, 6]].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert sorted(counts.window.ids().tolist()) == [5, 6]
    assert counts.generated.counts[[2, 4, 5, 6]].tolist() == [0.0, 1.0, 1.0, 1.0]
    assert sorted(counts.generated.ids().tolist()) == [4, 5, 6]


@pytest.mark.timeout(10)
def test_tally_matches_a_recount_after_many_adds_and_removes():
    import random
    from collections import Counter

    from shardline.runner.sampling import TokenCounts

    rng = random.Random(0)
    prompt = tuple(rng.randrange(VOCAB) for _ in range(30))
    counts = TokenCounts(VOCAB, prompt, last_n=17)
    history = list(prompt)
    for _ in range(500):  # a window sliding over many repeats exercises swap-removal
        token = rng.randrange(VOCAB)
        counts.add(token)
        history.append(token)
        window = Counter(history[-17:])
        assert {int(t): int(counts.window.counts[t]) for t in counts.window.ids()} == dict(window)
    assert sum(counts.generated.counts) == 500


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "min_p,kept",
    [
        # probabilities 0.5, 0.3, 0.15, 0.05 (ids 1, 3, 0, 2): kept where p >= min_p * 0.5
        (0.05, {0, 1, 2, 3}),
        (0.2, {0, 1, 3}),
        (0.5, {1, 3}),
        (0.7, {1}),
        (1.0, {1}),
    ],
)
def test_min_p_keeps_tokens_at_least_min_p_of_the_best(min_p, kept):
    from shardline.runner.sampling import apply_min_p

    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    filtered = apply_min_p(logits, min_p)
    assert set(torch.nonzero(torch.isfinite(filtered)).flatten().tolist()) == kept
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=min_p, seed=3))
    assert {sampler.sample(logits) for _ in range(400)} == kept


@pytest.mark.timeout(10)
def test_top_p_zero_is_greedy():
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.0, seed=4))
    for seed in range(30):
        logits = _logits(seed, scale=0.1)
        assert sampler.sample(logits) == int(torch.argmax(logits))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("k", [0, 1, 5, 20, 50])
def test_logprobs_top_entry_is_the_argmax_at_temperature_zero_and_sum_at_most_one(k):
    sampler = Sampler(SamplingParams(temperature=0.0, logprobs=k))
    for seed in range(10):
        logits = _logits(seed)
        choice = sampler.choose(logits)
        expected = torch.log_softmax(logits, -1)
        assert choice.token == int(torch.argmax(logits))
        assert choice.logprob == pytest.approx(expected[choice.token].item())
        assert len(choice.top) == min(k, 20)
        if k:
            assert choice.top[0] == (choice.token, choice.logprob)
            values = [lp for _, lp in choice.top]
            assert values == sorted(values, reverse=True)
            assert sum(math.exp(lp) for lp in values) <= 1.0 + 1e-6


@pytest.mark.timeout(10)
def test_logprobs_are_the_models_before_the_processors():
    logits = _logits(5)
    best = int(torch.argmax(logits))
    sampler = Sampler(SamplingParams(temperature=0.0, logprobs=2, logit_bias=((best, -100.0),)))
    choice = sampler.choose(logits)
    assert choice.token != best
    assert choice.top[0][0] == best  # the model's own top token, whatever the bias did
    assert choice.logprob == pytest.approx(torch.log_softmax(logits, -1)[choice.token].item())


@pytest.mark.timeout(10)
def test_logprob_table_round_trip():
    from shardline.runner.logprob_tables import logprob_table, logprob_width, read_logprobs

    assert logprob_width([None, None]) is None
    assert logprob_width([None, 0]) == 0
    assert logprob_width([3, 50, None]) == 20
    choices = [Choice(5, -0.25, ((5, -0.25), (9, -2.5), (1, -3.0))), Choice(7), Choice(2, -1.5)]
    table = logprob_table(choices, 3)
    assert table.shape == (3, 7) and table.dtype == torch.float32
    rows = table.tolist()
    assert read_logprobs(rows[0], 3, 2) == (-0.25, ((5, -0.25), (9, -2.5)))
    assert read_logprobs(rows[2], 3, 0) == (-1.5, ())


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "vocab, k",
    [(6, 2), (3, 5), (6, 0), (40, 25)],
    ids=["two of six", "more asked than the vocabulary", "none", "capped at 20"],
)
def test_prompt_logprob_table_reads_back_as_each_rows_target_and_top(vocab, k):
    from shardline.runner.logprob_tables import prompt_logprob_table, read_logprobs
    from shardline.runner.sampling import MAX_TOP_LOGPROBS

    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(vocab))
    targets = torch.tensor([0, vocab - 1, 1, 2])
    width = min(k, MAX_TOP_LOGPROBS)
    table = prompt_logprob_table(logits, targets, k)
    assert table.shape == (4, 1 + 2 * width)
    expected = torch.log_softmax(logits, -1)
    for row, target, logprobs in zip(table.tolist(), targets.tolist(), expected):
        logprob, top = read_logprobs(row, width, width)
        assert logprob == pytest.approx(logprobs[target].item())
        values, ids = logprobs.topk(min(width, vocab))
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist())


# -- sampling without a full sort ---------------------------------------------------------


def _sorted_nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    """Top-p by the definition: sort everything, keep while the mass before is < top_p."""
    probs, ids = torch.sort(torch.softmax(logits.double(), -1), descending=True)
    keep = torch.cumsum(probs, -1) - probs < top_p
    return set(ids[keep].tolist())


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "scale, top_p",
    [
        (3.0, 0.9),
        (3.0, 0.5),
        (1.0, 0.95),  # a peaked model: the nucleus is among the top 256
        (0.05, 0.9),
        (0.05, 0.2),  # near-flat over 49,152: thousands kept, the candidates widen
    ],
)
def test_nucleus_is_top_p_by_its_definition(scale, top_p):
    from shardline.runner.sampling import nucleus

    logits = torch.randn(49152, generator=torch.Generator().manual_seed(3)) * scale
    probs, ids = nucleus(logits, top_p)
    assert set(ids.tolist()) == _sorted_nucleus(logits, top_p)
    assert torch.all(probs[:-1] >= probs[1:])  # most likely first
    assert torch.allclose(probs, torch.softmax(logits.double(), -1)[ids])  # not renormalised


@pytest.mark.timeout(10)
def test_draw_follows_the_probabilities_and_never_a_zero():
    from shardline.runner.sampling import draw

    probs = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0, 0.0])  # unnormalised, zeros at both ends
    g = torch.Generator().manual_seed(4)
    draws = [draw(probs, g) for _ in range(8000)]
    assert set(draws) == {1, 3, 4}
    for index, share in ((1, 0.5), (3, 0.25), (4, 0.25)):
        assert abs(draws.count(index) / len(draws) - share) < 0.02


@pytest.mark.timeout(10)
def test_default_sampling_is_the_softmax_of_the_whole_vocabulary():
    """temperature 1, no top-k or top-p (OpenAI's defaults) draw from every token by its
    probability: the three likeliest of a 49,152-token row at their shares."""
    logits = torch.full((49152,), -30.0)
    logits[[7, 40000, 49151]] = torch.tensor([1.0, 0.0, 0.0])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=2))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a row's ops are small: with 2 threads on a busy CPU their barriers spun for 40 s
    try:
        draws = [sampler.sample(logits) for _ in range(4000)]
    finally:
        torch.set_num_threads(threads)
    assert set(draws) == {7, 40000, 49151}
    expected = torch.softmax(torch.tensor([1.0, 0.0, 0.0]), -1)[0].item()  # 0.576
    assert abs(draws.count(7) / len(draws) - expected) < 0.03


class _Recorder:
    """A grammar mask that records what it consumed and forbids the token it consumed
    last (so the sequence depends on the matcher's state)."""

    def __init__(self) -> None:
        self.consumed: list[int] = []

    def apply(self, logits: torch.Tensor) -> None:
        if self.consumed:
            logits[self.consumed[-1]] = float("-inf")

    def consume(self, token: int) -> None:
        self.consumed.append(token)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, top_p=0.95, seed=11),
        SamplingParams(temperature=1.0, top_k=20, seed=5, frequency_penalty=0.7, presence_penalty=0.3),
        SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.5, repeat_last_n=6),
        SamplingParams(temperature=0.0, frequency_penalty=1.0),
        SamplingParams(temperature=1.0, min_p=0.05, seed=2**62 + 7),
    ],
    ids=["seeded", "penalties", "repetition", "greedy", "min_p"],
)
@pytest.mark.parametrize("after", [1, 9, 23])
def test_a_continuation_samples_what_the_sampler_would_have(params, after):
    """A stream continued on another instance after ``after`` tokens: the prompt plus
    those tokens, ``resumed`` saying how many are output. The sampler there picks the
    same tokens as the first would have (the generator's draws, the penalties' counts
    and the grammar's state taken up), over the same logits."""
    from dataclasses import replace

    logits = [_logits(s, scale=0.6) for s in range(40)]
    prompt = (1, 2, 3, 2)
    whole_mask = _Recorder()
    whole = Sampler(params, prompt, whole_mask)
    tokens = [whole.sample(x) for x in logits]
    assert len(set(tokens)) > 3
    mask = _Recorder()
    continued = Sampler(replace(params, resumed=after), prompt + tuple(tokens[:after]), mask)
    assert mask.consumed == tokens[:after]
    assert [continued.sample(x) for x in logits[after:]] == tokens[after:]
    assert mask.consumed == whole_mask.consumed
