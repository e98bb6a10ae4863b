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


def test_memory_table_shows_each_figure_and_ratios():
    from rich.console import Console

    from shardline.bench.memory import print_memory

    mib = 2**20
    rows = [{"rank": 0, "node_id": "abcdef123456", "share": "layers 0-9", "file_bytes": 50 * mib,
             "estimated_bytes": 330 * mib, "baseline_bytes": 230 * mib, "runtime_rss_bytes": 223 * mib, "rss_bytes": 300 * mib,
             "peak_rss_bytes": 360 * mib, "load_peak_rss_bytes": 345 * mib},
            {"rank": 1, "node_id": "0123456789ab", "share": "layers 10-19", "file_bytes": None,
             "estimated_bytes": None, "baseline_bytes": None, "runtime_rss_bytes": None, "rss_bytes": None,
             "peak_rss_bytes": None, "load_peak_rss_bytes": None}]
    console = Console(record=True, width=200)
    print_memory(rows, console)
    text = console.export_text()
    assert "runtime" in text
    first = next(line for line in text.splitlines() if "abcdef12" in line)
    cells = [c.strip() for c in first.split("│") if c.strip()]
    assert cells[3:] == ["50", "330", "230", "223", "300", "360", "345", "0.92", "1.15"]
    assert "n/a" in next(line for line in text.splitlines() if "01234567" in line)
