"""A request checked, tokenized and given its place: :func:`prepare` takes the node's
admission of it (:func:`~shardline.node.admission.admit`: the ready instance of the
model, or one that loads to wait for, or the refusal, worded here), tokenizes the prompt
with the model's tokenizer and chat template, refuses what the context or vocabulary
cannot take (400s in the API's format, :class:`~shardline.api.text_stream.APIError`),
and takes the request's place in the instance's queue; :func:`tokenize` is the part that
counts tokens (Anthropic's ``count_tokens``)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shardline.api.prompt_bounds import droppable, min_prompt_tokens, without_oldest
from shardline.api.text_stream import (
    CONTEXT_LENGTH_EXCEEDED,
    APIError,
    Generation,
    GenerationRequest,
    check_room,
    marker_tokens,
    model_tool_format,
    too_long,
)
from shardline.api.tools import ToolChoiceMode, check_history, check_tools, tool_call_grammar
from shardline.models.store import ModelNotFoundError
from shardline.models.tokenizer import ChatTemplateError, Tokenizer
from shardline.node.admission import Ready, Refused, Wait, admit, refused
from shardline.node.node import Node
from shardline.node.peer_client import PeerError
from shardline.node.table import Instance
from shardline.node.transfer import TransferError
from shardline.runner.protocol import SamplingParams

if TYPE_CHECKING:
    from shardline.api.metrics import RequestMetrics


async def prepare(node: Node, req: GenerationRequest, metrics: RequestMetrics | None = None) -> Generation:
    """Find a ready instance and the tokenizer of ``req.model``, tokenize the prompt, route
    it to the ready instance of at least that context likeliest to hold its prefix in its
    cache (:meth:`~shardline.node.routing.Router.route`) and take the request's place in
    that instance's queue.

    Raises:
        APIError: as :func:`tokenize`; 400 for a prompt and limit beyond the context.
        QueueFullError: as many requests wait for the instance as this node queues (the
            app answers 429 with ``Retry-After``).
    """
    inst, tokenizer, prompt = await tokenize(node, req, lambda inst, prompt: check_room(req, len(prompt), inst.context))
    inst = node.router.route(prompt, inst)  # the one holding most of its prefix, of those as long
    sampling = req.sampling
    if req.offers_tools and req.tool_choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED):
        sampling = await asyncio.to_thread(_forced_call, req, tokenizer)
    gen = Generation(node, req, prompt, inst, tokenizer, metrics, sampling)
    gen.task_id = node.router.reserve(inst, gen)  # after the last await: counted one by one
    return gen


def _forced_call(req: GenerationRequest, tokenizer: Tokenizer) -> SamplingParams:
    """The sampling of a request whose tool choice forces a call: its grammar is the
    call's (:func:`~shardline.api.tools.tool_call_grammar`).

    Raises:
        APIError: 400 when the request also constrains its output otherwise
            (``response_format``), or a tool's schema does not compile.
    """
    if req.sampling.grammar is not None:
        raise APIError(
            400,
            "tool_choice: a forced tool call cannot be combined with a structured output format",
            param="tool_choice",
        )
    try:
        fmt = model_tool_format(tokenizer)
        grammar = tool_call_grammar(fmt, req.tools, req.tool_choice, marker_tokens(tokenizer, fmt))
    except ValueError as exc:
        raise APIError(400, str(exc), param="tools") from exc
    return dataclasses.replace(req.sampling, grammar=grammar)


async def _encode_chat(
    req: GenerationRequest, messages: list[dict[str, Any]], tokenizer: Tokenizer, instance_context: int
) -> list[int]:
    """The token ids of ``req``'s chat (``messages``); with ``truncate_history``, of the
    longest :func:`~shardline.api.prompt_bounds.without_oldest` that leaves the context
    room for a token (a binary search over how many messages go: a shorter chat has fewer
    tokens; a dozen encodings for 5,000 messages), else of the shortest (which
    :class:`Generation` refuses as too long).

    Raises:
        APIError: 400 when the chat template refuses the chat.
    """
    most = droppable(messages) if req.truncate_history else 0
    context = req.window(instance_context)
    encoded: dict[int, list[int]] = {}

    async def encode(i: int) -> list[int]:  # the chat without its i oldest messages
        if i not in encoded:
            call = functools.partial(
                tokenizer.encode_chat,
                without_oldest(messages, i),
                tools=req.tools if req.offers_tools else None,
                continue_final_message=req.continue_final_message,
                thinking=req.thinking,
                effort=req.effort,
            )
            try:
                encoded[i] = await asyncio.to_thread(call)
            except ChatTemplateError as exc:
                raise APIError(400, str(exc), param=req.prompt_param) from exc
        return encoded[i]

    low, high = 0, most  # the first that fits lies in [low, high] (or none does)
    while low < high:
        middle = (low + high) // 2
        if len(await encode(middle)) < context:
            high = middle
        else:
            low = middle + 1
    return await encode(low)


async def _check_names_rendered(req: GenerationRequest, tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> None:
    """Refuse a message ``name`` (of ``messages``, ``req``'s chat) the model's chat
    template does not render.

    Raises:
        APIError: 400 naming the first such message's name (or the template's error).
    """
    unrendered = functools.partial(
        tokenizer.unrendered_names,
        messages,
        tools=req.tools if req.offers_tools else None,
        continue_final_message=req.continue_final_message,
        thinking=req.thinking,
        effort=req.effort,
    )
    try:
        unused = await asyncio.to_thread(unrendered)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param=req.prompt_param) from exc
    if unused:
        where = f"{req.prompt_param}.{unused[0]}.{req.name_param}"
        raise APIError(
            400,
            f"{where}: this model's chat template does not render names, so it would have no effect; leave it out",
            param=where,
        )


async def tokenize(
    node: Node, req: GenerationRequest, check: Callable[[Instance, list[int]], object] | None = None, wait: bool = True
) -> tuple[Instance, Tokenizer, list[int]]:
    """The instance, the tokenizer and the prompt's token ids of ``req``, where the node's
    :func:`~shardline.node.admission.admit` sends it. :class:`Ready`: its instance (a rank
    on this node first; one whose context holds the request's own window, Ollama's
    ``num_ctx``, where that one's does not), or its ``wider`` one where ``check`` (the
    instance, the prompt's ids; it raises the caller's 400s) refuses the prompt for the
    context. :class:`Wait`: the prompt is tokenized against its instance and checked
    first, so that a request its context refuses is refused at once, not after the wait;
    then it waits for a ready one (:meth:`~shardline.node.routing.Router.wait_for_ready`,
    at most :data:`~shardline.node.routing.READY_WAIT_S`) and is admitted again on the
    table then. Without ``wait`` (counting tokens runs nothing), that instance and the
    prompt are the answer, and nothing is waited for.

    Returns:
        The instance, the model's tokenizer and the prompt's token ids.

    Raises:
        APIError: 404 for a model no instance serves; 503 for one not ready after the
            wait, failed and given up on, or whose tokenizer cannot be had; 400 for tools
            or ``tool_choice`` refused, messages the chat template refuses, token ids
            outside the vocabulary, ``logit_bias`` ids outside it, or a text or chat prompt
            whose characters alone prove it longer than the context (refused before it is
            tokenized: :mod:`shardline.api.prompt_bounds`); and what ``check`` raises.
    """
    if req.tools or req.tool_choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED):
        try:
            check_tools(req.tools, req.tool_choice)
        except ValueError as exc:
            raise APIError(
                400, str(exc), param="tool_choice" if str(exc).startswith("tool_choice") else "tools"
            ) from exc
    admission = admit(node.instances, req.model, node.node_id, req.context)
    early = None  # the prompt, tokenized and checked against a loading instance
    if isinstance(admission, Wait):
        early = await _checked_early(node, req, admission.instance, check)
        if early is not None and not wait:
            return early
        if not wait or await node.router.wait_for_ready(req.model) is None:  # READY_WAIT_S at most
            raise _refusal(refused(node.instances, req.model))
        admission = admit(node.instances, req.model, node.node_id, req.context)
    if not isinstance(admission, Ready):
        raise _refusal(admission if isinstance(admission, Refused) else refused(node.instances, req.model))
    inst = admission.instance
    if early is not None and early[0].context == inst.context:
        return inst, early[1], early[2]
    try:
        return await _checked(node, req, inst, check)
    except APIError as exc:  # another ready instance of the model may have a longer context
        if exc.code != CONTEXT_LENGTH_EXCEEDED or admission.wider is None:
            raise
        return await _checked(node, req, admission.wider, check)


def _refusal(refusal: Refused) -> APIError:
    """The error of a request :func:`~shardline.node.admission.admit` refused (or that
    waited in vain): a 503 naming each instance and its status where the model is placed
    (loading, failed), a 404 naming the models served where it is not.

    Returns:
        The :class:`APIError` (``model_not_ready``, ``model_not_found``), to raise.
    """
    if refusal.placed:
        detail = "; ".join(
            f"instance {i.instance_id} {i.status}" + (f": {i.error}" if i.error else "") for i in refusal.placed
        )
        return APIError(
            503,
            f"The model '{refusal.model_id}' is not ready ({detail}); retry later",
            "server_error",
            param="model",
            code="model_not_ready",
        )
    known = ", ".join(refusal.available) or "none"
    return APIError(
        404,
        f"The model '{refusal.model_id}' does not exist or is not loaded (available: {known})",
        "not_found_error",
        param="model",
        code="model_not_found",
    )


async def _checked(
    node: Node, req: GenerationRequest, inst: Instance, check: Callable[[Instance, list[int]], object] | None
) -> tuple[Instance, Tokenizer, list[int]]:
    """:func:`_tokenized`, then ``check``.

    Returns:
        ``inst``, the tokenizer and the prompt's token ids.

    Raises:
        APIError: as :func:`_tokenized`, and what ``check`` raises.
    """
    tokenized = await _tokenized(node, req, inst)
    if check is not None:
        check(inst, tokenized[2])
    return tokenized


async def _checked_early(
    node: Node, req: GenerationRequest, inst: Instance, check: Callable[[Instance, list[int]], object] | None
) -> tuple[Instance, Tokenizer, list[int]] | None:
    """:func:`_checked` against ``inst``, the instance a request waits for
    (:class:`~shardline.node.admission.Wait`'s).

    Returns:
        ``inst``, the tokenizer and the prompt's token ids; None where a 5xx stops it (its
        tokenizer cannot be had yet: the wait may cure it).

    Raises:
        APIError: a 4xx of the request (the prompt, its context, the vocabulary).
    """
    try:
        return await _checked(node, req, inst, check)
    except APIError as exc:
        if exc.status >= 500:
            return None
        raise


async def _tokenized(node: Node, req: GenerationRequest, inst: Instance) -> tuple[Instance, Tokenizer, list[int]]:
    """:func:`tokenize` 's work once ``inst`` is the ready instance."""
    try:
        tokenizer = await node.logistics.tokenizer(req.model)
    except (ModelNotFoundError, TransferError, PeerError) as exc:
        raise APIError(
            503,
            f"The model '{req.model}' cannot be tokenized on this node: {exc}",
            "server_error",
            param="model",
            code="model_not_ready",
        ) from exc
    if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], dict)):
        shortest: Any = req.prompt
        if req.truncate_history:  # what a chat past the context keeps, at the least
            shortest = without_oldest(shortest, droppable(shortest))
        at_least = min_prompt_tokens(shortest, tokenizer.max_token_chars)
        if at_least > inst.context:
            raise APIError(
                400,
                too_long(req, at_least, inst.context, at_least=True),
                param=req.prompt_param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )
    if isinstance(req.prompt, str):
        prompt = await asyncio.to_thread(tokenizer.encode, req.prompt)
    elif req.prompt and isinstance(req.prompt[0], dict):
        try:
            check_history(req.prompt)  # type: ignore[arg-type]
        except ValueError as exc:
            raise APIError(400, str(exc), param=req.prompt_param) from exc
        if req.name_param is not None:
            await _check_names_rendered(req, tokenizer, req.prompt)  # type: ignore[arg-type]
        prompt = await _encode_chat(req, req.prompt, tokenizer, inst.context)  # type: ignore[arg-type]
    else:
        prompt = [t for t in req.prompt if isinstance(t, int)]  # token ids: a list of dicts went above
        bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise APIError(
                400,
                f"token ids outside the vocabulary (0-{tokenizer.vocab_size - 1}): {bad[:5]}",
                param=req.prompt_param,
            )
    if not prompt:
        raise APIError(400, "the prompt is empty", param=req.prompt_param)
    outside = [t for t, _ in req.sampling.logit_bias if not 0 <= t < tokenizer.vocab_size]
    if outside:
        raise APIError(
            400,
            f"logit_bias: token ids outside the vocabulary (0-{tokenizer.vocab_size - 1}): {outside[:5]}",
            param="logit_bias",
        )
    return inst, tokenizer, prompt
