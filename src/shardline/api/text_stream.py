"""What every text API (OpenAI, Anthropic, Ollama) shares: the request in the engine's
terms, its check against the context, and turning the node's token stream into text
deltas with stop strings, for a client that may leave at any time (finding the instance
and tokenizing the prompt: :mod:`shardline.api.preparation`).

Each API parses its own request into a :class:`GenerationRequest` and formats the results
and :class:`APIError` its own way.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from shardline.api.harmony import MARKERS as HARMONY_MARKERS
from shardline.api.harmony import HarmonySplitter
from shardline.api.heartbeat import Heartbeat, with_heartbeats
from shardline.api.logprobs import HeldLogprobs, TokenLogprob, token_logprob
from shardline.api.reasoning import THINK_CLOSE, ReasoningSplitter, prompt_opens_thinking
from shardline.api.tools import (
    ToolCall,
    ToolCallParser,
    ToolChoice,
    ToolChoiceMode,
    ToolFormat,
    call_markers,
    strict_schemas,
    tool_format,
    tool_names,
)
from shardline.models.tokenizer import THINK_OPEN, IncrementalDetokenizer, Tokenizer, template_is_harmony
from shardline.node.node import Node
from shardline.node.table import Instance, InstanceFailedError
from shardline.runner.protocol import PrefillProgress, SamplingParams, TokenEvent, TokenRequest

if TYPE_CHECKING:
    from shardline.api.metrics import RequestMetrics


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""The ``code`` of a 400 for a prompt and ``max_tokens`` beyond the context (OpenAI's)."""
PROMPT_TAIL_TOKENS = 8
"""The prompt's last tokens whose text says whether the output starts inside the thinking."""


class APIError(Exception):
    """A request that cannot be served, with its HTTP status.

    ``kind`` is one of ``invalid_request_error``, ``not_found_error``, ``server_error``;
    ``param`` names the offending request field and ``code`` a machine-readable reason
    (e.g. ``context_length_exceeded``), where known.
    """

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


@dataclass
class GenerationRequest:
    """One request in the terms the engine runs it.

    ``max_tokens`` None means as many as the context leaves. ``prompt`` is text (tokenized
    with the model's BOS where it asks for one, its special-token text taken as those
    tokens), token ids, or chat messages (``[{"role", "content"}]``, rendered by the model's
    chat template; special-token text in a message stays text: see
    :meth:`~shardline.models.tokenizer.Tokenizer.encode_chat`).
    """

    model: str
    prompt: str | list[int] | list[dict[str, Any]]
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(1.0, 1.0, 0, None))
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    cache_prompt: bool = True  # it may resume from a cached prefix (llama.cpp's cache_prompt)
    api: str = "openai"  # which API took it, for the metrics
    max_tokens_param: str = "max_tokens"  # the API's names of the limit and the prompt,
    prompt_param: str = "prompt"  # for error messages
    context: int | None = None  # the request's own context window (Ollama's num_ctx), at most the instance's
    continue_final_message: bool = False  # a last assistant message is continued (a prefill)
    max_tokens_capped: bool = False  # a limit beyond the context ends there (Ollama's num_predict), not a 400
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI function tools (api.tools)
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice(ToolChoiceMode.AUTO))
    max_tool_calls: int | None = None  # 1: parallel_tool_calls false (later calls dropped)
    name_param: str | None = None  # the API's name of a message's "name" when its client sets it
    truncate_history: bool = False  # a chat past the context loses its oldest messages (Ollama's)
    thinking: bool | None = None  # a reasoning model thinks first (the template's enable_thinking); None: its default
    effort: str | None = None  # the reasoning effort asked (OpenAI's levels; models.tokenizer.REASONING_LEVELS)

    def window(self, instance_context: int) -> int:
        """Tokens of context this request may use, prompt and completion: its own window
        (Ollama's ``num_ctx``) where it gives one, at most the instance's."""
        return min(instance_context, self.context or instance_context)

    @property
    def is_chat(self) -> bool:
        """The prompt is chat messages (rendered by the chat template)."""
        return isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], dict)

    @property
    def offers_tools(self) -> bool:
        """Tools are rendered into the prompt and calls parsed from the output."""
        return bool(self.tools) and self.tool_choice.mode is not ToolChoiceMode.NONE


