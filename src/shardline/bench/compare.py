"""The workloads of ``shardline bench``, run on one server or on two interleaved
(``--against URL``), and the figures and ratios they give.

A workload is one measured unit (:func:`plan_workloads`):

- a *level*: one prompt length (``--prompt-tokens``) at one concurrency (``--concurrency``):
  ``max(--runs, c)`` streamed requests of ``--gen-tokens`` tokens, at most c in flight
  (:func:`shardline.bench.bench.run_level`); figures TTFT, prefill tokens/s, decode
  tokens/s (per request; the decode speed at that context) and aggregate decode tokens/s
  (all of the level's requests together);
- the *short chat*: ``--chat-requests`` short questions (about 37 prompt tokens with the
  chat template) one after another, two tokens each; figure TTFT;
- a *conversation* (``--turns N``): one chat of N turns, each sending the whole chat so
  far with a new user message of about ``--turn-tokens`` tokens, its answer of
  ``--gen-tokens`` joining the chat, after a system prompt of about ``--system-tokens``
  tokens of tool definitions where that is above 0 (an agent's,
  :func:`shardline.bench.bench.agent_system_prompt`); each turn's messages are sent again
  with ``cache_prompt: false`` (:func:`shardline.bench.bench.run_conversation`); figures
  the first and the last turn's TTFT (a server with a prompt cache prefills only each
  turn's new part) and the last turn's without the cache.

Every round runs every workload on each server in turn (:func:`interleave`): shardline,
then the other server, then the next workload, so both see the machine's load within
seconds of each other (A B A B ...). A figure is the median over rounds of the round's
median (:func:`combine_rounds`); the ratio is shardline's figure / the other server's
(:func:`ratio`): above 1 shardline is faster for tokens/s, below 1 it is faster for TTFT.
The bench on one server (no ``--against``) is the same run with one server.

Before the rounds each server has its prompts calibrated to its own token counts (its own
tokenizer and chat template) and gets one unmeasured warm-up request. Every measured
request has its own prompt text (variants counted per server, the same sequence on both),
so neither server finds a whole prompt in a cache.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import httpx

from shardline.bench.bench import (
    AGGREGATE_DEFINITION,
    BenchError,
    agent_system_prompt,
    build_prompt,
    calibrate_words,
    chat_question,
    connect_error_message,
    count_prompt_tokens,
    edit_request,
    median,
    run_conversation,
    run_edits,
    run_level,
    stream_request,
)

SHARDLINE = "shardline"
OTHER = "other"
CHAT_GEN_TOKENS = 2
"""Tokens the short chat's requests generate: only their TTFT is a figure."""
RATIO_DEFINITION = (
    "ratio = shardline / other: above 1 shardline is faster for tokens/s (higher is better), "
    "below 1 it is faster for TTFT (lower is better)"
)


@dataclass(frozen=True)
class Figure:
    """One figure of a workload: its key in :func:`shardline.bench.bench.summarize_level`'s
    dict, its label, and whether a higher value is better (tokens/s) or a lower one (TTFT)."""

    key: str
    label: str
    higher_is_better: bool


TTFT = Figure("median_ttft_ms", "TTFT ms", higher_is_better=False)
LEVEL_FIGURES = (
    TTFT,
    Figure("median_prefill_tokens_per_s", "prefill tok/s", higher_is_better=True),
    Figure("median_decode_tokens_per_s", "decode tok/s", higher_is_better=True),
    Figure("aggregate_decode_tokens_per_s", "aggregate tok/s", higher_is_better=True),
)
CHAT_FIGURES = (TTFT,)
TURN_FIGURES = (
    Figure("first_ttft_ms", "first turn TTFT ms", higher_is_better=False),
    Figure("last_ttft_ms", "last turn TTFT ms", higher_is_better=False),
    Figure("last_uncached_ttft_ms", "last turn TTFT ms, no cache", higher_is_better=False),
)


EDIT_FIGURES = (
    Figure("median_decode_tokens_per_s", "decode tok/s", higher_is_better=True),
    Figure("speculative_median_decode_tokens_per_s", "decode tok/s, speculative", higher_is_better=True),
)


