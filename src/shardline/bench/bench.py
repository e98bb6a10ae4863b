"""``shardline bench``: prefill tokens/s, decode tokens/s and TTFT of a (local) cluster.

The benchmark talks to the OpenAI-compatible API only (``GET /v1/models`` and streamed
``POST /v1/chat/completions``), as vLLM's ``benchmark_serving`` does, so it measures what a
client sees: HTTP, tokenization and the chat template are included in every figure.

Without ``--url`` it starts a local cluster (``shardline.local_cluster.LocalCluster``),
places the model, benchmarks node 0 and stops the cluster again.

Per request (times in seconds from the moment the request is sent):

- TTFT: until the first chunk that carries content;
- prefill tokens/s: prompt tokens (from the response's ``usage``) / TTFT;
- decode tokens/s: (completion tokens - 1) / (last content chunk - first content chunk).

Per concurrency level c (``--runs`` requests, at least c, at most c in flight at once):

- aggregate decode tokens/s: all completion tokens of the level / the level's wall time
  (first request sent to last request finished, so prefill time is included; this is
  vLLM's "output token throughput").

The prompt is repeated varied English text sized to about ``--prompt-tokens`` tokens of the
full chat prompt (template included): its length is calibrated against the server's own
token counts with a few one-token requests before the measured ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from shardline.local_cluster import LocalCluster, LocalClusterError

DEFAULT_PORT = 52600

AGGREGATE_DEFINITION = (
    "aggregate decode tokens/s = total completion tokens of the level / wall time of the level "
    "(first request sent to last request finished, prefill included)"
)

# Varied English sentences; the prompt repeats them, each request starting at another one.
_SENTENCES = [
    "The river bends twice before it reaches the old stone bridge at the edge of town.",
    "Most bakeries open before dawn, when the streets are still quiet and the air is cold.",
    "A good map shows not only the roads but also the hills, the forests and the rivers.",
    "Engineers tested the new engine for three weeks in the desert heat before approving it.",
    "Her grandmother kept a garden of tomatoes, beans, herbs and a single enormous pumpkin.",
    "The library moved its rare books to a dry basement room with a steady temperature.",
    "On clear nights the lighthouse keeper counted ships by the colours of their lamps.",
    "Students in the chemistry class measured how quickly salt dissolves in warm water.",
    "The committee argued for hours about the budget and finally agreed to meet again.",
    "Migrating birds follow coastlines, mountain ranges and even the lights of cities.",
    "A small cafe near the station serves soup, fresh bread and strong black coffee.",
    "The orchestra rehearsed the final movement slowly, then played it at full speed.",
    "Farmers watched the sky anxiously, hoping the rain would come before the harvest.",
    "In the museum, a child pressed her face to the glass to look at the dinosaur bones.",
    "The software update fixed several bugs but introduced a strange delay at startup.",
    "Tourists climbed the narrow staircase to see the whole city from the bell tower.",
    "Every winter the lake freezes, and families skate across it on Sunday afternoons.",
    "The detective noticed that the clock on the wall had stopped at a quarter past nine.",
    "Volunteers planted two hundred trees along the highway to reduce noise and dust.",
    "An old sailor told stories of storms, islands and the fish he never managed to catch.",
]
_PROMPT_PREFIX = "Read the following text, then summarise it in a few sentences.\n\n"


class BenchError(RuntimeError):
    """The benchmark cannot go on; the message names the problem in one line."""


# -- prompt ------------------------------------------------------------------------------


def build_prompt(words: int, variant: int = 0) -> str:
    """User message of about ``words`` words of varied English text.

    Args:
        words: number of words of text after the instruction line.
        variant: which sentence the text starts at, so requests differ at the front.
    """
    out: list[str] = []
    i = variant
    while len(out) < words:
        out.extend(_SENTENCES[i % len(_SENTENCES)].split())
        i += 1
    return _PROMPT_PREFIX + " ".join(out[:words])


# -- one request -------------------------------------------------------------------------


@dataclass
class RequestResult:
    """What one streamed request measured. Times are seconds since the request was sent.

    Attributes:
        prompt_tokens: prompt length in tokens, from the response's usage.
        completion_tokens: generated tokens, from the response's usage.
        ttft_s: time to the first content chunk (seconds), None if none had content.
        chunk_times_s: arrival time of every content chunk (seconds).
        end_s: time the stream ended (seconds).
        start_s: when the request was sent, seconds since its level started.
    """

    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    chunk_times_s: list[float] = field(default_factory=list)
    end_s: float = 0.0
    start_s: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """prompt tokens / TTFT (tokens/s)."""
        if not self.ttft_s or self.ttft_s <= 0:
            return None
        return self.prompt_tokens / self.ttft_s

    @property
    def decode_tokens_per_s(self) -> float | None:
        """(completion tokens - 1) / (last content chunk - first content chunk) (tokens/s)."""
        if self.completion_tokens < 2 or len(self.chunk_times_s) < 2:
            return None
        span = self.chunk_times_s[-1] - self.chunk_times_s[0]
        if span <= 0:
            return None
        return (self.completion_tokens - 1) / span


def _error_message(response: httpx.Response, body: bytes) -> str:
    """One line naming an HTTP error: status plus the server's message if it gave one."""
    text = body.decode("utf-8", "replace").strip()
    message = text
    try:
        data = json.loads(text)
        if isinstance(data, dict):
            err = data.get("error")
            if isinstance(err, dict) and err.get("message"):
                message = str(err["message"])
            elif isinstance(err, str):
                message = err
            elif data.get("detail"):
                message = str(data["detail"])
    except ValueError:
        pass
    message = " ".join(message.split())[:300] or response.reason_phrase
    return f"HTTP {response.status_code} from {response.request.url}: {message}"


