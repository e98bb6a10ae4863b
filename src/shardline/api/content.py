"""Checks of chat messages' content parts that every API makes before its request model
validates them: an empty array of parts is refused, and so are parts a text-only model
cannot take (images, audio, files), with a message that says so rather than a schema error.

Part types, from each API's reference: OpenAI Chat Completions' user content parts
(``text``, ``image_url``, ``input_audio``, ``file``); Anthropic Messages' content blocks
(``text``, ``image``, ``document``, ...); Ollama's ``images`` (a list of base64 images on a
message, or on ``/api/generate``'s request).
"""

from __future__ import annotations

from typing import Any

from shardline.api.text_stream import APIError

MEDIA_PARTS = {
    "openai": frozenset({"image_url", "input_audio", "file", "input_image", "input_file"}),
    "anthropic": frozenset({"image", "document"}),
}
"""Part types that carry something other than text, per API."""


def text_only(model: object) -> str:
    """The message for media given to ``model``."""
    return f"model {model!r} takes text only"


def check_parts(data: Any, api: str, messages_key: str = "messages") -> None:
    """Refuse, in a raw request body ``data`` (before validation), a message whose
    ``content`` is an empty array, or holds a media part (:data:`MEDIA_PARTS` of ``api``:
    ``"openai"`` or ``"anthropic"``), or an Ollama message with ``images`` (``api``
    ``"ollama"``, and the request's own ``images``). Anything else is left to the request
    model's validation (a body that is not an object, a message that is not one, ...).

    Raises:
        APIError: 400, whose ``param`` is the offending field (``messages.0.content``,
            ``messages.1.content.2``, ``messages.0.images``, ``images``).
    """
    if not isinstance(data, dict):
        return
    model = data.get("model")
    if api == "ollama" and data.get("images"):
        raise APIError(400, f"{text_only(model)}: images are not supported", param="images")
    messages = data.get(messages_key)
    if not isinstance(messages, list):
        return
    media = MEDIA_PARTS.get(api, frozenset())
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        where = f"{messages_key}.{i}"
        if api == "ollama":
            if message.get("images"):
                raise APIError(400, f"{text_only(model)}: {where}.images is not supported", param=f"{where}.images")
            continue
        content = message.get("content")
        if not isinstance(content, list):
            continue
        if not content:
            raise APIError(
                400,
                f"{where}.content: an empty array of content parts; give at least one part, or a string",
                param=f"{where}.content",
            )
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in media:
                raise APIError(
                    400, f"{text_only(model)}: {where}.content.{j} is a {kind!r} part", param=f"{where}.content.{j}"
                )