def figures_of(kind: str) -> tuple[Figure, ...]:
    """The figures a workload of ``kind`` reports."""
    return {"level": LEVEL_FIGURES, "chat": CHAT_FIGURES, "turns": TURN_FIGURES, "edit": EDIT_FIGURES}[kind]


@dataclass(frozen=True)
class Workload:
    """One measured unit. ``kind``: ``"level"``, ``"chat"``, ``"turns"`` or ``"edit"``;
    ``prompt_tokens``: the level's prompt length to calibrate to, a conversation's turn's
    (None for the chat); ``requests``: per round (a conversation's: its turns)."""

    name: str
    kind: str
    prompt_tokens: int | None
    concurrency: int
    requests: int

    @property
    def figures(self) -> tuple[Figure, ...]:
        """The figures this workload reports."""
        return figures_of(self.kind)


@dataclass
class BenchConfig:
    """What to measure (token counts in tokens)."""

    prompt_tokens: list[int]
    gen_tokens: int
    concurrency: list[int]
    runs: int
    rounds: int
    chat_requests: int
    warmup: bool
    turns: int = 0
    turn_tokens: int = 250
    system_tokens: int = 0
    think_s: float = 0.0
    edits: int = 0
    edit_functions: int = 30
    draft_tokens: int = 8


@dataclass
class Server:
    """A server to measure: its base URL (``http://host:port``), model id, the headers of its
    API key (kept out of reports) and, for shardline, its instance's nodes and sharding."""

    name: str
    url: str
    model: str
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    nodes: int | None = None
    sharding: str | None = None


# -- pure decisions ----------------------------------------------------------------------


def plan_workloads(
    prompt_tokens: list[int],
    concurrency: list[int],
    runs: int,
    chat_requests: int,
    turns: int = 0,
    turn_tokens: int = 250,
    edits: int = 0,
) -> list[Workload]:
    """A level per (prompt length, concurrency), prompt lengths outermost, each with
    ``max(runs, c)`` requests (none where ``runs`` is 0); then the short chat if
    ``chat_requests`` > 0; then a conversation of ``turns`` turns of ``turn_tokens`` if
    ``turns`` > 0; then ``edits`` code-editing requests, if any."""
    out = (
        [Workload(f"prompt {p} c={c}", "level", p, c, max(runs, c)) for p in prompt_tokens for c in concurrency]
        if runs > 0
        else []
    )
    if chat_requests > 0:
        out.append(Workload("short chat", "chat", None, 1, chat_requests))
    if turns > 0:
        out.append(Workload(f"conversation {turns} turns", "turns", turn_tokens, 1, turns))
    if edits > 0:
        out.append(Workload("code editing", "edit", None, 1, edits))
    return out


def interleave(workloads: list[str], servers: list[str], rounds: int) -> list[tuple[int, str, str]]:
    """The order the units run in: ``(round, workload, server)``, each workload on every
    server in turn before the next workload (A B A B ...), every workload in every round."""
    return [(r, w, s) for r in range(rounds) for w in workloads for s in servers]


def ratio(value: float | None, other: float | None) -> float | None:
    """``value / other``; None when either is missing or ``other`` is 0."""
    if value is None or other is None or other == 0:
        return None
    return value / other


def combine_rounds(rounds: list[dict[str, Any]], figures: tuple[Figure, ...]) -> dict[str, Any]:
    """One server's figures of a workload: for each figure the median over ``rounds``
    (:func:`shardline.bench.bench.summarize_level` dicts) of the round's value, and the
    median prompt and completion tokens, total requests and where token counts came from."""
    out: dict[str, Any] = {f.key: median([r[f.key] for r in rounds]) for f in figures}
    out["median_prompt_tokens"] = median([r["median_prompt_tokens"] for r in rounds])
    out["median_completion_tokens"] = median([r["median_completion_tokens"] for r in rounds])
    out["requests"] = sum(r["requests"] for r in rounds)
    out["usage_from"] = "usage" if all(r["usage_from"] == "usage" for r in rounds) else "chunks"
    return out


