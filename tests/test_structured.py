"""shardline.api.structured (grammars for constrained decoding) and the runner's mask
arithmetic (shardline.runner.constraint.allowed_bits / mask_logits)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shardline.api.structured import json_grammar, lark_grammar, matches_schema, strict_schema_problem
from shardline.runner.constraint import allowed_bits, mask_logits

pytestmark = pytest.mark.fast


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "schema",
    [
        None,
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "array", "items": {"type": "string"}},
        {"enum": ["red", "green"]},
    ],
)
def test_json_grammar_is_a_compact_llguidance_grammar(schema):
    grammar = json.loads(json_grammar(schema))
    [entry] = grammar["grammars"]
    options = entry["json_schema"]["x-guidance"]
    assert options["whitespace_flexible"] is False
    assert entry["json_schema"].get("type") == (schema or {"type": "object"}).get("type")


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "schema,message",
    [
        ({"type": "frob"}, "frob"),
        ([1, 2], "must be an object"),
        ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, "nope"),
        ({"type": "object", "default": {1, 2}}, "not JSON"),
    ],
)
def test_json_grammar_names_what_is_wrong(schema, message):
    with pytest.raises(ValueError, match=message):
        json_grammar(schema)


@pytest.mark.timeout(10)
def test_lark_grammar_compiles_or_names_the_error():
    assert "yes" in lark_grammar('start: "yes" | "no"')
    assert lark_grammar('start: "x" %json{"type": "integer"}')
    for bad, message in [("start: nope", "nope"), ("", "non-empty"), ('start: %json{"type": "frob"}', "frob")]:
        with pytest.raises(ValueError, match=message):
            lark_grammar(bad)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "allowed,vocab", [([0, 1, 31, 32, 63], 64), ([5], 40), ([], 10), ([69], 70), (list(range(0, 90, 3)), 90)]
)
def test_allowed_bits_reads_llguidance_words_little_endian(allowed, vocab):
    words = np.zeros((vocab + 31) // 32, dtype=np.int32)
    for token in allowed:
        words.view(np.uint32)[token // 32] |= np.uint32(1 << (token % 32))
    bits = allowed_bits(words, vocab)
    assert bits.shape == (vocab,) and np.flatnonzero(bits).tolist() == allowed
    assert allowed_bits(words, vocab + 40)[vocab:].sum() == 0  # past the mask: not allowed


@pytest.mark.timeout(10)
def test_mask_logits_gives_minus_inf_and_leaves_allowed_bits_exact():
    logits = torch.randn(1000) * 50
    before = logits.clone()
    bits = (np.arange(1000) % 7 == 0).astype(np.uint8)
    mask_logits(logits, bits)
    keep = torch.from_numpy(bits.astype(bool))
    assert torch.equal(logits[keep], before[keep])
    assert bool(torch.isneginf(logits[~keep]).all())


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "schema, problem",
    [
        (CITY, None),
        ({"type": "string"}, None),
        ({**CITY, "additionalProperties": True}, "additionalProperties must be false"),
        ({k: v for k, v in CITY.items() if k != "additionalProperties"}, "additionalProperties must be false"),
        ({**CITY, "required": []}, "required must list every property: city missing"),
        (
            {**CITY, "properties": {"where": {**CITY, "required": []}}, "required": ["where"]},
            "at properties.where: city missing",
        ),
        (
            {"type": "array", "items": {"type": "object", "properties": {}}},
            "additionalProperties must be false at items",
        ),
        ({"anyOf": [CITY, {"type": "object"}]}, "at anyOf.1"),
        ({**CITY, "$defs": {"p": {"type": "object"}}}, "at $defs.p"),
    ],
)
def test_strict_schema_problem_is_openais_strict_subset(schema, problem):
    got = strict_schema_problem(schema)
    assert got == problem if problem is None else problem in got


@pytest.mark.timeout(10)
def test_matches_schema():
    assert matches_schema({"city": "Paris"}, CITY)
    assert not matches_schema({"city": "Paris", "temperature": 25}, CITY)
    assert not matches_schema({"city": 3}, CITY) and not matches_schema({}, CITY)


@pytest.mark.timeout(10)
def test_a_strict_response_format_outside_the_subset_is_a_400_naming_the_schema():
    from shardline.api.openai import ResponseFormat
    from shardline.api.text_stream import APIError

    loose = {"type": "object", "properties": {"city": {"type": "string"}}}
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "w", "schema": loose, "strict": True}}
    )
    with pytest.raises(APIError) as caught:
        fmt.grammar()
    assert caught.value.status == 400 and caught.value.param == "response_format.json_schema.schema"
    not_strict = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "w", "schema": loose}})
    assert not_strict.grammar()  # enforced as given
    strict = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "w", "schema": CITY, "strict": True}}
    )
    assert strict.grammar()