def _chat_body(model: str, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def stream_request(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                         max_tokens: int) -> RequestResult:
    """Send one streamed chat completion and time it.

    Args:
        url: the server's base URL (``http://host:port``).
        max_tokens: completion tokens to ask for (``ignore_eos`` makes it generate them all).

    Returns:
        The request's token counts and timings (seconds).

    Raises:
        BenchError: an HTTP error, an error event in the stream, or no usage in the stream.
    """
    body = _chat_body(model, prompt, max_tokens, stream=True)
    start = time.perf_counter()
    ttft = None
    chunk_times: list[float] = []
    usage = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise BenchError(_error_message(response, await response.aread()))
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter() - start
            try:
                event = json.loads(data)
            except ValueError as exc:
                raise BenchError(f"bad event in the stream from {url}: {data[:100]!r}") from exc
            if "error" in event:
                err = event["error"]
                message = err.get("message") if isinstance(err, dict) else err
                raise BenchError(f"the server failed mid-stream: {message}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunk_times.append(now)
                    if ttft is None:
                        ttft = now
                    break
        end = time.perf_counter() - start
    if usage is None:
        raise BenchError(f"{url} sent no usage in the stream (stream_options.include_usage unsupported?)")
    return RequestResult(
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        ttft_s=ttft,
        chunk_times_s=chunk_times,
        end_s=end,
    )


async def count_prompt_tokens(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> int:
    """Prompt tokens the server counts for ``prompt`` (one non-streamed one-token request)."""
    body = _chat_body(model, prompt, 1, stream=False)
    response = await client.post(f"{url}/v1/chat/completions", json=body)
    if response.status_code != 200:
        raise BenchError(_error_message(response, response.content))
    try:
        return int(response.json()["usage"]["prompt_tokens"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"{url} answered without usage.prompt_tokens") from exc


async def calibrate_words(client: httpx.AsyncClient, url: str, model: str, target_tokens: int) -> tuple[int, int]:
    """Words of text whose chat prompt is closest to ``target_tokens`` tokens.

    Returns:
        (words, prompt tokens the server counted for that many words).
    """
    base = await count_prompt_tokens(client, url, model, build_prompt(0))
    probe = max(16, int(target_tokens * 0.75))
    probe_tokens = await count_prompt_tokens(client, url, model, build_prompt(probe))
    per_word = max((probe_tokens - base) / probe, 0.1)
    words, tokens = probe, probe_tokens
    for _ in range(3):
        if tokens == target_tokens:
            break
        guess = max(0, words + round((target_tokens - tokens) / per_word))
        if guess == words:
            break
        guess_tokens = await count_prompt_tokens(client, url, model, build_prompt(guess))
        if abs(guess_tokens - target_tokens) >= abs(tokens - target_tokens):
            break
        words, tokens = guess, guess_tokens
    return words, tokens


# -- one concurrency level ---------------------------------------------------------------


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize_level(concurrency: int, results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """Figures of one concurrency level.

    Args:
        results: every request of the level.
        wall_s: the level's wall time (seconds), first request sent to last finished.

    Returns:
        A dict with ``median_ttft_ms`` (milliseconds), ``median_prefill_tokens_per_s``,
        ``median_decode_tokens_per_s`` (per request), ``aggregate_decode_tokens_per_s``
        (tokens/s), token counts, ``wall_s`` (seconds) and the raw per-request figures.
    """
    ttft_ms = _median([r.ttft_s * 1000 if r.ttft_s is not None else None for r in results])
    total_completion = sum(r.completion_tokens for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "median_prompt_tokens": _median([r.prompt_tokens for r in results]),
        "median_completion_tokens": _median([r.completion_tokens for r in results]),
        "median_ttft_ms": ttft_ms,
        "median_prefill_tokens_per_s": _median([r.prefill_tokens_per_s for r in results]),
        "median_decode_tokens_per_s": _median([r.decode_tokens_per_s for r in results]),
        "aggregate_decode_tokens_per_s": total_completion / wall_s if wall_s > 0 else None,
        "total_completion_tokens": total_completion,
        "wall_s": wall_s,
        "per_request": [
            {
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "start_s": r.start_s,
                "ttft_s": r.ttft_s,
                "end_s": r.end_s,
                "content_chunks": len(r.chunk_times_s),
                "prefill_tokens_per_s": r.prefill_tokens_per_s,
                "decode_tokens_per_s": r.decode_tokens_per_s,
            }
            for r in results
        ],
    }


async def run_level(client: httpx.AsyncClient, url: str, model: str, words: int, gen_tokens: int,
                    concurrency: int, requests: int) -> dict[str, Any]:
    """Send ``requests`` requests with at most ``concurrency`` in flight; summarise them.

    Args:
        words: prompt text length in words (from :func:`calibrate_words`).
        gen_tokens: completion tokens per request.
    """
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    results: list[RequestResult] = []
    level_start = time.perf_counter()

    async def worker() -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            sent = time.perf_counter() - level_start
            result = await stream_request(client, url, model, build_prompt(words, variant=i), gen_tokens)
            result.start_s = sent
            results.append(result)

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, requests)):
                group.create_task(worker())
    except ExceptionGroup as group_error:  # one failed request ends the level; report the first
        first = group_error.exceptions[0]
        while isinstance(first, ExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    wall = time.perf_counter() - level_start
    return summarize_level(concurrency, results, wall)


# -- the whole benchmark -----------------------------------------------------------------


@dataclass
class BenchConfig:
    """What to measure. Token counts in tokens."""

    url: str
    model: str
    nodes: int | None
    sharding: str | None
    prompt_tokens: int
    gen_tokens: int
    concurrency: list[int]
    runs: int
    warmup: bool


async def run_bench(config: BenchConfig, progress=None) -> dict[str, Any]:
    """Calibrate the prompt, warm up, run every concurrency level.

    Returns:
        ``{"config": ..., "prompt_words": ..., "calibrated_prompt_tokens": ...,
        "aggregate_definition": ..., "levels": [summarize_level(...), ...]}``.

    Raises:
        BenchError: an HTTP error or a malformed answer.
    """
    say = progress or (lambda _msg: None)
    timeout = httpx.Timeout(30.0, read=600.0)
    limits = httpx.Limits(max_connections=max(config.concurrency) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        say(f"calibrating a prompt of about {config.prompt_tokens} tokens")
        words, calibrated = await calibrate_words(client, config.url, config.model, config.prompt_tokens)
        if config.warmup:
            say("warm-up request")
            await stream_request(client, config.url, config.model, build_prompt(words, variant=7),
                                 config.gen_tokens)
        levels = []
        for c in config.concurrency:
            n = max(config.runs, c)
            say(f"concurrency {c}: {n} requests")
            levels.append(await run_level(client, config.url, config.model, words,
                                          config.gen_tokens, c, n))
    return {
        "config": asdict(config),
        "prompt_words": words,
        "calibrated_prompt_tokens": calibrated,
        "aggregate_definition": AGGREGATE_DEFINITION,
        "levels": levels,
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def print_report(report: dict[str, Any], console=None) -> None:
    """Print the header line and a rich table of the per-level figures."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    cfg = report["config"]
    levels = report["levels"]
    real_prompt = _median([lv["median_prompt_tokens"] for lv in levels])
    nodes = cfg["nodes"] if cfg["nodes"] is not None else "?"
    sharding = cfg["sharding"] or "?"
    node_word = "node" if nodes == 1 else "nodes"
    console.print(
        f"[bold]shardline bench[/bold] · {cfg['model']} · {nodes} {node_word} · {sharding} · "
        f"prompt {cfg['prompt_tokens']} tokens (real {_fmt(real_prompt, 0)}) · gen {cfg['gen_tokens']} tokens",
        highlight=False,
    )
    console.print(f"[dim]server {cfg['url']}[/dim]", highlight=False)
    table = Table(caption=f"TTFT, prefill and per-request decode: medians over the level's requests.\n"
                          f"{AGGREGATE_DEFINITION}.",
                  caption_justify="left")
    for title in ("concur-\nrency", "reqs", "prompt\ntokens", "gen\ntokens", "TTFT\n(ms)", "prefill\ntok/s",
                  "decode\ntok/s\nper req.", "decode\ntok/s\naggregate"):
        table.add_column(title, justify="right", no_wrap=True)
    for lv in levels:
        table.add_row(
            str(lv["concurrency"]),
            str(lv["requests"]),
            _fmt(lv["median_prompt_tokens"], 0),
            _fmt(lv["median_completion_tokens"], 0),
            _fmt(lv["median_ttft_ms"], 1),
            _fmt(lv["median_prefill_tokens_per_s"], 1),
            _fmt(lv["median_decode_tokens_per_s"], 1),
            _fmt(lv["aggregate_decode_tokens_per_s"], 1),
        )
    console.print(table)


# -- CLI ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``shardline bench``'s options to its subparser."""
    from shardline.models.store import DEFAULT_MODEL_ID
    from shardline.placement.ranks import SHARDINGS

    parser.add_argument("--url", default=None,
                        help="benchmark this running node (http://host:port); default: start a local cluster")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the local cluster (default %(default)s)")
    parser.add_argument("--sharding", default="pipeline", choices=SHARDINGS,
                        help="sharding of the local cluster (default %(default)s)")
    parser.add_argument("--model", default=None,
                        help=f"model id or local path (default {DEFAULT_MODEL_ID}; "
                             "with --url: the node's first model)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="first port of the local cluster (default %(default)s)")
    parser.add_argument("--runner-threads", type=int, default=0,
                        help="torch threads per runner of the local cluster (0: cores / nodes)")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="prompt length in tokens, chat template included (default %(default)s)")
    parser.add_argument("--gen-tokens", type=int, default=128,
                        help="tokens generated per request (default %(default)s)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1],
                        help="requests in flight at once; several values give several levels (default 1)")
    parser.add_argument("--runs", type=int, default=3,
                        help="requests per concurrency level, at least the concurrency (default %(default)s)")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                        help="also write the results as JSON to PATH")
    parser.add_argument("--memory", action="store_true",
                        help="after the workload, print each rank's memory: file bytes of its shard, "
                             "placement's estimate, resident set steady and at its peaks")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="send one unmeasured request first (default on)")


def _fail(message: str) -> int:
    print(f"shardline bench: {message}", file=sys.stderr)
    return 1


def _check_args(args: argparse.Namespace) -> str | None:
    if args.prompt_tokens < 1:
        return "--prompt-tokens must be at least 1"
    if args.gen_tokens < 2:
        return "--gen-tokens must be at least 2 (decode speed needs two tokens)"
    if any(c < 1 for c in args.concurrency):
        return "--concurrency values must be at least 1"
    if args.runs < 1:
        return "--runs must be at least 1"
    if args.nodes < 1:
        return "--nodes must be at least 1"
    if args.json_path:
        folder = os.path.dirname(os.path.abspath(args.json_path))
        if not os.path.isdir(folder):
            return f"--json {args.json_path}: folder {folder} does not exist"
    return None


def _describe_connect_error(url: str, exc: Exception) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return f"{url} did not answer in time ({type(exc).__name__})"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot reach {url}: {exc or 'connection failed'}"
    return f"request to {url} failed: {type(exc).__name__}: {exc}"


def _server_info(url: str, model: str | None) -> tuple[str, int | None, str | None]:
    """(model id, nodes, sharding) of a running server; nodes/sharding None if unknown."""
    response = httpx.get(f"{url}/v1/models", timeout=10)
    if response.status_code != 200:
        raise BenchError(_error_message(response, response.content))
    try:
        ids = [m["id"] for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"{url}/v1/models did not answer with a model list") from exc
    if not ids:
        raise BenchError(f"{url} serves no model yet (GET /v1/models is empty)")
    if model is None:
        model = ids[0]
    elif model not in ids:
        raise BenchError(f"{url} does not serve {model!r} (it serves: {', '.join(ids)})")
    nodes, sharding = _wait_ready(url, model)
    return model, nodes, sharding


def _wait_ready(url: str, model: str, timeout_s: float = 120.0) -> tuple[int | None, str | None]:
    """(nodes, sharding) of the model's ready shardline instance, waiting while it loads.

    shardline's ``/v1/models`` already lists a model while it is loading; its cluster API
    (``/cluster/instances``) tells when it serves. Other OpenAI servers lack that API:
    (None, None) at once.

    Raises:
        BenchError: the model is still loading after ``timeout_s`` seconds, or it failed.
    """
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        try:
            response = httpx.get(f"{url}/cluster/instances", timeout=10)
            instances = [i for i in response.json()["instances"] if i["model_id"] == model]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None, None
        for inst in instances:
            if inst["status"] == "ready":
                return len(inst["ranks"]), inst["sharding"]
        if not any(i["status"] == "loading" for i in instances):
            failed = [i.get("error") for i in instances if i["status"] == "failed"]
            if failed:
                raise BenchError(f"{model!r} failed on {url}: {failed[0]}")
            return None, None
        if time.monotonic() > deadline:
            raise BenchError(f"{model!r} was still loading on {url} after {timeout_s:.0f} s")
        if not said:
            _progress(f"waiting for {model} to finish loading on {url}")
            said = True
        time.sleep(0.5)


def _busy_port(base: int, count: int) -> int | None:
    """The first port in ``base .. base+count-1`` that something already listens on, else None."""
    for port in range(base, base + count):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return port
    return None


def _progress(message: str) -> None:
    print(f"shardline bench: {message}", file=sys.stderr, flush=True)


def _bench_url(args: argparse.Namespace, url: str, model: str, nodes: int | None,
               sharding: str | None) -> int:
    config = BenchConfig(
        url=url, model=model, nodes=nodes, sharding=sharding,
        prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
        concurrency=list(args.concurrency), runs=args.runs, warmup=args.warmup,
    )
    report = asyncio.run(run_bench(config, _progress))
    print_report(report)
    if args.memory:
        from shardline.bench.memory import MemoryReportError, print_memory, rank_memory

        try:
            report["memory"] = rank_memory(url, model)
        except MemoryReportError as exc:
            raise BenchError(f"memory report: {exc}") from exc
        print_memory(report["memory"])
    short = [r["completion_tokens"] for lv in report["levels"] for r in lv["per_request"]
             if r["completion_tokens"] < args.gen_tokens]
    if short:
        _progress(f"warning: {len(short)} request(s) generated fewer than {args.gen_tokens} tokens "
                  f"(as few as {min(short)}): the server ignored ignore_eos or the context is full")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
        _progress(f"wrote {args.json_path}")
    return 0


def main(args: argparse.Namespace) -> int:
    """Run ``shardline bench``; 0 on success, 1 with a one-line message on stderr otherwise."""
    problem = _check_args(args)
    if problem:
        return _fail(problem)
    # SIGTERM (e.g. from ``timeout``) must still stop a local cluster: its nodes run in
    # their own sessions and would outlive this process.
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        previous = None
    try:
        return _main(args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _main(args: argparse.Namespace) -> int:
    cluster = None
    log_dir = None
    url = args.url.rstrip("/") if args.url else None
    try:
        if url is not None:
            if "://" not in url:
                url = f"http://{url}"
            model, nodes, sharding = _server_info(url, args.model)
        else:
            from shardline.models.store import DEFAULT_MODEL_ID

            busy = _busy_port(args.port, args.nodes)
            if busy is not None:
                return _fail(f"port {busy} is in use; pick other ports with --port, or bench it with --url")
            log_dir = tempfile.mkdtemp(prefix="shardline-bench-")
            _progress(f"starting a {args.nodes}-node cluster on ports {args.port}-"
                      f"{args.port + args.nodes - 1} (node logs in {log_dir})")
            cluster = LocalCluster(nodes=args.nodes, base_port=args.port,
                                   runner_threads=args.runner_threads, log_dir=log_dir)
            cluster.start()
            _progress(f"placing {args.model or DEFAULT_MODEL_ID} ({args.sharding})")
            cluster.clear()  # instances the bench's own nodes kept from an earlier run
            instance = cluster.place(args.model or DEFAULT_MODEL_ID, args.sharding)
            url = cluster.url(0)
            model, nodes, sharding = instance["model_id"], len(instance["ranks"]), instance["sharding"]
        return _bench_url(args, url, model, nodes, sharding)
    except BenchError as exc:
        return _fail(str(exc))
    except httpx.HTTPError as exc:
        target = url or (cluster.url(0) if cluster is not None else "the cluster")
        return _fail(_describe_connect_error(target, exc))
    except OSError as exc:  # e.g. --json PATH not writable
        return _fail(str(exc))
    except KeyboardInterrupt:
        print("shardline bench: interrupted", file=sys.stderr)
        return 130
    except LocalClusterError as exc:
        where = f" (node logs in {log_dir})" if log_dir else ""
        return _fail(f"local cluster: {exc}{where}")
    finally:
        if cluster is not None:
            _progress("stopping the local cluster")
            cluster.stop()