def report_rows(workloads: list[dict[str, Any]], first: str = SHARDLINE, second: str = OTHER) -> list[dict[str, Any]]:
    """The comparison's rows: one per workload and figure, with both servers' values, the
    ratio first / second and which direction is better.

    Args:
        workloads: the ``workloads`` of :func:`run_workloads`'s report (``name``, ``kind``,
            ``results[server]["figures"]``).
    """
    rows = []
    for w in workloads:
        for fig in figures_of(w["kind"]):
            a = w["results"][first]["figures"][fig.key]
            b = w["results"][second]["figures"][fig.key]
            rows.append(
                {
                    "workload": w["name"],
                    "figure": fig.label,
                    first: a,
                    second: b,
                    "ratio": ratio(a, b),
                    "better": "higher" if fig.higher_is_better else "lower",
                }
            )
    return rows


# -- running -----------------------------------------------------------------------------

T = TypeVar("T")


async def _on(server: Server, call: Awaitable[T]) -> T:
    """``call``'s result; a failed connection becomes a :class:`BenchError` naming the server."""
    try:
        return await call
    except httpx.HTTPError as exc:
        raise BenchError(f"{server.name}: {connect_error_message(server.url, exc)}") from exc


async def _prepare(
    client: httpx.AsyncClient, server: Server, config: BenchConfig, say: Callable[[str], None]
) -> dict[str, Any]:
    """Calibrate ``server``'s prompts and warm it up; its part of the report."""
    levels = config.prompt_tokens if config.runs > 0 else []
    if levels:
        say(f"calibrating prompts of about {', '.join(map(str, levels))} tokens on {server.name}")
    prompts = []
    for target in levels:
        words, tokens = await _on(server, calibrate_words(client, server.url, server.model, target))
        prompts.append({"target": target, "words": words, "tokens": tokens})
    turn = None
    if config.turns:
        words, tokens = await _on(server, calibrate_words(client, server.url, server.model, config.turn_tokens))
        turn = {"target": config.turn_tokens, "words": words, "tokens": tokens}
        if config.system_tokens:
            say(f"calibrating a system prompt of about {config.system_tokens} tokens on {server.name}")
            words, tokens = await _on(
                server,
                calibrate_words(
                    client,
                    server.url,
                    server.model,
                    config.system_tokens,
                    lambda n: [
                        {"role": "system", "content": agent_system_prompt(n)},
                        {"role": "user", "content": chat_question(0)},
                    ],
                ),
            )
            turn |= {"system_words": words, "system_tokens": tokens}
    chat_tokens = None
    if config.chat_requests:
        chat_tokens = await _on(server, count_prompt_tokens(client, server.url, server.model, chat_question(0)))
    if config.warmup:
        say(f"warm-up request on {server.name}")
        await _on(
            server,
            stream_request(
                client,
                server.url,
                server.model,
                build_prompt(prompts[0]["words"]) if prompts else chat_question(0),
                config.gen_tokens,
            ),
        )
    return {
        "name": server.name,
        "url": server.url,
        "model": server.model,
        "nodes": server.nodes,
        "sharding": server.sharding,
        "prompts": prompts,
        "chat_prompt_tokens": chat_tokens,
        "turn": turn,
    }


