"""Profiles that hold: a 1-node cluster measures its machine once idle, times the requests
it serves, shows predicted beside measured, and previews the placement at its measured
speed."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import start_cluster
from model_shapes import smollm2

from shardline.models.config import RankShare
from shardline.models.store import DEFAULT_MODEL_ID, default_model_path
from shardline.placement.ranks import resident_bytes_per_weight
from shardline.placement.speed import NodeProfile, predict_tokens_per_s

pytestmark = pytest.mark.timeout(240)


def _idle_profile(url: str, ready_at: float, timeout_s: float = 120.0) -> dict:
    """The node's profile once it was measured after the instance was ready (idle)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        [me] = [n for n in httpx.get(f"{url}/cluster/nodes", timeout=10).json()["nodes"] if n["live"]]
        profile = me.get("profile") or {}
        if profile.get("measured_at", 0) > ready_at and profile.get("decode_layer_s", 0) > 0:
            return profile
        time.sleep(1.0)
    raise AssertionError(f"no idle profile within {timeout_s} s: {profile}")


def _chat(url: str, content: str, max_tokens: int) -> dict:
    response = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=120,
        json={
            "model": DEFAULT_MODEL_ID,
            "temperature": 0,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "speculative.n_max": 0,  # the prediction is of plain decoding, a token a step
            "messages": [{"role": "user", "content": content}],
        },
    )
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.slow
def test_predicted_decode_is_near_the_measured_rate(tmp_path):
    cluster = start_cluster(1, tmp_path)
    try:
        url = cluster.url(0)
        [inst] = httpx.get(f"{url}/cluster/instances", timeout=10).json()["instances"]
        profile = _idle_profile(url, inst["ready_at"])
        for _ in range(3):  # decode: one sequence alone, 64 tokens each
            _chat(url, "Count from one to one hundred.", 64)
        long_prompt = "Here is a list of fruits: " + ", ".join(["apple", "pear", "plum"] * 40)
        assert _chat(url, long_prompt, 8)["usage"]["prompt_tokens"] >= 256  # prefill's sample
        deadline = time.monotonic() + 10
        while True:  # the figures are recorded in the background
            [inst] = httpx.get(f"{url}/cluster/instances", timeout=30).json()["instances"]
            speed = inst["speed"]
            if speed["decode_samples"] >= 3 and speed["prefill_samples"] >= 1:
                break
            assert time.monotonic() < deadline, speed
            time.sleep(0.2)
        predicted, measured = speed["predicted_decode_tokens_per_s"], speed["measured_decode_tokens_per_s"]
        error = predicted / measured - 1
        assert 2 * 30 <= speed["decode_context"] <= 2 * 150  # predicted where it was measured
        print(
            f"\ndecode at context {speed['decode_context']}: predicted {predicted:.1f} tok/s, measured {measured:.1f} ({error:+.0%}); "
            f"prefill: predicted {speed['predicted_prefill_tokens_per_s']:.0f}, measured "
            f"{speed['measured_prefill_tokens_per_s']:.0f}; profile: "
            f"{profile['matmul_flops'] / 1e9:.0f} GFLOP/s, "
            f"{profile['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
            f"{profile['decode_layer_s'] * 1e3:.3f} ms/layer, int4 product "
            f"{profile['decode_weight_bytes_per_s'] / 1e9:.1f} GB/s; resident weights "
            f"{inst['ranks'][0]['loaded']['param_bytes'] / 1e6:.0f} MB"
        )
        # for comparison: the model before per-layer costs (weights and KV at the copy
        # bandwidth, products at the matmul rate), same profile, at the instance's context
        config = smollm2()
        weight = resident_bytes_per_weight(config, default_model_path().stat().st_size, "bfloat16", None)
        before = predict_tokens_per_s(
            config,
            "pipeline",
            [NodeProfile("n", 0, profile["memory_bandwidth_bytes_per_s"], profile["matmul_flops"])],
            [RankShare(0, config.num_layers)],
            {},
            inst["context"],
            decode_weight_bytes=weight,
        )
        print(
            f"bandwidth-only model at context {inst['context']}: decode {before[0]:.1f}, prefill {before[1]:.0f} tok/s"
        )
        # the goal is within 30% on an idle machine; the bound is generous for a shared one
        assert 0.5 <= predicted / measured <= 2.0, speed
        assert speed["measured_prefill_tokens_per_s"] > 0
        # prefill is predicted at the measured prompts' length, not one chunk's
        assert speed["prefill_prompt_tokens"] == _chat(url, long_prompt, 1)["usage"]["prompt_tokens"]

        # The preview of the same placement now ranks it by what it measured (its model's
        # figure, at the context the requests ran at, is the one shown beside it).
        node_id = inst["ranks"][0]["node_id"]
        candidates = httpx.post(
            f"{url}/cluster/placements/preview",
            timeout=30,
            json={
                "model": DEFAULT_MODEL_ID,
                "nodes": [node_id],
                "sharding": "pipeline",
                "context": speed["decode_context"],
            },
        ).json()["candidates"]
        [one] = [c for c in candidates if c["feasible"]]
        assert one["decode_basis"] == "measured" and one["prefill_basis"] == "measured"
        assert one["serving"] is True  # the instance runs on it now
        assert one["predicted_decode_tokens_per_s"] == pytest.approx(measured)
        assert one["model_decode_tokens_per_s"] == pytest.approx(predicted, rel=0.05)
    finally:
        cluster.stop()
