"""OpenAI's legacy Completions, ``POST /v1/completions``: a text prompt or token ids
continued, answered as ``text_completion`` objects (streamed the same), with ``echo``,
``logprobs`` and prompt scoring (both together, and ``max_tokens: 0``), as OpenAI's API
reference describes them; served by :func:`shardline.api.openai.serve`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field, model_validator

from shardline.api.heartbeat import HEARTBEAT_S
from shardline.api.logprobs import (
    TokenLogprob,
    completion_logprobs,
    echoed_completion_logprobs,
    legacy_token,
    piece_bytes,
)
from shardline.api.metrics import RequestMetrics
from shardline.api.openai import ChatShape, SamplingFields, serve
from shardline.api.params import Endpoint
from shardline.api.text_stream import APIError, Chunk, Generation, GenerationRequest
from shardline.models.tokenizer import text_starts
from shardline.node.node import Node
from shardline.runner.protocol import SamplingParams


class CompletionRequest(SamplingFields):
    """The legacy Completions request: a text prompt (or one list of token ids)."""

    ENDPOINT = Endpoint.COMPLETIONS
    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)  # one prompt
    max_tokens: int = Field(default=16, ge=0)  # OpenAI's default for this endpoint
    echo: bool = False  # the answer begins with the prompt's text
    logprobs: int | None = Field(default=None, ge=0, le=5)  # the legacy API's limit
    best_of: int = 1

    @model_validator(mode="after")
    def _nothing_to_generate(self):
        if self.max_tokens == 0 and not self.echo:  # 0 with echo: the prompt scored alone
            raise ValueError("max_tokens: must be at least 1 (0 only with echo)")
        return self

    @property
    def scores_only(self) -> bool:
        """``max_tokens`` 0 with ``echo``: the answer is the prompt alone (with its
        log-probabilities), as the legacy API scored a text; one token is generated and
        left out of the answer."""
        return self.max_tokens == 0

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def sampling(self, choice: int = 0) -> SamplingParams:
        """:meth:`SamplingFields.sampling`; with ``echo`` and ``logprobs``, the prompt's
        log-probabilities too (lm-evaluation-harness scores a text this way)."""
        sampling = super().sampling(choice)
        if self.echo and self.logprobs is not None:
            sampling = dataclasses.replace(sampling, prompt_logprobs=self.logprobs)
        return sampling

    def to_generation(self) -> GenerationRequest:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            # a batch of prompts (texts, or token-id lists: lm-evaluation-harness sends one)
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (a list of several is not supported)", param="prompt")
            prompt = prompt[0]
        return self.generation(prompt, max(self.max_tokens, 1), "max_tokens", "prompt")


class CompletionShape(ChatShape):
    """The objects of the legacy Completions: ``text_completion`` (streamed the same)."""

    def __init__(self, req: SamplingFields, gens: list[Generation], completion_id: str, created: int) -> None:
        super().__init__(req, gens, completion_id, created)

    def _chunk(self, index: int, delta: Any, finish: str | None, logprobs: dict | None = None, **extra) -> dict:
        """A chunk whose choice carries ``delta``, here the text (None: no choice)."""
        choices = (
            [] if delta is None else [{"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}]
        )
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.req.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            **extra,
        }

    def echo(self) -> str:
        """The prompt, when the request asks for it back (``echo``)."""
        return self._echo

    @functools.cached_property
    def _echo(self) -> str:
        assert isinstance(self.req, CompletionRequest)
        if not self.req.echo:
            return ""
        gen = self.gens[0]
        prompt = gen.req.prompt  # token ids echo as their pieces, special tokens too
        return prompt if isinstance(prompt, str) else gen.tokenizer.decode(gen.prompt, skip_special_tokens=False)

    def _scores_only(self) -> bool:
        assert isinstance(self.req, CompletionRequest)
        return self.req.scores_only

    def usage_of(self) -> dict:
        """:meth:`ChatShape.usage_of`; no completion tokens where it :meth:`_scores_only`."""
        usage = super().usage_of()
        if self._scores_only():
            usage = dict(usage, completion_tokens=0, total_tokens=usage["prompt_tokens"])
        return usage

    def _logprobs(self, index: int, chunk: Chunk) -> dict | None:
        if self.req.logprobs_wanted() is None:
            return None
        return completion_logprobs(list(chunk.logprobs), len(self.echo()))

    def _prompt_logprobs(self) -> bool:
        """Whether the echoed prompt comes with its log-probabilities."""
        assert isinstance(self.req, CompletionRequest)
        return self.req.echo and self.req.logprobs_wanted() is not None

    @functools.cached_property
    def _prompt_starts(self) -> list[int]:
        """Where each prompt token's text starts in :meth:`echo` (the same prompt for every
        choice): a text prompt echoes as written, so its special tokens (a BOS the
        tokenizer added) have no text there."""
        gen, echoed = self.gens[0], len(self.echo())
        starts = text_starts(gen.tokenizer, gen.prompt, skip_special_tokens=isinstance(gen.req.prompt, str))
        return [min(start, echoed) for start in starts]

    def _echo_logprobs(self, index: int, generated: list[TokenLogprob]) -> dict:
        gen = self.gens[index]
        first = legacy_token(list(piece_bytes(gen.tokenizer.piece(gen.prompt[0]))))
        prompt = [
            dataclasses.replace(t, offset=self._prompt_starts[i]) for i, t in enumerate(gen.prompt_logprobs, start=1)
        ]
        return echoed_completion_logprobs(first, prompt, generated, len(self.echo()))

    def first(self, index: int) -> dict | None:
        assert isinstance(self.req, CompletionRequest)
        if not self.req.echo or self._prompt_logprobs():  # (then once prefilled)
            return None
        return self._chunk(index, self.echo(), None)

    def prefilled(self, index: int) -> dict | None:
        """The echoed prompt with its log-probabilities, known once it is prefilled."""
        if not self._prompt_logprobs():
            return None
        return self._chunk(index, self.echo(), None, self._echo_logprobs(index, []))

    def piece(self, index: int, chunk: Chunk) -> dict | None:
        if (not chunk.text and not chunk.logprobs) or self._scores_only():
            return None
        return self._chunk(index, chunk.text, None, self._logprobs(index, chunk))

    def finish(self, index: int, reason: str) -> dict:
        return self._chunk(index, "", "length" if self._scores_only() else reason)

    def progress(self, index: int, progress: dict) -> dict:
        return self._chunk(index, "", None, prompt_progress=progress)

    def choice(self, index: int, chunks: list[Chunk], finish: str) -> dict:
        echo = self.echo()
        if self._scores_only():
            chunks, finish = [], "length"
        logprobs = None
        generated = [t for c in chunks for t in c.logprobs]
        if self._prompt_logprobs():
            logprobs = self._echo_logprobs(index, generated)
        elif self.req.logprobs_wanted() is not None:
            logprobs = completion_logprobs(generated, len(echo))
        return {
            "index": index,
            "text": echo + "".join(c.text for c in chunks),
            "logprobs": logprobs,
            "finish_reason": finish,
        }

    def whole(self, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.req.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            "usage": self.usage_of(),
        }


def router(node: Node, metrics: RequestMetrics | None = None, heartbeat_s: float = HEARTBEAT_S) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await serve(node, metrics, request, CompletionRequest, "cmpl", CompletionShape, heartbeat_s)

    return api
