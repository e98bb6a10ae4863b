"""``shardline bench`` against a real 1-node cluster, against a second one (compare mode),
and its one-line errors."""

from __future__ import annotations

import json

import pytest
from conftest import start_cluster

from shardline import cli


@pytest.fixture(scope="module")
def node_url(cluster1):
    """URL of the shared 1-node cluster serving the embedded default model."""
    return cluster1.url(0)


@pytest.mark.timeout(90)
def test_bench_against_running_node_writes_positive_figures(node_url, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = cli.main(
        [
            "bench",
            "--url",
            node_url,
            "--prompt-tokens",
            "32",
            "--gen-tokens",
            "8",
            "--runs",
            "1",
            "--chat-requests",
            "2",
            "--no-warmup",
            "--json",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out.read_text())
    [server] = report["servers"]
    assert server["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert server["nodes"] == 1 and server["usage_from"] == "usage"
    level, chat = report["workloads"]
    assert (level["kind"], level["concurrency"], level["requests"]) == ("level", 1, 1)
    figures = level["results"]["shardline"]["figures"]
    assert figures["median_ttft_ms"] > 0
    assert figures["median_prefill_tokens_per_s"] > 0
    assert figures["median_decode_tokens_per_s"] > 0
    assert figures["aggregate_decode_tokens_per_s"] > 0
    [round_] = level["results"]["shardline"]["rounds"]
    [request] = round_["per_request"]
    assert request["completion_tokens"] == 8  # ignore_eos: exactly --gen-tokens
    assert request["prompt_tokens"] > 0
    assert 0 < request["ttft_s"] <= request["end_s"]
    assert chat["kind"] == "chat" and chat["results"]["shardline"]["figures"]["median_ttft_ms"] > 0
    assert "ratios" not in level and "rows" not in report  # one server: nothing to compare
    # the table is printed with the figures, and the short chat's TTFT below it
    assert "TTFT" in captured.out and "prefill" in captured.out and "short chat" in captured.out
    # the placement's predicted decode beside the measured one
    assert report["prediction"]["predicted_decode_tokens_per_s"] > 0
    assert report["prediction"]["measured_decode_tokens_per_s"] > 0
    assert "placement's predicted decode" in captured.out and "predicted / measured" in captured.out


@pytest.fixture(scope="module")
def second_url(tmp_path_factory):
    """URL of a second 1-node cluster serving the embedded default model."""
    cluster = start_cluster(1, tmp_path_factory.mktemp("second"))
    yield cluster.url(0)
    cluster.stop()


@pytest.mark.timeout(120)
def test_bench_against_a_second_shardline_interleaves_and_gives_ratios(node_url, second_url, tmp_path, capsys):
    out = tmp_path / "compare.json"
    code = cli.main(
        [
            "bench",
            "--url",
            node_url,
            "--against",
            second_url,
            "--prompt-tokens",
            "32",
            "--gen-tokens",
            "8",
            "--concurrency",
            "1",
            "2",
            "--runs",
            "1",
            "--rounds",
            "2",
            "--chat-requests",
            "2",
            "--no-warmup",
            "--json",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out.read_text())
    assert [(s["name"], s["url"]) for s in report["servers"]] == [("shardline", node_url), ("other", second_url)]
    assert report["servers"][1]["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # its first model
    names = ["prompt 32 c=1", "prompt 32 c=2", "short chat"]
    assert [w["name"] for w in report["workloads"]] == names
    # every unit alternates between the servers, every workload in every round
    assert [(o["round"], o["workload"], o["server"]) for o in report["order"]] == [
        (r, w, s) for r in range(2) for w in names for s in ("shardline", "other")
    ]
    starts = [o["start_s"] for o in report["order"]]
    assert starts == sorted(starts)
    for w in report["workloads"]:
        for name in ("shardline", "other"):
            result = w["results"][name]
            assert len(result["rounds"]) == 2
            assert result["figures"]["median_ttft_ms"] > 0
            if w["kind"] == "level":
                assert result["figures"]["median_decode_tokens_per_s"] > 0
                assert result["figures"]["aggregate_decode_tokens_per_s"] > 0
                assert all(r["completion_tokens"] == 8 for lv in result["rounds"] for r in lv["per_request"])
                assert [lv["requests"] for lv in result["rounds"]] == [w["concurrency"]] * 2
        a, b = (w["results"][n]["figures"] for n in ("shardline", "other"))
        for key, value in w["ratios"].items():
            assert value == pytest.approx(a[key] / b[key])
    assert len(report["rows"]) == 2 * 4 + 1
    assert "ratio" in captured.out and second_url in captured.out


@pytest.mark.timeout(30)
def test_unreachable_url_is_a_one_line_error(capsys):
    code = cli.main(["bench", "--url", "http://127.0.0.1:1", "--runs", "1"])
    captured = capsys.readouterr()
    assert code == 1
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert "http://127.0.0.1:1" in lines[0] and "reach" in lines[0]
    assert "Traceback" not in captured.err


@pytest.mark.timeout(30)
def test_unreachable_against_url_is_a_one_line_error_naming_it(node_url, capsys):
    code = cli.main(["bench", "--url", node_url, "--against", "127.0.0.1:1", "--runs", "1"])
    captured = capsys.readouterr()
    assert code == 1
    [line] = captured.err.strip().splitlines()
    assert line.startswith("shardline bench: --against: cannot reach http://127.0.0.1:1"), line


@pytest.mark.timeout(30)
def test_model_missing_on_the_other_server_is_a_one_line_error(node_url, capsys):
    code = cli.main(["bench", "--url", node_url, "--against", node_url, "--against-model", "no/such-model"])
    captured = capsys.readouterr()
    assert code == 1
    [line] = captured.err.strip().splitlines()
    assert line.startswith("shardline bench: --against: ") and "no/such-model" in line
    assert node_url in line and "SmolLM2" in line  # the server, and the models it does serve


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
    rows = [
        {
            "rank": 0,
            "node_id": "abcdef123456",
            "share": "layers 0-9",
            "file_bytes": 50 * mib,
            "estimated_bytes": 330 * mib,
            "baseline_bytes": 230 * mib,
            "runtime_rss_bytes": 223 * mib,
            "rss_bytes": 300 * mib,
            "peak_rss_bytes": 360 * mib,
            "load_peak_rss_bytes": 345 * mib,
        },
        {
            "rank": 1,
            "node_id": "0123456789ab",
            "share": "layers 10-19",
            "file_bytes": None,
            "estimated_bytes": None,
            "baseline_bytes": None,
            "runtime_rss_bytes": None,
            "rss_bytes": None,
            "peak_rss_bytes": None,
            "load_peak_rss_bytes": None,
        },
    ]
    console = Console(record=True, width=200)
    print_memory(rows, console)
    text = console.export_text()
    assert "runtime" in text
    first = next(line for line in text.splitlines() if "abcdef12" in line)
    cells = [c.strip() for c in first.split("│") if c.strip()]
    assert cells[3:] == ["50", "330", "230", "223", "300", "360", "345", "0.92", "1.15"]
    assert "n/a" in next(line for line in text.splitlines() if "01234567" in line)


@pytest.mark.timeout(30)
def test_busy_cores_run_while_the_block_runs_and_end_with_it():
    """``--busy N``: N spinning processes for the workloads' time, none left after, also
    when the block raises."""
    import os

    import psutil

    from shardline.bench.contention import busy_cores

    with busy_cores(1) as pids:
        [pid] = pids
        assert psutil.Process(pid).cpu_percent(interval=0.5) > 50  # spinning
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(RuntimeError), busy_cores(1) as pids:
        raise RuntimeError("a failed workload")
    assert not psutil.pid_exists(pids[0])
    with busy_cores(0) as none:
        assert none == []
    with pytest.raises(ValueError, match="between 0 and"), busy_cores((os.cpu_count() or 1) + 1):
        pass


@pytest.mark.timeout(30)
def test_busy_beyond_the_cpus_is_a_one_line_error(capsys):
    import os

    code = cli.main(["bench", "--url", "http://127.0.0.1:1", "--busy", str((os.cpu_count() or 1) + 1)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "--busy must be between 0 and" in err[0]
