"""A request body's bytes to an API's request model: JSON decoded as the APIs' servers
read it (no NaN, no lone surrogate), parameters screened by the table of what each API
honours (:mod:`shardline.api.params`), validated with strict JSON types, and every
failure a 400 naming the parameter (:func:`validation_error`)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from shardline.api.params import Endpoint, ParamError, screen
from shardline.api.text_stream import APIError

PARSE_IN_THREAD_BYTES = 256 * 1024
"""Bodies at least this large are parsed and validated in a worker thread, so the event
loop goes on answering peers' polls meanwhile (a 16 MiB body of a million messages held
it for seconds, long enough for the cluster to count the node down)."""


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """Parse a JSON body (whatever its Content-Type; UTF-8, as RFC 8259 requires between
    systems) into ``model``.

    Raises:
        APIError: 400 for a body that is not UTF-8 JSON or does not fit the model; the
            message names the first offending field.
    """
    raw = await request.body()
    if len(raw) >= PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse_raw, raw, model)
    return parse_raw(raw, model)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _union_tag(part: object) -> bool:
    """Whether a pydantic error location part names a union's branch or a dict's key
    (``str``, ``list[str]``, ``literal['json']``, ``[key]``) rather than a field or index."""
    return isinstance(part, str) and (
        part in _TYPE_TAGS or "[" in part or part.startswith(("constrained-", "function-"))
    )


class _NonFiniteNumber(ValueError):
    """``NaN``, ``Infinity`` or ``-Infinity`` in a body: Python's json reads them, JSON has
    no such numbers."""


def _not_a_json_number(name: str) -> Any:
    raise _NonFiniteNumber(name)


def decode_json_body(raw: bytes) -> Any:
    """A request body's bytes as JSON values (RFC 8259, UTF-8).

    Raises:
        APIError: 400 (no parameter named) for bytes that are not UTF-8 JSON, NaN or an
            infinity (not JSON numbers), or a string holding a lone UTF-16 surrogate
            (``"\\ud800"``: an escape JSON's grammar admits, but no character).
    """
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_not_a_json_number)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON (UTF-8)") from None
    except _NonFiniteNumber as exc:
        raise APIError(
            400, f"the request body is not valid JSON: {exc} is not a JSON number (RFC 8259 has no NaN or infinities)"
        ) from None
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        lone = ord(exc.object[exc.start])
        raise APIError(
            400,
            f"the request body is not valid JSON (UTF-8): a string holds the lone "
            f"surrogate \\u{lone:04x}, which is no character",
        ) from None
    return data


def parse_raw(raw: bytes, model: type[BaseModel]) -> Any:
    """A request body's bytes as ``model``: parsed, screened (:func:`~shardline.api.params.screen`
    for a model with an ``ENDPOINT``), checked raw (a model's ``check_raw``), then validated
    with strict JSON types: a string or a boolean is not a number, a number is not a boolean,
    as in the APIs' own servers (OpenAI: "Invalid type for 'max_tokens': expected an
    integer").

    Raises:
        APIError: 400, as :func:`parse_body` says.
    """
    data = decode_json_body(raw)
    endpoint = getattr(model, "ENDPOINT", None)
    if endpoint is not None:
        try:
            data = screen(endpoint, data)
        except ParamError as exc:
            raise APIError(400, exc.message, param=exc.param) from None
        if (
            endpoint in (Endpoint.OLLAMA_CHAT, Endpoint.OLLAMA_GENERATE)
            and isinstance(data, dict)
            and isinstance(data.get("options"), dict)
        ):
            try:
                data["options"] = screen(Endpoint.OLLAMA_OPTIONS, data["options"])
            except ParamError as exc:
                raise APIError(400, f"options.{exc.message}", param=f"options.{exc.param}") from None
    check_raw = getattr(model, "check_raw", None)
    if check_raw is not None:
        check_raw(data)  # APIError: what the body's raw form tells (an image part, by name)
    try:
        # Strict JSON types, as the APIs' references type them: "3" or true is not an
        # integer, 1 is not a boolean (JSON mode still reads object keys as the ints
        # logit_bias wants).
        return model.model_validate_json(json.dumps(data), strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    """The 400 a request model's validation failure answers: its first error, named by
    the parameter's path, in words a client reads (not pydantic's "Value error, " or
    "should have at least 1 item" for an empty string)."""
    errors = exc.errors()
    # Of a union's branches, the one whose type the value has ("stop": a list of 5 is
    # refused for its length, not for not being a string); pydantic's branch tags
    # ("str", "list[str]", "[key]") are not part of the parameter's name.
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    param = ".".join(str(p) for p in first.get("loc", ()) if not _union_tag(p)) or None
    message = str(first.get("msg")).removeprefix("Value error, ")
    if first.get("type") in ("too_short", "string_too_short") and first.get("input") in ("", []):
        message = "must not be empty"
    if param is None and ": " in message:  # a check of several fields names the one at fault
        return APIError(400, message, param=message.split(": ", 1)[0])
    return APIError(400, f"{param or 'body'}: {message}", param=param)
