"""``shardline bench``'s printed report: a table of one server's figures, or of two
servers' figures side by side with their ratios (:mod:`shardline.bench.compare`'s report)."""

from __future__ import annotations

from typing import Any

from shardline.bench.compare import RATIO_DEFINITION


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _server_line(server: dict[str, Any]) -> str:
    """``url · model · N nodes · sharding · prompt tokens target→calibrated, ...``."""
    parts = [server["url"], server["model"]]
    if server["nodes"] is not None:
        parts.append(f"{server['nodes']} {'node' if server['nodes'] == 1 else 'nodes'}")
    if server["sharding"]:
        parts.append(server["sharding"])
    if server["prompts"]:  # (none without the plain levels: --runs 0)
        real = ", ".join(f"{p['target']}→{p['tokens']}" for p in server["prompts"])
        parts.append(f"prompt tokens {real} calibrated")
    if server["chat_prompt_tokens"] is not None:
        parts.append(f"chat {server['chat_prompt_tokens']}")
    if server.get("usage_from") == "chunks":
        parts.append("no usage in its stream: completion tokens counted as content chunks")
    return " · ".join(parts)


def _header(report: dict[str, Any]) -> str:
    cfg = report["config"]
    rounds = cfg["rounds"]
    levels = cfg.get("runs", 1)  # the plain levels ran (not --runs 0): their prompts and concurrency
    text = "[bold]shardline bench[/bold] · "
    if levels:
        text += f"prompt {' / '.join(map(str, cfg['prompt_tokens']))} tokens · "
    text += f"gen {cfg['gen_tokens']} tokens"
    if levels:
        text += f" · concurrency {' / '.join(map(str, cfg['concurrency']))}"
    if rounds > 1:
        text += f" · {rounds} rounds, medians"
    return text


def print_report(report: dict[str, Any], console=None) -> None:
    """Print one server's figures: a row per level (prompt length x concurrency), then the
    short chat's TTFT."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    [server] = report["servers"]
    console.print(_header(report), highlight=False)
    console.print(f"[dim]{_server_line(server)}[/dim]", highlight=False)
    name = server["name"]
    table = Table(
        caption="TTFT, prefill, per-request decode and prompt tokens: medians over the level's "
        "requests (each starts its text elsewhere: a few tokens off the calibrated count).\n"
        f"{report['aggregate_definition']}.",
        caption_justify="left",
    )
    for title in (
        "concur-\nrency",
        "reqs",
        "prompt\ntokens",
        "gen\ntokens",
        "TTFT\n(ms)",
        "prefill\ntok/s",
        "decode\ntok/s\nper req.",
        "decode\ntok/s\naggregate",
    ):
        table.add_column(title, justify="right", no_wrap=True)
    chat = None
    conversations = []
    edits = []
    for w in report["workloads"]:
        fig = w["results"][name]["figures"]
        if w["kind"] == "chat":
            chat = fig
            continue
        if w["kind"] == "turns":
            conversations.append(w["results"][name])
            continue
        if w["kind"] == "edit":
            edits.append(fig)
            continue
        table.add_row(
            str(w["concurrency"]),
            str(fig["requests"]),
            _fmt(fig["median_prompt_tokens"], 0),
            _fmt(fig["median_completion_tokens"], 0),
            _fmt(fig["median_ttft_ms"]),
            _fmt(fig["median_prefill_tokens_per_s"]),
            _fmt(fig["median_decode_tokens_per_s"]),
            _fmt(fig["aggregate_decode_tokens_per_s"]),
        )
    if table.rows:
        console.print(table)
    if chat is not None:
        console.print(
            f"short chat ({_fmt(chat['median_prompt_tokens'], 0)} prompt tokens): "
            f"TTFT {_fmt(chat['median_ttft_ms'])} ms (median of {chat['requests']})",
            highlight=False,
        )
    for result in conversations:
        console.print(conversation_line(result), highlight=False)
    for fig in edits:
        console.print(edit_line(fig), highlight=False)


def edit_line(fig: dict) -> str:
    """The code-editing workload's figures (medians over rounds) in one line."""
    plain, drafted = fig["median_decode_tokens_per_s"], fig["speculative_median_decode_tokens_per_s"]
    gain = f"{drafted / plain:.2f}x" if plain and drafted else "n/a"
    return (
        f"code editing ({fig['requests']} requests, {_fmt(fig['median_prompt_tokens'], 0)} prompt tokens): "
        f"decode {_fmt(plain)} tok/s, with speculative decoding {_fmt(drafted)} tok/s ({gain})"
    )


def conversation_line(result: dict[str, Any]) -> str:
    """A conversation's figures (medians over rounds), then its last round's turns: prompt
    tokens (with the cached ones where the server said), TTFT and TTFT without the cache."""
    fig = result["figures"]

    def ms(seconds: float | None) -> str:
        return _fmt(None if seconds is None else seconds * 1000, 0)

    turns = [
        f"{r['prompt_tokens']}"
        + (f" ({r['cached_tokens']} cached)" if r.get("cached_tokens") else "")
        + f": {ms(r['ttft_s'])} / {ms(r.get('uncached_ttft_s'))} ms"
        for r in result["rounds"][-1]["per_request"]
    ]
    gain = _ratio(
        None
        if not fig.get("last_uncached_ttft_ms") or fig["last_ttft_ms"] is None
        else fig["last_ttft_ms"] / fig["last_uncached_ttft_ms"]
    )
    return (
        f"conversation of {len(turns)} turns: TTFT first {_fmt(fig['first_ttft_ms'])} ms, last "
        f"{_fmt(fig['last_ttft_ms'])} ms, last without the cache {_fmt(fig.get('last_uncached_ttft_ms'))} ms "
        f"({gain}); per turn, prompt tokens: TTFT / without the cache: {', '.join(turns)}"
    )


def print_comparison(report: dict[str, Any], console=None) -> None:
    """Print two servers' figures side by side: a row per workload and figure with both
    values, the ratio (first / second) and which direction is better (``higher`` for
    tokens/s, ``lower`` for TTFT)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    first, second = report["servers"]
    console.print(_header(report) + " · interleaved", highlight=False)
    for server in (first, second):
        console.print(f"[dim]{server['name']}: {_server_line(server)}[/dim]", highlight=False)
    table = Table(caption=f"{RATIO_DEFINITION}.\n{report['aggregate_definition']}.", caption_justify="left")
    table.add_column("workload")
    table.add_column("figure", no_wrap=True)
    for title in (first["name"], second["name"], "ratio"):
        table.add_column(title, justify="right", no_wrap=True)
    table.add_column("better", no_wrap=True)
    previous = None
    for row in report["rows"]:
        table.add_row(
            "" if row["workload"] == previous else row["workload"],
            row["figure"],
            _fmt(row[first["name"]]),
            _fmt(row[second["name"]]),
            _ratio(row["ratio"]),
            row["better"],
        )
        previous = row["workload"]
    console.print(table)
    for w in report.get("workloads", []):
        if w["kind"] == "turns":
            for server in (first, second):
                console.print(f"{server['name']}: {conversation_line(w['results'][server['name']])}", highlight=False)
