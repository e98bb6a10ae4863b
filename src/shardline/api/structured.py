"""Placeholder until the sampling branch lands (json_grammar / lark_grammar)."""

from __future__ import annotations

import json

import llguidance


def json_grammar(schema: dict | None) -> str:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema or {"type": "object"}), defaults={"whitespace_flexible": False})
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error)
    return grammar


def lark_grammar(lark: str) -> str:
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error)
    return grammar
