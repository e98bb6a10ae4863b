"""``shardline bench``: prefill tokens/s, decode tokens/s and TTFT of a (local) cluster.

The benchmark talks to the OpenAI-compatible API only (``GET /v1/models`` and streamed
``POST /v1/chat/completions``), as vLLM's ``benchmark_serving`` does, so it measures what a
client sees: HTTP, tokenization and the chat template are included in every figure.

The command (``shardline.bench.command``) without ``--url`` starts a local cluster
(``shardline.local_cluster.LocalCluster``), places the model, benchmarks node 0 and stops
the cluster again.

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

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

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


def error_message(response: httpx.Response, body: bytes) -> str:
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
            raise BenchError(error_message(response, await response.aread()))
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
        raise BenchError(error_message(response, response.content))
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


def median(values: list[float | None]) -> float | None:
    """The median of the values that are not None (None when none is)."""
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
    ttft_ms = median([r.ttft_s * 1000 if r.ttft_s is not None else None for r in results])
    total_completion = sum(r.completion_tokens for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "median_prompt_tokens": median([r.prompt_tokens for r in results]),
        "median_completion_tokens": median([r.completion_tokens for r in results]),
        "median_ttft_ms": ttft_ms,
        "median_prefill_tokens_per_s": median([r.prefill_tokens_per_s for r in results]),
        "median_decode_tokens_per_s": median([r.decode_tokens_per_s for r in results]),
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


async def run_bench(config: BenchConfig, progress=None, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Calibrate the prompt, warm up, run every concurrency level; ``headers`` go with
    every request (an API key's: kept out of the report).

    Returns:
        ``{"config": ..., "prompt_words": ..., "calibrated_prompt_tokens": ...,
        "aggregate_definition": ..., "levels": [summarize_level(...), ...]}``.

    Raises:
        BenchError: an HTTP error or a malformed answer.
    """
    say = progress or (lambda _msg: None)
    timeout = httpx.Timeout(30.0, read=600.0)
    limits = httpx.Limits(max_connections=max(config.concurrency) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
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
