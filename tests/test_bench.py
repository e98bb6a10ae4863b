"""``shardline bench`` against a real 1-node cluster, and its clean failure on a dead URL."""

from __future__ import annotations

import json

import pytest

from shardline import cli


@pytest.fixture(scope="module")
def node_url(cluster1):
    """URL of the shared 1-node cluster serving the embedded default model."""
    return cluster1.url(0)


@pytest.mark.timeout(90)
def test_bench_against_running_node_writes_positive_figures(node_url, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "--url", node_url, "--prompt-tokens", "32", "--gen-tokens", "8",
                     "--runs", "1", "--no-warmup", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out.read_text())
    assert report["config"]["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert report["config"]["nodes"] == 1
    [level] = report["levels"]
    assert level["concurrency"] == 1 and level["requests"] == 1
    assert level["median_ttft_ms"] > 0
    assert level["median_prefill_tokens_per_s"] > 0
    assert level["median_decode_tokens_per_s"] > 0
    assert level["aggregate_decode_tokens_per_s"] > 0
    [request] = level["per_request"]
    assert request["completion_tokens"] == 8  # ignore_eos: exactly --gen-tokens
    assert request["prompt_tokens"] > 0
    assert 0 < request["ttft_s"] <= request["end_s"]
    # the table is printed with the figures
    assert "TTFT" in captured.out and "prefill" in captured.out


@pytest.mark.timeout(30)
def test_unreachable_url_is_a_one_line_error(capsys):
    code = cli.main(["bench", "--url", "http://127.0.0.1:1", "--runs", "1"])
    captured = capsys.readouterr()
    assert code == 1
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert "http://127.0.0.1:1" in lines[0] and "reach" in lines[0]
    assert "Traceback" not in captured.err


@pytest.mark.timeout(60)
def test_unknown_model_on_running_node_is_a_one_line_error(node_url, capsys):
    code = cli.main(["bench", "--url", node_url, "--model", "no/such-model", "--runs", "1"])
    captured = capsys.readouterr()
    assert code == 1
    assert "no/such-model" in captured.err and "Traceback" not in captured.err
