"""Grammars for structured output (constrained decoding), as llguidance text.

The APIs turn ``response_format`` (OpenAI), ``format`` (Ollama) and forced tool calls into
a grammar with these functions and send it in ``SamplingParams.grammar``; the runner's
sampling rank masks each token by it (:mod:`shardline.runner.constraint`). The grammar
is the JSON text of an llguidance ``TopLevelGrammar`` (llguidance's
``LLMatcher.grammar_from_json_schema`` / ``grammar_from_lark``), checked here so that a
bad schema is a 400 at the API, not a failure in the runner.

JSON is compact (no whitespace between tokens, ``,`` and ``:`` separators): a small model
left free to emit whitespace tends to loop on it.
"""

from __future__ import annotations

import json
from typing import Any

#: llguidance's JSON compiler options: no free whitespace.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

#: OpenAI's ``json_object``: any JSON object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def json_grammar(schema: dict | None) -> str:
    """An llguidance grammar for one JSON value matching ``schema`` (a JSON Schema
    dict; None: any JSON object, OpenAI's ``json_object``), with compact whitespace.

    Raises:
        ValueError: naming what is wrong, for a schema that is not a JSON object or that
            llguidance cannot compile (an unknown type, an unsupported keyword).
    """
    import llguidance

    if schema is None:
        schema = ANY_OBJECT
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, not {type(schema).__name__}")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the JSON schema is not JSON: {exc}") from None
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=COMPACT_JSON)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"invalid JSON schema: {exc}") from None
    _check(grammar, "JSON schema")
    return grammar


def lark_grammar(lark: str) -> str:
    """An llguidance grammar from Lark text (llguidance's dialect, which may embed
    ``%json{...}`` schemas).

    Raises:
        ValueError: naming the error, for a grammar that does not compile.
    """
    import llguidance

    if not isinstance(lark, str) or not lark.strip():
        raise ValueError("a Lark grammar must be non-empty text")
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    _check(grammar, "grammar")
    return grammar


def _check(grammar: str, what: str) -> None:
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"invalid {what}: {' '.join(m.strip() for m in messages)}")
