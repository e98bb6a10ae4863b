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


def strict_schema_problem(schema: Any, at: str = "") -> str | None:
    """What keeps ``schema`` out of OpenAI's strict subset of JSON Schema (Structured
    Outputs' "supported schemas": every object lists each of its ``properties`` in
    ``required`` and sets ``additionalProperties`` to false), or None when it is in it.
    ``strict: true`` promises output that matches the schema exactly; OpenAI refuses a
    strict schema outside the subset, and so does shardline. Checked through
    ``properties``, ``items``, ``anyOf``, ``$defs`` and ``definitions``; ``at`` is the
    path of ``schema`` in the message (``properties.city``)."""
    if not isinstance(schema, dict):
        return None
    where = f" at {at}" if at else ""
    if schema.get("type") == "object" or "properties" in schema:
        if schema.get("additionalProperties") is not False:
            return f"additionalProperties must be false{where}"
        missing = [k for k in schema.get("properties") or {} if k not in (schema.get("required") or [])]
        if missing:
            return f"required must list every property{where}: {', '.join(missing)} missing"
    children = [(f"properties.{k}", v) for k, v in (schema.get("properties") or {}).items()]
    children += [(f"{key}.{k}", v) for key in ("$defs", "definitions") for k, v in (schema.get(key) or {}).items()]
    children += [(f"anyOf.{i}", v) for i, v in enumerate(schema.get("anyOf") or [])]
    if isinstance(schema.get("items"), dict):
        children.append(("items", schema["items"]))
    for path, child in children:
        problem = strict_schema_problem(child, f"{at}.{path}" if at else path)
        if problem:
            return problem
    return None


def matches_schema(value: Any, schema: dict) -> bool:
    """Whether the JSON ``value`` is valid under ``schema`` (JSON Schema, the draft its
    ``$schema`` names, else 2020-12; the ``jsonschema`` library)."""
    import jsonschema

    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return validator(schema).is_valid(value)
