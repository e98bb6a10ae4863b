"""The bench's line of the placement's predicted decode beside the measured one."""

from __future__ import annotations

import pytest

from shardline.bench.prediction import one_request_decode, prediction_line


def _level(prompt: int, concurrency: int, decode: float) -> dict:
    return {
        "kind": "level",
        "prompt_tokens": prompt,
        "concurrency": concurrency,
        "results": {"shardline": {"figures": {"median_decode_tokens_per_s": decode}}},
    }


def test_one_request_decode_is_the_shortest_prompts_concurrency_1_level():
    report = {
        "workloads": [
            _level(512, 1, 70.0),
            _level(128, 8, 20.0),
            _level(128, 1, 80.0),
            {"kind": "chat", "prompt_tokens": None, "concurrency": 1, "results": {}},
        ]
    }
    assert one_request_decode(report, "shardline") == 80.0
    assert one_request_decode({"workloads": [_level(128, 8, 20.0)]}, "shardline") is None


@pytest.mark.parametrize(
    "speed, bench, expected",
    [
        (
            {
                "predicted_decode_tokens_per_s": 120.0,
                "measured_decode_tokens_per_s": 100.0,
                "decode_samples": 7,
                "decode_context": 4096,
            },
            80.0,
            "placement's predicted decode: 120.0 tokens/s (sequences up to 4096 tokens); measured 100.0 by "
            "the cluster (median of 7 requests that ran alone), 80.0 by this bench (concurrency 1): "
            "predicted / measured 1.50x",
        ),
        (
            {
                "predicted_decode_tokens_per_s": 50.0,
                "measured_decode_tokens_per_s": 100.0,
                "decode_samples": 3,
                "decode_context": 300,
            },
            None,
            "placement's predicted decode: 50.0 tokens/s (sequences up to 300 tokens); measured 100.0 by "
            "the cluster (median of 3 requests that ran alone): predicted / measured 0.50x",
        ),
        (
            {"predicted_decode_tokens_per_s": 50.0, "measured_decode_tokens_per_s": None, "decode_context": 300},
            None,
            "placement's predicted decode: 50.0 tokens/s (sequences up to 300 tokens)",
        ),
        ({"predicted_decode_tokens_per_s": None, "measured_decode_tokens_per_s": 90.0}, 80.0, None),
    ],
)
def test_prediction_line(speed, bench, expected):
    assert prediction_line(speed, bench) == expected