@dataclass(frozen=True)
class Chunk:
    """A piece of a generation's output, as :meth:`Generation.texts` yields it.

    Attributes:
        text: content text (possibly empty): a reasoning model's answer, never its reasoning.
        finish: None until the last chunk; then ``stop`` (an end token or a stop string),
            ``length`` (max_tokens or the context), ``tool_calls`` (it ended after calling
            tools) or ``cancelled``.
        logprobs: the tokens generated since the last chunk, with their log-probabilities,
            when the request asked for them.
        tool_calls: calls the output made, each once complete (their text is never in
            ``text``: :class:`~shardline.api.tools.ToolCallParser`).
        reasoning: a reasoning model's thinking (the text between ``<think>`` and
            ``</think>``: :class:`~shardline.api.reasoning.ReasoningSplitter`), before
            any ``text`` of the output; possibly empty.
    """

    text: str = ""
    finish: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str = ""


class StopMatcher:
    """Finds stop strings in streamed text, holding back text that may begin one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None  # the stop string reached, once reached

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to send, whether a stop string was reached)."""
        self.pending += text
        for stop in self.stops:
            index = self.pending.find(stop)
            if index >= 0:
                out, self.pending = self.pending[:index], ""
                self.matched = stop
                return out, True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def check_room(req: GenerationRequest, prompt_tokens: int, instance_context: int) -> int:
    """The completion tokens the context leaves a prompt of ``prompt_tokens`` (at least 1).

    Raises:
        APIError: 400 ``context_length_exceeded`` where the prompt fills the context (the
            instance's, or the request's own window), or ``max_tokens`` asks for more than
            it leaves (unless the request caps it there, as Ollama's ``num_predict``).
    """
    context = req.window(instance_context)
    room = context - prompt_tokens
    if room < 1 or (req.max_tokens is not None and req.max_tokens > room and not req.max_tokens_capped):
        raise APIError(
            400,
            too_long(req, prompt_tokens, context, own_window=context != instance_context),
            param=req.max_tokens_param if room >= 1 else req.prompt_param,
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    return room


def too_long(
    req: GenerationRequest, prompt_tokens: int, context: int, own_window: bool = False, at_least: bool = False
) -> str:
    """The message of a request its context cannot take, in the words of its API's
    reference, which clients parse to shorten a request and retry: Anthropic's (Claude
    Code lowers ``max_tokens`` on "input length and `max_tokens` exceed context limit: A
    + B > C", and compacts on "prompt is too long"), OpenAI's (LiteLLM, aider and others
    classify "maximum context length"); a request's own window (Ollama's ``num_ctx``), in
    shardline's. ``at_least``: ``prompt_tokens`` is a lower bound (counted from characters)."""
    fits = prompt_tokens < context
    tokens = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
    if req.api == "anthropic" and not own_window:
        if not fits:
            return f"prompt is too long: {tokens} tokens > {context - 1} maximum"
        return (
            f"input length and `max_tokens` exceed context limit: {prompt_tokens} + {req.max_tokens} > "
            f"{context}, decrease input length or `max_tokens` and try again"
        )
    if req.api == "openai" and not own_window:
        if not fits or req.max_tokens is None:
            return (
                f"This model's maximum context length is {context} tokens. However, your messages resulted "
                f"in {tokens} tokens. Please reduce the length of the messages."
            )
        return (
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_tokens + req.max_tokens} tokens ({prompt_tokens} in the messages, {req.max_tokens} in "
            "the completion). Please reduce the length of the messages or completion."
        )
    asked = f" and {req.max_tokens} for the completion" if req.max_tokens is not None else ""
    whose = "the request's" if own_window else "this model's"
    return f"{whose} context is {context} tokens; the request asks for {tokens} in the prompt{asked}"


class Generation:
    """A checked, tokenized request on its instance; :meth:`texts` runs it.

    Attributes:
        prompt: the prompt's token ids.
        max_tokens: completion tokens at most (the request's, or what the context leaves).
        completion_tokens: tokens generated so far.
        reasons: the output is split into reasoning and answer (a reasoning model's chat,
            :attr:`~shardline.models.tokenizer.Tokenizer.reasons`).
        reasoning_tokens: of ``completion_tokens``, those generated inside the thinking
            (its markers included).
        started: ``time.monotonic()`` when prepared, seconds.
        first_token_at: ``time.monotonic()`` of the first token, once there is one.
        cached_tokens: of the prompt, the tokens a cached prefix held on its instance
            (not computed: :mod:`shardline.runner.prefix_cache`), once its first progress
            or token came.
        cache_written: prompt tokens it left in its instance's prefix cache beyond
            ``cached_tokens``, once it ended.
    """

    def __init__(
        self,
        node: Node,
        req: GenerationRequest,
        prompt: list[int],
        inst: Instance,
        tokenizer: Tokenizer,
        metrics: RequestMetrics | None = None,
        sampling: SamplingParams | None = None,
    ) -> None:
        self.node = node
        self.metrics = metrics
        self.req = req
        self.instance = inst
        self.prompt = prompt
        self.tokenizer = tokenizer
        room = check_room(req, len(prompt), inst.context)
        self.max_tokens = min(req.max_tokens or room, room)
        self.sampling = sampling or req.sampling
        self.stop_ids = [] if req.ignore_eos and self.sampling.grammar is None else tokenizer.eos_token_ids
        self.calls = 0  # tool calls made so far
        self.reasons = tokenizer.reasons and req.is_chat
        self.reasoning_tokens = 0
        # the call markers and thinking markers that are special tokens stay in the text,
        # for the call parser and the reasoning splitter
        keep = list(marker_tokens(tokenizer, self.tool_format).values()) if req.offers_tools else []
        self.harmony = self.reasons and template_is_harmony(tokenizer.chat_template)
        if self.reasons:
            markers = HARMONY_MARKERS if self.harmony else (THINK_OPEN, THINK_CLOSE)
            keep += [i for marker in markers if (i := tokenizer.added_token_id(marker)) is not None]
        self.detokenizer = IncrementalDetokenizer(tokenizer, keep=keep)
        self.stops = StopMatcher(req.stop)
        self.completion_tokens = 0
        self.started = time.monotonic()
        self.first_token_at: float | None = None  # time.monotonic() of the first token
        self.task_id: int | None = None  # its place in the instance's queue (Router.reserve)
        self.prompt_logprobs: list[TokenLogprob] = []  # prompt tokens 1.. (sampling.prompt_logprobs)
        self.cached_tokens = 0
        self.cache_written = 0

    async def texts(self, heartbeat_s: float | None = None) -> AsyncIterator[Chunk | PrefillProgress | Heartbeat]:
        """Yield :class:`Chunk` s until the request ends, the last with its finish reason;
        before the first token, a PrefillProgress after each engine step of a long
        prompt's prefill (the prompt's log-probabilities it carries, where the sampling
        asks for them, go to ``self.prompt_logprobs``); with ``heartbeat_s``, a
        :class:`Heartbeat` whenever that many seconds pass without a chunk or another
        heartbeat (prefill progress does not count: a stream may not send it).

        A stop string ends the output before it (then in ``self.stops.matched``); end
        tokens are not part of the text nor of the logprobs, and a token's log-probability
        comes with its text (:class:`~shardline.api.logprobs.HeldLogprobs`). Closing the iterator cancels
        the request on every rank.

        Raises:
            InstanceFailedError: the instance failed mid-request.
        """

        def ran_on(inst: Instance) -> None:
            self.instance = inst  # a second one where the first failed before any output

        events = self.node.router.generate(
            TokenRequest(
                self.req.model,
                tuple(self.prompt),
                self.max_tokens,
                self.sampling,
                tuple(self.stop_ids),
                self.req.cache_prompt,
            ),
            self.task_id,
            ran_on,
            self.instance,
        )
        if heartbeat_s is not None:
            events = with_heartbeats(events, heartbeat_s)
        ended = "cancelled"  # unless it finishes, or fails
        held = HeldLogprobs()
        parser = (
            ToolCallParser(self.tool_format, tool_names(self.req.tools), strict_schemas(self.req.tools))
            if self.req.offers_tools
            else None
        )
        splitter: ReasoningSplitter | HarmonySplitter | None = None
        if self.reasons:
            splitter = HarmonySplitter() if self.harmony else ReasoningSplitter(self._starts_thinking())
        try:
            async for event in events:
                if isinstance(event, Heartbeat):
                    yield event
                    continue
                if isinstance(event, PrefillProgress):
                    self._prefilled(event)
                    yield event
                    continue
                text, finish, logprobs = self._token_text(event, held)
                reasoning = ""
                if splitter is not None:
                    reasoning, text = self._split_reasoning(splitter, event, text, finish)
                chunk = self._chunk(parser, text, finish, logprobs, reasoning)
                if finish is not None:
                    ended = chunk.finish or finish
                    yield chunk
                    return
                if chunk.text or chunk.reasoning or chunk.logprobs or chunk.tool_calls:
                    yield chunk
        except InstanceFailedError:
            ended = "error"
            raise
        finally:
            await events.aclose()
            self._record(ended)

    def _prefilled(self, event: PrefillProgress) -> None:
        """Take a prefill step's progress: the cached tokens, the prompt's logprobs."""
        self.cached_tokens = event.cached
        self.prompt_logprobs.extend(
            token_logprob(self.tokenizer.piece, self.prompt[i], logprob, top) for i, logprob, top in event.logprobs
        )

    def _token_text(self, event: TokenEvent, held: HeldLogprobs) -> tuple[str, str | None, tuple[TokenLogprob, ...]]:
        """A token event's (text, finish reason, logprobs): the text safe to send (up to a
        stop string, which makes the finish "stop"; at the end the detokenizer's and the
        stop matcher's held text too), the finish reason (None until the output ends;
        "cancelled" from the engine becomes "stop") and the logprobs of the text's tokens
        (``held``'s). Counts the token (and the first token's time)."""
        self.cached_tokens = event.cached_tokens
        self.cache_written = event.cache_written
        if event.token_id >= 0:
            self.completion_tokens += 1
            self.first_token_at = self.first_token_at or time.monotonic()
        finish = event.finish_reason
        text, hit = "", False
        if event.token_id >= 0 and event.token_id not in self.stop_ids:
            delta = self.detokenizer.push(event.token_id)
            held.push(None if event.logprob is None else self._logprob(event), len(delta))
            text, hit = self.stops.feed(delta)
        if finish is not None and not hit:
            # The output ended: a character its last tokens began reads U+FFFD,
            # and the text before it in their tokens is kept.
            tail = self.detokenizer.flush()
            held.push(None, len(tail))
            more, hit = self.stops.feed(tail)
            text += more
        if hit:
            finish = "stop"
        elif finish is not None:
            finish = "stop" if finish == "cancelled" else finish
            text += self.stops.flush()
        logprobs = held.send(len(text), hit)
        if finish is not None and not hit:
            logprobs += held.flush()
        return text, finish, logprobs

    def _split_reasoning(
        self, splitter: ReasoningSplitter | HarmonySplitter, event: TokenEvent, text: str, finish: str | None
    ) -> tuple[str, str]:
        """``text`` as (reasoning, answer) (all held text at the finish); counts a token
        generated inside the thinking in ``reasoning_tokens``."""
        thinking = splitter.thinking
        reasoning, text = splitter.feed(text)
        if finish is not None:
            more_reasoning, more = splitter.flush()
            reasoning, text = reasoning + more_reasoning, text + more
        if event.token_id >= 0 and (thinking or splitter.thinking):
            self.reasoning_tokens += 1
        return reasoning, text

    def _record(self, ended: str) -> None:
        """Record the request in the metrics (where there are any), as ``ended``."""
        if self.metrics is not None:
            now = time.monotonic()
            ttft = None if self.first_token_at is None else self.first_token_at - self.started
            self.metrics.record(
                self.req.api,
                ended,
                len(self.prompt),
                self.completion_tokens,
                ttft,
                now - self.started,
                self.cached_tokens,
            )

    def _starts_thinking(self) -> bool:
        """Whether the output starts inside the thinking: the prompt opened it
        (:func:`~shardline.api.reasoning.prompt_opens_thinking`), and no grammar
        constrains the output (which is then all answer)."""
        if self.sampling.grammar is not None:
            return False
        tail = self.tokenizer.decode(self.prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        return prompt_opens_thinking(tail)

    def _chunk(
        self,
        parser: ToolCallParser | None,
        text: str,
        finish: str | None,
        logprobs: tuple[TokenLogprob, ...],
        reasoning: str = "",
    ) -> Chunk:
        """The chunk of ``text`` and ``reasoning`` (tool calls parsed out of ``text`` when
        tools are offered); a finished output that made calls ends ``tool_calls``."""
        if parser is None:
            return Chunk(text, finish, logprobs, reasoning=reasoning)
        items = parser.feed(text) + (parser.finish() if finish is not None else [])
        calls = []
        for item in items:
            if isinstance(item, ToolCall):
                self.calls += 1
                if self.req.max_tool_calls is None or self.calls <= self.req.max_tool_calls:
                    calls.append(item)
        content = "".join(item for item in items if isinstance(item, str))
        if finish == "stop" and self.calls:
            finish = "tool_calls"
        return Chunk(content, finish, logprobs, tuple(calls), reasoning)

    @functools.cached_property
    def tool_format(self) -> ToolFormat:
        return model_tool_format(self.tokenizer)

    def _logprob(self, event: TokenEvent) -> TokenLogprob:
        assert event.logprob is not None
        return token_logprob(self.tokenizer.piece, event.token_id, event.logprob, event.top_logprobs)

    @property
    def fingerprint(self) -> str:
        """OpenAI's ``system_fingerprint``: the instance's id, sharding, ranks and dtype
        (and quantization), which change when the model is placed again: the instance
        the request runs on (the one placed again where its first failed before any
        output; a forwarded request's, as the node it was forwarded to names it)."""
        inst = self.instance
        quant = f"-{inst.quantize}" if inst.quantize else ""
        return f"fp_{inst.instance_id[:12]}-{inst.sharding}{len(inst.ranks)}-{inst.dtype}{quant}"

    def usage(self) -> dict:
        """OpenAI's usage object: prompt, completion and total tokens, and of the prompt
        the tokens its instance's prefix cache held (``prompt_tokens_details.cached_tokens``)."""
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": self.completion_tokens,
            "total_tokens": len(self.prompt) + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens prefilled: those no cached prefix held."""
        return len(self.prompt) - self.cached_tokens

    def prefill_progress(self, event: PrefillProgress) -> dict:
        """llama.cpp server's ``prompt_progress``: ``{total, cache, processed, time_ms}``
        (``processed`` counts the cached tokens too, as llama.cpp's does: the prefill's own
        progress is ``(processed - cache) / (total - cache)``)."""
        return {
            "total": event.total,
            "cache": event.cached,
            "processed": event.done,
            "time_ms": round((time.monotonic() - self.started) * 1000, 1),
        }


def model_tool_format(tokenizer: Tokenizer) -> ToolFormat:
    """How the model of ``tokenizer`` writes tool calls: its template's format, or the
    tokenizer's own Hermes-style prompt where the template takes no tools."""
    return tool_format(tokenizer.chat_template if tokenizer.supports_tools else None)


def marker_tokens(tokenizer: Tokenizer, fmt: ToolFormat) -> dict[str, int]:
    """The call markers of ``fmt`` (:func:`~shardline.api.tools.call_markers`) that are one
    added token of ``tokenizer``'s vocabulary (Qwen2.5's ``<tool_call>``, Mistral's
    ``[TOOL_CALLS]``), by text, with the token's id."""
    return {
        marker: token_id for marker in call_markers(fmt) if (token_id := tokenizer.added_token_id(marker)) is not None
    }


async def collect_unless_disconnected(
    gen: Generation, request: Request, poll_s: float = 0.25
) -> tuple[list[Chunk], str | None]:
    """Run a non-streamed generation to the end, or cancel it once the client disconnects.

    Returns the chunks and the finish reason (None when the client left).

    Raises:
        InstanceFailedError: the instance failed mid-request.
    """
    parts: list[Chunk] = []
    finish: str | None = None

    async def consume() -> None:
        nonlocal finish
        async for item in gen.texts():
            if isinstance(item, Chunk):
                parts.append(item)
                finish = item.finish

    task = asyncio.create_task(consume())
    while not task.done():
        await asyncio.wait({task}, timeout=poll_s)
        if not task.done() and await request.is_disconnected():
            task.cancel()  # closes the generation, which cancels the task on every rank
            try:
                await task
            except asyncio.CancelledError:
                pass
            return parts, None
    task.result()
    return parts, finish


async def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Yield ``(index, item)`` from several async iterators as their items come (the
    ``n`` choices of one request). Ends when all have ended; an error from one is raised
    at once. Closing it (or an error) closes every stream, which cancels their requests.
    """
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    done = object()
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item, None))
            await queue.put((index, done, None))
        except Exception as exc:  # handed to the consumer, raised there
            await queue.put((index, done, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
