"""``shardline bench``'s measurements: one streamed request, one concurrency level, and the
prompts they send.

The benchmark talks to the OpenAI-compatible API only (``GET /v1/models``, streamed and
non-streamed ``POST /v1/chat/completions``), as vLLM's ``benchmark_serving`` does, so it
measures what a client sees: HTTP, tokenization and the chat template are included in every
figure, and any OpenAI-compatible server (llama.cpp's ``llama-server``, vLLM, another
shardline) can be measured the same way. Every request body holds only ``model``,
``messages``, ``temperature``, ``max_tokens``, ``ignore_eos``, ``stream`` and
``stream_options``, fields shardline (:mod:`shardline.api.params`), vLLM and llama-server
all take.

Per request (times in seconds from the moment the request is sent):

- TTFT: until the first chunk that carries content;
- prefill tokens/s: prompt tokens (from the response's ``usage``) / TTFT;
- decode tokens/s: (completion tokens - 1) / (last content chunk - first content chunk).

Token counts come from the usage of the stream's last chunk (``stream_options:
{include_usage: true}``); a server that sends none has its content chunks counted as
completion tokens and the calibrated prompt length taken as its prompt tokens
(``usage_from: "chunks"`` in the figures). The prompt tokens a server's prompt cache held
come from ``usage.prompt_tokens_details.cached_tokens`` where it reports them.

A conversation (:func:`run_conversation`) sends its turns one after another, each request
the whole chat so far: a system prompt where it has one (an agent's: tool definitions,
:func:`agent_system_prompt`), the earlier user messages, the answers the server gave, and
a new user message. After each turn the same messages go again with ``cache_prompt: false``
(llama.cpp's server's parameter, and shardline's), so the server prefills the whole
prompt: that turn's TTFT without the cache. The next turn waits a think time first
(a person reading and typing, an agent running its tool: what a server may use to cache
the answer). Its figures are each turn's TTFT with and without the cache, the first
turn's and the last turn's.

Per concurrency level c (its requests, at most c in flight at once):

- aggregate decode tokens/s: all completion tokens of the level / the level's wall time
  (first request sent to last request finished, so prefill time is included; this is
  vLLM's "output token throughput").

The prompt is repeated varied English text sized to about the asked number of tokens of the
full chat prompt (template included): its length is calibrated against the server's own
token counts (``usage.prompt_tokens`` of non-streamed one-token requests). Each request's
text starts at another word, so a server's prompt cache (llama-server keeps each slot's last
prompt) finds only the instruction line and the template's prefix in common.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

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
_MIN_SENTENCE_WORDS = min(len(s.split()) for s in _SENTENCES)
_PROMPT_PREFIX = "Read the following text, then summarise it in a few sentences.\n\n"
_CHAT_QUESTIONS = [  # each 37 tokens with SmolLM2's chat template and its default system prompt
    "What is the capital of France?",
    "How many legs has a spider?",
    "Which planet is nearest the sun?",
    "What do blue and yellow make?",
    "Who wrote the famous play Hamlet?",
    "Which ocean is the largest one?",
    "How many days has leap year?",
    "Which gas do plants take in?",
    "At what temperature does water boil?",
    "Which animal is called the king?",
    "What language is spoken in Brazil?",
    "How many minutes make an hour?",
]


class BenchError(RuntimeError):
    """The benchmark cannot go on; the message names the problem in one line."""


# -- prompt ------------------------------------------------------------------------------


def build_prompt(words: int, variant: int = 0) -> str:
    """User message of about ``words`` words of varied English text.

    Args:
        words: number of words of text after the instruction line.
        variant: where the text starts: sentence ``variant % 20``, skipping the first
            ``variant // 20`` words, so the first 240 variants all differ right after the
            instruction line (then they repeat).
    """
    variant %= len(_SENTENCES) * _MIN_SENTENCE_WORDS
    out: list[str] = []
    i = variant
    skip = variant // len(_SENTENCES)
    while len(out) < words + skip:
        out.extend(_SENTENCES[i % len(_SENTENCES)].split())
        i += 1
    return _PROMPT_PREFIX + " ".join(out[skip : skip + words])


def chat_question(variant: int) -> str:
    """A short chat question (``variant`` picks one of 12, in turn): with SmolLM2's chat
    template and its default system prompt 37 prompt tokens (the issue's short chat)."""
    return _CHAT_QUESTIONS[variant % len(_CHAT_QUESTIONS)]


def agent_system_prompt(words: int, variant: int = 0) -> str:
    """A coding agent's system prompt of about ``words`` words: an instruction line, then
    tool definitions as JSON schemas (each tool a name, a description of the bench's
    sentences and two parameters), as Claude Code, Codex and opencode send theirs.
    ``variant`` names the tools, so each variant's differs from its first tool on."""
    out = [
        "You are a coding agent working in the user's repository. Use the tools below to "
        "read, search and change files; answer briefly.\n\nTools:"
    ]
    count, i = len(out[0].split()), 0
    while count < words:
        description = " ".join(_SENTENCES[(variant + i + k) % len(_SENTENCES)] for k in range(3))
        tool = json.dumps(
            {
                "name": f"tool_{variant}_{i}",
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "a file's path"},
                        "limit": {"type": "integer", "description": "most lines"},
                    },
                    "required": ["path"],
                },
            }
        )
        out.append(tool)
        count += len(tool.split())
        i += 1
    return "\n".join(out)


