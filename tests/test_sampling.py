"""shardline.runner.sampling.Sampler: greedy, seeding, top-k and top-p."""

from __future__ import annotations

import pytest
import torch

from shardline.runner.protocol import SamplingParams
from shardline.runner.sampling import Sampler

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