async def run_workloads(
    servers: list[Server], config: BenchConfig, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run every workload on every server, ``config.rounds`` times, interleaved.

    Returns:
        ``{"config", "servers": [{name, url, model, nodes, sharding, prompts, chat_prompt_tokens,
        usage_from}], "order": [{round, workload, server, start_s}], "workloads": [{name, kind,
        prompt_tokens, concurrency, requests, results: {server: {figures, rounds}}, ratios?}],
        "rows"?, "aggregate_definition", "ratio_definition"?}``; ``ratios`` and ``rows``
        (:func:`report_rows`) with two servers only. ``start_s``: seconds since the first
        measured unit started.

    Raises:
        BenchError: an HTTP error, a malformed answer or a failed connection, naming the server.
    """
    say = progress or (lambda _msg: None)
    workloads = plan_workloads(
        config.prompt_tokens,
        config.concurrency,
        config.runs,
        config.chat_requests,
        config.turns,
        config.turn_tokens,
        config.edits,
    )
    by_name = {w.name: w for w in workloads}
    names = [s.name for s in servers]
    timeout = httpx.Timeout(30.0, read=600.0)
    limits = httpx.Limits(max_connections=max(config.concurrency) + 4)
    clients = {s.name: httpx.AsyncClient(timeout=timeout, limits=limits, headers=s.headers) for s in servers}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {w.name: {n: [] for n in names} for w in workloads}
    order: list[dict[str, Any]] = []
    try:
        prepared = {s.name: await _prepare(clients[s.name], s, config, say) for s in servers}
        next_variant = dict.fromkeys(names, 1)  # variant 0: calibration and warm-up
        started = time.perf_counter()
        for round_, name, server_name in interleave([w.name for w in workloads], names, config.rounds):
            work, server, info = by_name[name], servers[names.index(server_name)], prepared[server_name]
            variants = range(next_variant[server_name], next_variant[server_name] + work.requests)
            next_variant[server_name] += work.requests
            unit = _unit(clients[server_name], server, info, work, variants, config)
            requests = "" if work.kind == "turns" else f" ({work.requests} requests)"
            say(f"round {round_ + 1}/{config.rounds}: {name} on {server_name}{requests}")
            order.append(
                {"round": round_, "workload": name, "server": server_name, "start_s": time.perf_counter() - started}
            )
            results[name][server_name].append(await _on(server, unit))
    finally:
        for client in clients.values():
            await client.aclose()
    return _report(config, workloads, names, prepared, order, results)


def _unit(
    client: httpx.AsyncClient,
    server: Server,
    info: dict[str, Any],
    work: Workload,
    variants: range,
    config: BenchConfig,
) -> Awaitable[dict[str, Any]]:
    """One measured unit of ``work`` on ``server`` (not yet started): a conversation of
    ``variants`` turns, or ``work.requests`` requests of its prompt level or short chat, the
    prompts calibrated to the server (``info``: its :func:`_prepare` record)."""
    if work.kind == "edit":
        edits = [edit_request(config.edit_functions, v) for v in variants]
        return run_edits(client, server.url, server.model, edits, config.gen_tokens, config.draft_tokens)
    if work.kind == "turns":
        conversation = [build_prompt(info["turn"]["words"], v) for v in variants]
        system = agent_system_prompt(info["turn"]["system_words"], variants[0]) if config.system_tokens else None
        return run_conversation(
            client, server.url, server.model, conversation, config.gen_tokens, system, config.think_s
        )
    if work.kind == "level":
        calibrated = next(p for p in info["prompts"] if p["target"] == work.prompt_tokens)
        prompts = [build_prompt(calibrated["words"], v) for v in variants]
        gen, tokens = config.gen_tokens, calibrated["tokens"]
    else:
        prompts = [chat_question(v) for v in variants]
        gen, tokens = CHAT_GEN_TOKENS, info["chat_prompt_tokens"]
    return run_level(client, server.url, server.model, prompts, gen, work.concurrency, tokens)


def _report(
    config: BenchConfig,
    workloads: list[Workload],
    names: list[str],
    prepared: dict[str, dict[str, Any]],
    order: list[dict[str, Any]],
    results: dict[str, dict[str, list[dict[str, Any]]]],
) -> dict[str, Any]:
    """:func:`run_workloads`' report of the rounds measured (``results``: workload ->
    server -> rounds); sets each server's ``usage_from`` in ``prepared``."""
    reports = []
    for w in workloads:
        entry: dict[str, Any] = {
            "name": w.name,
            "kind": w.kind,
            "prompt_tokens": w.prompt_tokens,
            "concurrency": w.concurrency,
            "requests": w.requests,
            "results": {
                n: {"figures": combine_rounds(results[w.name][n], w.figures), "rounds": results[w.name][n]}
                for n in names
            },
        }
        if len(names) == 2:
            a, b = (entry["results"][n]["figures"] for n in names)
            entry["ratios"] = {f.key: ratio(a[f.key], b[f.key]) for f in w.figures}
        reports.append(entry)
    for n in names:
        chunked = any(w["results"][n]["figures"]["usage_from"] == "chunks" for w in reports)
        prepared[n]["usage_from"] = "chunks" if chunked else "usage"
    report: dict[str, Any] = {
        "config": asdict(config),
        "servers": [prepared[n] for n in names],
        "order": order,
        "workloads": reports,
        "aggregate_definition": AGGREGATE_DEFINITION,
    }
    if len(names) == 2:
        report["rows"] = report_rows(reports, *names)
        report["ratio_definition"] = RATIO_DEFINITION
    return report