# -- one request -------------------------------------------------------------------------


@dataclass
class RequestResult:
    """What one streamed request measured. Times are seconds since the request was sent.

    Attributes:
        prompt_tokens: prompt length in tokens, from the response's usage.
        completion_tokens: generated tokens, from the response's usage.
        usage_from: ``"usage"``, or ``"chunks"`` where the stream had no usage: then the
            completion tokens are the content chunks counted and the prompt tokens the
            calibrated length.
        ttft_s: time to the first content chunk (seconds), None if none had content.
        chunk_times_s: arrival time of every content chunk (seconds).
        end_s: time the stream ended (seconds).
        start_s: when the request was sent, seconds since its level started.
    """

    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    usage_from: str = "usage"
    chunk_times_s: list[float] = field(default_factory=list)
    end_s: float = 0.0
    start_s: float = 0.0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where given
    text: str = ""  # the content it streamed

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


def connect_error_message(url: str, exc: Exception) -> str:
    """One line naming a failed connection to ``url`` (a timeout, a refused connection, ...)."""
    if isinstance(exc, httpx.TimeoutException):
        return f"{url} did not answer in time ({type(exc).__name__})"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot reach {url}: {exc or 'connection failed'}"
    return f"request to {url} failed: {type(exc).__name__}: {exc}"


def _chat_body(
    model: str,
    prompt: str | list[dict[str, str]],
    max_tokens: int,
    stream: bool,
    cache_prompt: bool | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if cache_prompt is not None:
        body["cache_prompt"] = cache_prompt
    return body | (extra or {})


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str | list[dict[str, str]],
    max_tokens: int,
    prompt_tokens: int = 0,
    cache_prompt: bool | None = None,
    extra: dict[str, Any] | None = None,
) -> RequestResult:
    """Send one streamed chat completion and time it.

    Args:
        url: the server's base URL (``http://host:port``).
        prompt: the user message, or the chat's messages.
        max_tokens: completion tokens to ask for (``ignore_eos`` makes it generate them all).
        prompt_tokens: the prompt's calibrated length, taken where the stream has no usage.
        cache_prompt: sent as the body's ``cache_prompt`` (False: the whole prompt
            prefilled, on shardline and llama-server); None: not sent.
        extra: more fields of the body (``speculative.n_max``).

    Returns:
        The request's token counts and timings (seconds).

    Raises:
        BenchError: an HTTP error or an error event in the stream.
        httpx.HTTPError: the connection failed.
    """
    body = _chat_body(model, prompt, max_tokens, stream=True, cache_prompt=cache_prompt, extra=extra)
    start = time.perf_counter()
    ttft = None
    chunk_times: list[float] = []
    usage = None
    text: list[str] = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise BenchError(error_message(response, await response.aread()))
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
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
                    text.append(choice["delta"]["content"])
                    chunk_times.append(now)
                    if ttft is None:
                        ttft = now
                    break
        end = time.perf_counter() - start
    return _request_result(usage, prompt_tokens, ttft, chunk_times, end, "".join(text))


