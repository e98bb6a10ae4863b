"""The Responses API's answer: the ``response`` object and its streaming events, built
from the generation's pieces of text and tool calls (pure; no I/O).

Shapes from OpenAI's API reference as the ``openai`` package 3.57.0 types them
(``openai/types/responses/response.py``, ``response_output_message.py``,
``response_function_tool_call.py``, ``response_usage.py`` and the ``*_event.py`` of the
streaming events: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``,
``response.function_call_arguments.delta`` / ``.done``, ``response.reasoning_text.delta`` /
``.done`` (``response_reasoning_item.py``), ``response.completed`` /
``response.incomplete``, ``error`` and ``response.failed``).
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from shardline.api.logprobs import logprob_entry
from shardline.api.openai import obfuscation
from shardline.api.responses_request import LOGPROBS_INCLUDE, ResponsesRequest, parse_tools


def new_id(prefix: str) -> str:
    """An object id as OpenAI writes them: ``resp_``, ``msg_``, ``fc_`` then 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Piece:
    """What the generation gave since the last piece: content text, complete tool calls
    (objects with ``id``, ``name``, ``arguments``), token logprobs (objects with ``token``,
    ``logprob``, ``bytes``, ``top``: see interfaces15.md §4), a reasoning model's
    reasoning text (before any content text or call), and the finish reason (``stop``,
    ``length``, ``tool_calls``) on the last."""

    text: str = ""
    finish: str | None = None
    tool_calls: tuple[Any, ...] = ()
    logprobs: tuple[Any, ...] = ()
    reasoning: str = ""


def usage_object(
    prompt_tokens: int,
    output_tokens: int,
    reasoning_tokens: int = 0,
    cached_tokens: int = 0,
    cache_write_tokens: int = 0,
) -> dict:
    """OpenAI's ``ResponseUsage``: ``reasoning_tokens`` of the ``output_tokens``;
    ``cached_tokens`` of the ``prompt_tokens``, those a prefix cache held, and
    ``cache_write_tokens`` those the request left in it."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": cache_write_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def echoed_tools(req: ResponsesRequest) -> list[dict]:
    """The request's tools as the response repeats them: function tools as ``FunctionTool``
    (null fields filled), the others as they came."""
    return [
        {
            "type": "function",
            "name": t["name"],
            "description": t.get("description"),
            "parameters": t.get("parameters"),
            "strict": t.get("strict"),
        }
        if t.get("type") == "function"
        else t
        for t in req.tools or []
    ]


def response_skeleton(req: ResponsesRequest, response_id: str, created_at: int) -> dict:
    """The ``response`` object of ``req`` before any output (status ``in_progress``), with
    the request's fields it repeats, defaults filled as OpenAI fills them."""
    text = dict(req.text or {})
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "background": False,
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "model": req.model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": None,
        "safety_identifier": req.safety_identifier,
        "service_tier": "default",
        "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": text.get("format") or {"type": "text"}, "verbosity": "medium"},
        "tool_choice": req.tool_choice or "auto",
        "tools": echoed_tools(req),
        "top_logprobs": req.top_logprobs or 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