def _request_result(
    usage: dict | None, prompt_tokens: int, ttft: float | None, chunk_times: list[float], end: float, text: str
) -> RequestResult:
    """A streamed request's result: its counts from the stream's ``usage``, or where it had
    none, the calibrated ``prompt_tokens`` and the content chunks counted."""
    if usage is None:
        return RequestResult(
            prompt_tokens=prompt_tokens,
            completion_tokens=len(chunk_times),
            ttft_s=ttft,
            usage_from="chunks",
            chunk_times_s=chunk_times,
            end_s=end,
            text=text,
        )
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return RequestResult(
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        ttft_s=ttft,
        chunk_times_s=chunk_times,
        end_s=end,
        cached_tokens=None if cached is None else int(cached),
        text=text,
    )


async def count_prompt_tokens(
    client: httpx.AsyncClient, url: str, model: str, prompt: str | list[dict[str, str]]
) -> int:
    """Prompt tokens the server counts for ``prompt`` (a user message, or the chat's
    messages: one non-streamed one-token request)."""
    body = _chat_body(model, prompt, 1, stream=False)
    response = await client.post(f"{url}/v1/chat/completions", json=body)
    if response.status_code != 200:
        raise BenchError(error_message(response, response.content))
    try:
        return int(response.json()["usage"]["prompt_tokens"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"{url} answered without usage.prompt_tokens") from exc


async def calibrate_words(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    target_tokens: int,
    build: Callable[[int], str | list[dict[str, str]]] = build_prompt,
) -> tuple[int, int]:
    """Words of text whose chat prompt is closest to ``target_tokens`` tokens.

    Args:
        build: the prompt of so many words (a user message, or the chat's messages).

    Returns:
        (words, prompt tokens the server counted for that many words).
    """
    base = await count_prompt_tokens(client, url, model, build(0))
    probe = max(16, target_tokens // 2)  # words: under the target, JSON's ~1.8 tokens a word too
    probe_tokens = await count_prompt_tokens(client, url, model, build(probe))
    per_word = max((probe_tokens - base) / probe, 0.1)
    words, tokens = probe, probe_tokens
    for _ in range(3):
        if tokens == target_tokens:
            break
        guess = max(0, words + round((target_tokens - tokens) / per_word))
        if guess == words:
            break
        guess_tokens = await count_prompt_tokens(client, url, model, build(guess))
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
        "usage_from": "usage" if all(r.usage_from == "usage" for r in results) else "chunks",
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


async def run_level(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompts: list[str],
    gen_tokens: int,
    concurrency: int,
    prompt_tokens: int = 0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Send one request per prompt with at most ``concurrency`` in flight; summarise them
    (:func:`summarize_level`).

    Args:
        prompts: the requests' user messages (:func:`build_prompt`, :func:`chat_question`).
        gen_tokens: completion tokens per request.
        prompt_tokens: the prompts' calibrated length, for a server whose stream has no usage.
        extra: more fields of each request's body.

    Raises:
        BenchError, httpx.HTTPError: the first request that failed (:func:`stream_request`).
    """
    requests = len(prompts)
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
            result = await stream_request(client, url, model, prompts[i], gen_tokens, prompt_tokens, extra=extra)
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


# -- code editing ------------------------------------------------------------------------


def code_file(functions: int, variant: int = 0) -> str:
    """A Python file of ``functions`` small functions (about 40 tokens each), its numbers
    varied by ``variant``: what a coding agent asks a model to repeat with a change."""
    out = [f'"""Helpers of module {variant}."""\n']
    for i in range(functions):
        a, b = (variant * 7 + i * 3) % 17 + 1, (variant * 5 + i) % 13 + 2
        out.append(
            f"def step_{i}(values, scale={a}):\n"
            f'    """Return each value times {a}, plus {b} where it is odd."""\n'
            f"    return [v * scale + ({b} if v % 2 else 0) for v in values]\n"
        )
    return "\n\n".join(out)


def edit_request(functions: int, variant: int) -> str:
    """A user message asking for :func:`code_file` back with one change: the output
    repeats the prompt, which speculative decoding by prompt lookup guesses."""
    return (
        f"```python\n{code_file(functions, variant)}\n```\n\nRepeat the whole file above, "
        "unchanged but for the first function's name: call it `first_step`."
    )


SPECULATIVE = "speculative.n_max"
"""The request field that asks for speculative decoding (llama.cpp's, shardline's)."""


async def run_edits(
    client: httpx.AsyncClient, url: str, model: str, prompts: list[str], gen_tokens: int, draft_tokens: int
) -> dict[str, Any]:
    """The code-editing workload: each prompt (:func:`edit_request`) sent without
    speculative decoding (``speculative.n_max`` 0), then with ``draft_tokens``; the
    figures of both (:func:`summarize_level`'s), those with it under ``speculative_``."""
    plain = await run_level(client, url, model, prompts, gen_tokens, 1, extra={SPECULATIVE: 0})
    drafted = await run_level(client, url, model, prompts, gen_tokens, 1, extra={SPECULATIVE: draft_tokens})
    return plain | {f"speculative_{key}": value for key, value in drafted.items()}


# -- a conversation ----------------------------------------------------------------------


def summarize_conversation(
    results: list[RequestResult], uncached: list[RequestResult], wall_s: float
) -> dict[str, Any]:
    """Figures of one conversation (its turns' results, in order, and each turn's prompt sent
    again without the cache, one a turn): ``first_ttft_ms``, ``last_ttft_ms`` and
    ``last_uncached_ttft_ms`` (milliseconds), the last turn's prompt tokens, and each turn's
    prompt tokens, cached tokens (None where the server reports none), TTFT and TTFT
    without the cache."""

    def ms(r: RequestResult) -> float | None:
        return None if r.ttft_s is None else r.ttft_s * 1000

    return {
        "requests": len(results),
        "median_prompt_tokens": results[-1].prompt_tokens if results else None,
        "median_completion_tokens": median([r.completion_tokens for r in results]),
        "first_ttft_ms": ms(results[0]) if results else None,
        "last_ttft_ms": ms(results[-1]) if results else None,
        "last_uncached_ttft_ms": ms(uncached[-1]) if uncached else None,
        "wall_s": wall_s,
        "usage_from": "usage" if all(r.usage_from == "usage" for r in results) else "chunks",
        "per_request": [
            {
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "completion_tokens": r.completion_tokens,
                "start_s": r.start_s,
                "ttft_s": r.ttft_s,
                "end_s": r.end_s,
                "uncached_ttft_s": u.ttft_s,
                "uncached_cached_tokens": u.cached_tokens,
            }
            for r, u in zip(results, uncached, strict=True)
        ],
    }


UNCACHED_GEN_TOKENS = 2
"""Tokens a turn's prompt sent again without the cache generates: only its TTFT is a figure."""


async def run_conversation(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    user_messages: list[str],
    gen_tokens: int,
    system: str | None = None,
    think_s: float = 0.0,
) -> dict[str, Any]:
    """One chat of ``len(user_messages)`` turns, one after another: each turn sends the chat
    so far (``system`` first where given, every earlier user message and the server's
    answer to it) with the next user message, and the answer it streams (``gen_tokens``
    tokens) joins the chat; half ``think_s`` later the same messages go again with
    ``cache_prompt: false`` (:data:`UNCACHED_GEN_TOKENS` tokens), for the turn's TTFT
    without the cache, and the next turn follows half ``think_s`` after that. The first
    half is the server's to finish what the turn left (shardline's cache extends over the
    answer while idle), so the uncached prompt does not wait behind it. Summarised by
    :func:`summarize_conversation` (the wall time without the waits).

    Raises:
        BenchError, httpx.HTTPError: a turn failed (:func:`stream_request`).
    """
    messages: list[dict[str, str]] = [] if system is None else [{"role": "system", "content": system}]
    results: list[RequestResult] = []
    uncached: list[RequestResult] = []
    started = time.perf_counter()
    for turn, text in enumerate(user_messages):
        if turn and think_s:
            await asyncio.sleep(think_s / 2)
            started += think_s / 2
        messages.append({"role": "user", "content": text})
        sent = time.perf_counter() - started
        result = await stream_request(client, url, model, list(messages), gen_tokens)
        result.start_s = sent
        results.append(result)
        if think_s:
            await asyncio.sleep(think_s / 2)
            started += think_s / 2
        again = await stream_request(client, url, model, list(messages), UNCACHED_GEN_TOKENS, cache_prompt=False)
        again.start_s = result.start_s + result.end_s
        uncached.append(again)
        messages.append({"role": "assistant", "content": result.text})
    return summarize_conversation(results, uncached, time.perf_counter() - started)