class OutputBuilder:
    """Turns the generation's :class:`Piece` objects into the response's output items and
    the streaming events that build them, numbered by ``sequence_number``.

    A reasoning model's reasoning opens a ``reasoning`` item (one ``reasoning_text``
    part, no summary) that text, a tool call or the end closes. Text opens a ``message``
    item (one ``output_text`` part) that a tool call or the end closes; each tool call is
    a ``function_call`` item (with its ``namespace`` where the function came from one), or
    a ``custom_tool_call`` item for a custom tool (with ``parallel_tool_calls`` false, the
    first call only). An output with neither text nor calls gets an empty message.
    """

    def __init__(self, req: ResponsesRequest, response_id: str, created_at: int) -> None:
        self.response = response_skeleton(req, response_id, created_at)
        self.logprobs = LOGPROBS_INCLUDE in (req.include or [])
        self.parallel = req.parallel_tool_calls is not False
        self.obfuscate = bool(req.stream) and (req.stream_options or {}).get("include_obfuscation", True) is not False
        self.sequence = 0
        self.message: dict | None = None  # the message item being written
        self.reasoning: dict | None = None  # the reasoning item being written
        self.calls = 0
        self.tools = parse_tools(req.tools, req.tool_choice)

    @property
    def output(self) -> list[dict]:
        return self.response["output"]

    def _event(self, type_: str, **fields: Any) -> dict:
        event = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _pad(self, event: dict, delta: str) -> dict:
        """OpenAI's stream obfuscation: random characters that even out delta sizes."""
        if self.obfuscate:
            event["obfuscation"] = obfuscation(delta)
        return event

    def start(self) -> list[dict]:
        """``response.created`` and ``response.in_progress``."""
        return [
            self._event("response.created", response=copy.deepcopy(self.response)),
            self._event("response.in_progress", response=copy.deepcopy(self.response)),
        ]

    def _open_message(self) -> list[dict]:
        item: dict[str, Any] = {
            "id": new_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.output.append(item)
        self.message = item
        index = len(self.output) - 1
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        return [
            self._event("response.output_item.added", output_index=index, item=dict(item, content=[])),
            self._event(
                "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=dict(part)
            ),
        ]

    def _close_message(self, status: str) -> list[dict]:
        item, self.message = self.message, None
        if item is None:
            return []
        item["status"] = status
        part, index = item["content"][0], self.output.index(item)
        return [
            self._event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=part["logprobs"],
            ),
            self._event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=copy.deepcopy(part),
            ),
            self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item)),
        ]

    def _open_reasoning(self) -> list[dict]:
        item: dict[str, Any] = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
        self.output.append(item)
        self.reasoning = item
        index = len(self.output) - 1
        part = {"type": "reasoning_text", "text": ""}
        item["content"].append(part)
        return [
            self._event("response.output_item.added", output_index=index, item=dict(item, content=[])),
            self._event(
                "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=dict(part)
            ),
        ]

    def _close_reasoning(self) -> list[dict]:
        item, self.reasoning = self.reasoning, None
        if item is None:
            return []
        part, index = item["content"][0], self.output.index(item)
        return [
            self._event(
                "response.reasoning_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
            ),
            self._event(
                "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=dict(part)
            ),
            self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item)),
        ]

    def _call(self, call: Any) -> list[dict]:
        if self.calls and not self.parallel:
            return []
        self.calls += 1
        events = self._close_reasoning() + self._close_message("completed")
        if call.name in self.tools.custom:
            return events + self._custom_call(call)
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
        }
        if call.name in self.tools.namespaces:
            item["namespace"] = self.tools.namespaces[call.name]
        self.output.append(item)
        index = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        item["arguments"], item["status"] = call.arguments, "completed"
        events.append(
            self._pad(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=call.arguments,
                ),
                call.arguments,
            )
        )
        events.append(
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=call.arguments,
            )
        )
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def _custom_call(self, call: Any) -> list[dict]:
        """A call of a custom tool: its ``input`` is the string the model gave as the
        function's ``input`` argument (the arguments' JSON text where it gave no string)."""
        arguments = json.loads(call.arguments)
        text = arguments["input"] if isinstance(arguments.get("input"), str) else call.arguments
        item: dict[str, Any] = {
            "id": new_id("ctc"),
            "type": "custom_tool_call",
            "status": "in_progress",
            "call_id": call.id,
            "name": call.name,
            "input": "",
        }
        if call.name in self.tools.namespaces:
            item["namespace"] = self.tools.namespaces[call.name]
        self.output.append(item)
        index = len(self.output) - 1
        events = [self._event("response.output_item.added", output_index=index, item=dict(item))]
        item["input"], item["status"] = text, "completed"
        events.append(
            self._pad(
                self._event(
                    "response.custom_tool_call_input.delta", item_id=item["id"], output_index=index, delta=text
                ),
                text,
            )
        )
        events.append(
            self._event("response.custom_tool_call_input.done", item_id=item["id"], output_index=index, input=text)
        )
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def feed(self, piece: Piece) -> list[dict]:
        """The events for one piece's text and calls (its finish is for :meth:`finish`)."""
        events: list[dict] = []
        if piece.reasoning:
            if self.reasoning is None:
                events += self._open_reasoning()
            assert self.reasoning is not None
            part, index = self.reasoning["content"][0], self.output.index(self.reasoning)
            part["text"] += piece.reasoning
            events.append(
                self._pad(
                    self._event(
                        "response.reasoning_text.delta",
                        item_id=self.reasoning["id"],
                        output_index=index,
                        content_index=0,
                        delta=piece.reasoning,
                    ),
                    piece.reasoning,
                )
            )
        if piece.text:
            events += self._close_reasoning()
            if self.message is None:
                events += self._open_message()
            assert self.message is not None
            part, index = self.message["content"][0], self.output.index(self.message)
            logprobs = [logprob_entry(e) for e in piece.logprobs] if self.logprobs else []
            part["text"] += piece.text
            part["logprobs"] += logprobs
            events.append(
                self._pad(
                    self._event(
                        "response.output_text.delta",
                        item_id=self.message["id"],
                        output_index=index,
                        content_index=0,
                        delta=piece.text,
                        logprobs=logprobs,
                    ),
                    piece.text,
                )
            )
        for call in piece.tool_calls:
            events += self._call(call)
        return events

    def finish(self, reason: str, usage: dict, now: float | None = None) -> list[dict]:
        """Close the output for finish ``reason``: ``length`` leaves the response
        ``incomplete`` (``max_output_tokens``), anything else ``completed``. The last event
        is ``response.completed`` or ``response.incomplete`` with the whole response."""
        incomplete = reason == "length"
        events = self._close_reasoning()
        if self.message is None and all(item["type"] == "reasoning" for item in self.output):
            events += self._open_message()
        events += self._close_message("incomplete" if incomplete else "completed")
        self.response.update(
            status="incomplete" if incomplete else "completed",
            usage=usage,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            completed_at=None if incomplete else int(now or time.time()),
        )
        kind = "response.incomplete" if incomplete else "response.completed"
        return events + [self._event(kind, response=copy.deepcopy(self.response))]

    def fail(self, message: str, code: str) -> list[dict]:
        """An ``error`` event then ``response.failed`` (the response, status ``failed``).
        ``code``: one of ``ResponseError``'s codes (``server_error``, ``rate_limit_exceeded``)."""
        self.response.update(status="failed", error={"code": code, "message": message})
        return [
            self._event("error", code=code, message=message, param=None),
            self._event("response.failed", response=copy.deepcopy(self.response)),
        ]
