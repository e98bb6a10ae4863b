"""Tool calling's pure parts (shardline.api.tools): the format a chat template calls tools
in, the checks of tools and of a chat's tool history, the streaming call parser fed every
split of several outputs, and the grammar that forces a call (compiled and run by
llguidance over the real SmolLM2 tokenizer, and over it with the call markers as special
tokens, as Qwen2.5's vocabulary has them, through the runner's constraint and the API's
detokenizer)."""

from __future__ import annotations

import functools
import json
import re
import tempfile
from pathlib import Path

import pytest
from tiny_chat import LLAMA_STYLE_TEMPLATE, MARKER_TOKENS, QWEN_STYLE_TEMPLATE, write_chat_tokenizer

from shardline.api.structured import matches_schema
from shardline.api.text_stream import marker_tokens
from shardline.api.tools import (
    ToolCall,
    ToolCallParser,
    ToolChoice,
    ToolChoiceMode,
    ToolFormat,
    check_history,
    check_tools,
    strict_schemas,
    tool_call_grammar,
    tool_format,
    tool_names,
)
from shardline.models.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = [pytest.mark.fast, pytest.mark.timeout(60)]

H, L, M = ToolFormat.HERMES, ToolFormat.LLAMA3_JSON, ToolFormat.MISTRAL
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_NO_TOOLS = (
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}"
)


@pytest.mark.parametrize(
    "template, fmt",
    [
        (QWEN_STYLE_TEMPLATE, H),
        (LLAMA_STYLE_TEMPLATE, L),
        (SMOLLM2_TEMPLATE, H),  # no tool support: shardline's Hermes-style fallback
        (LLAMA3_NO_TOOLS, H),  # Llama 3.0's layout takes no tools: the fallback too
        ("{{ tools }}<|python_tag|>", L),
        ("{{ tools }}<tool_call><|eot_id|>", H),
        ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS] [", M),
        (None, H),
        ("", H),
    ],
    ids=[
        "qwen-style",
        "llama-style",
        "smollm2",
        "llama3.0",
        "python-tag",
        "tool-call-wins",
        "mistral",
        "none",
        "empty",
    ],
)
def test_tool_format_from_the_template_text(template, fmt):
    assert tool_format(template) is fmt


def weather(name: str = "get_weather", parameters: object = None) -> dict:
    params = (
        parameters
        if parameters is not None
        else {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        }
    )
    return {"type": "function", "function": {"name": name, "description": "The weather", "parameters": params}}


AUTO = ToolChoice(ToolChoiceMode.AUTO)
REQUIRED = ToolChoice(ToolChoiceMode.REQUIRED)


@pytest.mark.parametrize(
    "tools, choice",
    [
        ([weather()], AUTO),
        ([weather(), weather("add", {"type": "object", "properties": {"a": {"type": "number"}}})], REQUIRED),
        ([weather()], ToolChoice(ToolChoiceMode.NAMED, "get_weather")),
        ([], ToolChoice(ToolChoiceMode.NONE)),
        ([], AUTO),
        ([{"type": "function", "function": {"name": "ping"}}], AUTO),  # no parameters: no arguments
        ([weather("ns.tool:v1-x")], AUTO),
    ],
    ids=["one", "required", "named", "none", "auto-empty", "no-parameters", "dotted-name"],
)
def test_check_tools_accepts(tools, choice):
    check_tools(tools, choice)


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        ("garbage", AUTO, "tools must be a list"),
        ([{"name": "x"}], AUTO, "tools[0] must be an object with type 'function'"),
        ([{"type": "function"}], AUTO, "tools[0].function must be an object"),
        ([{"type": "function", "function": {"description": "x"}}], AUTO, "tools[0].function.name must be"),
        ([weather(""), weather()], AUTO, "tools[0].function.name must be"),
        ([weather("has space")], AUTO, "tools[0].function.name must be"),
        ([weather(), weather()], AUTO, "tools[1].function.name 'get_weather' is used by an earlier tool"),
        ([weather(parameters={"type": "array"})], AUTO, "tools[0].function.parameters must be a JSON schema of type"),
        ([weather(parameters=[1])], AUTO, "tools[0].function.parameters must be"),
        ([{"type": "function", "function": {"name": "x", "description": 3}}], AUTO, "tools[0].function.description"),
        ([], REQUIRED, "tool_choice asks for a tool call, which needs at least one tool"),
        ([], ToolChoice(ToolChoiceMode.NAMED, "x"), "tool_choice asks for a tool call, which needs at least one tool"),
        ([weather()], ToolChoice(ToolChoiceMode.NAMED, "other"), "names function 'other', which is not among"),
    ],
)
def test_check_tools_refuses_naming_the_problem(tools, choice, message):
    with pytest.raises(ValueError) as info:
        check_tools(tools, choice)
    assert message in str(info.value)


def call(id_: str | None, name: str, arguments: object) -> dict:
    entry = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return entry if id_ is None else {"id": id_, **entry}


USER = {"role": "user", "content": "Weather?"}


@pytest.mark.parametrize(
    "messages",
    [
        [USER],
        [
            USER,
            {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_weather", {"city": "Paris"})]},
            {"role": "tool", "content": "20C", "tool_call_id": "c1", "name": "get_weather"},
        ],
        [
            USER,
            {"role": "assistant", "content": "", "tool_calls": [call("c1", "f", '{"a": [1]}'), call("c2", "f", {})]},
            {"role": "tool", "content": "x", "tool_call_id": "c2"},
            {"role": "tool", "content": "y", "tool_call_id": "c1"},
        ],
        [USER, {"role": "assistant", "tool_calls": [call(None, "f", {})]}, {"role": "tool", "content": "x"}],  # Ollama
        [USER, {"role": "tool", "content": "no id: nothing to match"}],
    ],
)
def test_check_history_accepts(messages):
    check_history(messages)


@pytest.mark.parametrize(
    "messages, message",
    [
        (
            [USER, {"role": "assistant", "tool_calls": [call("c1", "f", "{not json")]}],
            "messages[1].tool_calls[0].function.arguments is not a JSON object: '{not json'",
        ),
        (
            [USER, {"role": "assistant", "tool_calls": [call("c1", "f", {}), call("c2", "f", "[1, 2]")]}],
            "messages[1].tool_calls[1].function.arguments is not a JSON object",
        ),
        (
            [USER, {"role": "assistant", "tool_calls": [call("c1", "f", None)]}],
            "messages[1].tool_calls[0].function.arguments is not a JSON object",
        ),
        (
            [USER, {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"arguments": {}}}]}],
            "messages[1].tool_calls[0].function.name is missing",
        ),
        ([USER, {"role": "assistant", "tool_calls": ["x"]}], "messages[1].tool_calls[0].function.name is missing"),
        ([USER, {"role": "assistant", "tool_calls": {"id": "c1"}}], "messages[1].tool_calls must be a list"),
        (
            [USER, {"role": "tool", "content": "x", "tool_call_id": "c9"}],
            "messages[1].tool_call_id 'c9' matches no earlier assistant tool call",
        ),
        (
            [
                USER,
                {"role": "tool", "content": "x", "tool_call_id": "c1"},
                {"role": "assistant", "tool_calls": [call("c1", "f", {})]},
            ],
            "messages[1].tool_call_id 'c1' matches no",
        ),
        (
            [
                USER,
                {"role": "assistant", "tool_calls": [call(None, "f", {})]},
                {"role": "tool", "content": "x", "name": "g"},
            ],
            "messages[2]: the tool result's name 'g' names no earlier assistant tool call",
        ),
    ],
)
def test_check_history_names_the_first_malformed_entry(messages, message):
    with pytest.raises(ValueError) as info:
        check_history(messages)
    assert message in str(info.value)


def test_tool_call_ids_are_fresh_call_hex():
    ids = {ToolCall.new("f", {}).id for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    assert ToolCall.new("f", {"ville": "Zürich"}).arguments == '{"ville": "Zürich"}'


NAMES = {"get_weather", "add"}
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ADD = '{"name": "add", "arguments": {"a": 1, "b": "}{"}}'
C_PARIS = ("get_weather", {"city": "Paris"})
C_ADD = ("add", {"a": 1, "b": "}{"})

HERMES_CASES = [
    ("Hello there.\n\nHow are you? 1 < 2 <tool", ["Hello there.\n\nHow are you? 1 < 2 <tool"]),
    (f"<tool_call>\n{PARIS}\n</tool_call>", [C_PARIS]),
    (f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{ADD}\n</tool_call>\n", [C_PARIS, C_ADD]),
    (f"Let me check.\n\n<tool_call>\n{PARIS}\n</tool_call>", ["Let me check.", C_PARIS]),
    (f"<tool_call>{PARIS}</tool_call>\nDone: it is <b>.", [C_PARIS, "Done: it is <b>."]),
    (
        'Hi\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>\nBye',
        ['Hi\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>\nBye'],
    ),
    (
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
        ['<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'],
    ),
    (f"<tool_call>\n{PARIS}\n", [C_PARIS]),  # the end came before </tool_call>: still a whole call
    ('<tool_call>\n{"name": "get_weather", "argu', ['<tool_call>\n{"name": "get_weather", "argu']),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', [("add", {"a": 1})]),
    (
        '<tool_call>{"name": "add", "arguments": "[1]"}</tool_call>',
        ['<tool_call>{"name": "add", "arguments": "[1]"}</tool_call>'],
    ),
    ("", []),
]

LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [C_PARIS]),
    (PARIS, [C_PARIS]),
    (f"<|python_tag|>{PARIS}", [C_PARIS]),
    (f" \n<|python_tag|> {PARIS};\n{ADD}\n", [C_PARIS, C_ADD]),
    ('{"name": "add", "parameters": {}}', [("add", {})]),
    ("The answer is {x}.", ["The answer is {x}."]),
    ("<|python", ["<|python"]),
    ('{"name": "rm_rf", "parameters": {}}', ['{"name": "rm_rf", "parameters": {}}']),
    ('{"a": 1} and text', ['{"a": 1} and text']),
    ('{"name": "get_weather", "parameters": {"city": "Par', ['{"name": "get_weather", "parameters": {"city": "Par']),
    (f"{PARIS} That is all.", [C_PARIS, "That is all."]),
    ("  ", ["  "]),
    ("", []),
]


MISTRAL_CASES = [
    (f"[TOOL_CALLS] [{PARIS}]", [C_PARIS]),
    (f"[TOOL_CALLS][{PARIS}, {ADD}]", [C_PARIS, C_ADD]),
    (f"[TOOL_CALLS] {PARIS}", [C_PARIS]),  # one call object
    (f"Let me look.\n[TOOL_CALLS] [{PARIS}]\nDone.", ["Let me look.", C_PARIS, "Done."]),
    ('[TOOL_CALLS] [{"name": "rm_rf", "arguments": {}}]', ['[TOOL_CALLS] [{"name": "rm_rf", "arguments": {}}]']),
    (f"[TOOL_CALLS] [{PARIS}, {{}}]", [f"[TOOL_CALLS] [{PARIS}, {{}}]"]),  # each must be a call
    ("[TOOL_CALLS] sorry", ["[TOOL_CALLS] sorry"]),
    (f"[TOOL_CALLS] [{PARIS[:30]}", [f"[TOOL_CALLS] [{PARIS[:30]}"]),
    ("[1] A list [TOOL", ["[1] A list [TOOL"]),
    ("", []),
]

# The JSON calls models fall back to under tool_choice auto, as the whole reply, in every
# format; then bare objects, which LLAMA3_JSON reads its own way (LLAMA_CASES).
FALLBACK_CASES = [
    (f"```json\n{PARIS}\n```", [C_PARIS]),
    (f"```\n{PARIS}\n```\n", [C_PARIS]),
    (f"```JSON\n[{PARIS}, {ADD}]\n```", [C_PARIS, C_ADD]),
    (f"```json {PARIS}```", [C_PARIS]),
    (f" [{PARIS}]", [C_PARIS]),
    (f"```json\n{PARIS}", [C_PARIS]),  # the end came before the closing fence
    (f'[{PARIS}, {{"name": "rm_rf", "arguments": {{}}}}]', [f'[{PARIS}, {{"name": "rm_rf", "arguments": {{}}}}]']),
    (f"```json\n{PARIS}\n```\nDone.", [f"```json\n{PARIS}\n```\nDone."]),
    (f"```python\nprint({PARIS})\n```", [f"```python\nprint({PARIS})\n```"]),
    (f"```\nprint({PARIS})\n```", [f"```\nprint({PARIS})\n```"]),
    ("[1, 2]", ["[1, 2]"]),
    ("[]", ["[]"]),
    (
        '```json\n{"name": "get_weather", "arguments": {"city": "Par',
        ['```json\n{"name": "get_weather", "arguments": {"city": "Par'],
    ),
    ("`code` and ``more``", ["`code` and ``more``"]),
    ("```", ["```"]),
]
BARE_OBJECT_CASES = [
    (PARIS, [C_PARIS]),
    (f"  \n{PARIS}\n", [C_PARIS]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [C_PARIS]),
    ('{"name": "rm_rf", "arguments": {}}', ['{"name": "rm_rf", "arguments": {}}']),  # not a declared tool
    (f"{PARIS} Done.", [f"{PARIS} Done."]),  # not the whole reply
    ('{"a": 1}', ['{"a": 1}']),
]
HERMES_FALLBACK_CASES = [
    (f"{PARIS}\n<tool_call>\n{ADD}\n</tool_call>", [PARIS, C_ADD])  # not a whole reply: Hermes' reading
]


def normal(items: list) -> list:
    """Parser output with adjacent texts joined and calls as (name, arguments dict)."""
    out: list = []
    for item in items:
        if isinstance(item, ToolCall):
            assert re.fullmatch(r"call_[0-9a-f]{24}", item.id)
            out.append((item.name, json.loads(item.arguments)))
        elif out and isinstance(out[-1], str):
            out[-1] += item
        else:
            assert item, "no empty texts"
            out.append(item)
    return out


def parse(fmt: ToolFormat, pieces: list[str]) -> list:
    parser = ToolCallParser(fmt, NAMES)
    out = []
    for piece in pieces:
        out += parser.feed(piece)
    return normal(out + parser.finish())


@pytest.mark.parametrize(
    "fmt, text, expected",
    [(H, *case) for case in HERMES_CASES + FALLBACK_CASES + BARE_OBJECT_CASES + HERMES_FALLBACK_CASES]
    + [(L, *case) for case in LLAMA_CASES + FALLBACK_CASES]
    + [(M, *case) for case in MISTRAL_CASES + FALLBACK_CASES + BARE_OBJECT_CASES],
)
def test_the_parser_gives_the_same_at_every_split(fmt, text, expected):
    assert parse(fmt, [text]) == expected
    assert parse(fmt, list(text)) == expected  # a character at a time
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            assert parse(fmt, [text[:i], text[i:j], text[j:]]) == expected, (i, j)


def test_the_parser_holds_back_only_what_may_begin_a_call():
    parser = ToolCallParser(H, NAMES)
    assert parser.feed("Sure, 1 < 2") == ["Sure, 1 < 2"]
    assert parser.feed(" and <tool") == [" and"]  # " <tool" may begin a call
    assert parser.feed("box> is it") == [" <toolbox> is it"]
    assert parser.feed(f"\n<tool_call>\n{PARIS[:20]}") == []
    assert normal(parser.feed(f"{PARIS[20:]}\n</tool_call>")) == [C_PARIS]
    assert parser.finish() == []
    llama = ToolCallParser(L, NAMES)
    assert llama.feed("The") == ["The"] and llama.feed(" answer {") == [" answer {"]


def test_a_reply_that_may_be_a_json_call_is_held_back_until_decided():
    parser = ToolCallParser(H, NAMES)
    assert parser.feed("```") == [] and parser.feed("json\n{") == [] and parser.feed(PARIS[1:]) == []
    assert parser.feed("\n```\n") == []
    assert normal(parser.finish()) == [C_PARIS]
    held = ToolCallParser(H, NAMES)
    assert held.feed(PARIS) == [] and held.feed(" ok") == [PARIS + " ok"]  # more text: not a call
    for text, out in (
        ("Sure", ["Sure"]),
        ("```py", ["```py"]),
        ("[1] and", ["[1] and"]),
        ('{"na', []),
        ('{"city": 1}, so', ['{"city": 1}, so']),
        ('{"name": "rm_rf", "arguments": {}} ', ['{"name": "rm_rf", "arguments": {}}']),
    ):
        assert ToolCallParser(H, NAMES).feed(text) == out, text
    llama = ToolCallParser(L, NAMES)  # its own bare objects: a call as soon as it is complete
    assert normal(llama.feed(PARIS)) == [C_PARIS]


@functools.cache
def marker_tokenizer() -> Tokenizer:
    """SmolLM2's tokenizer with <tool_call> and </tool_call> as special tokens and the
    Qwen-style template (tests/tiny_chat.py)."""
    return Tokenizer(write_chat_tokenizer(Path(tempfile.mkdtemp()) / "markers", "qwen", marker_tokens=True))


def acceptance(grammar: str, texts: list[str], tokenizer: Tokenizer | None = None) -> list[bool]:
    """Whether llguidance, over ``tokenizer`` (SmolLM2's by default), takes each text
    (encoded as the tokenizer does, added tokens as themselves) whole and then only the
    end of the output (EOS)."""
    import llguidance
    import llguidance.hf
    from test_tool_prompt import smollm2

    tokenizer = tokenizer or smollm2()
    lltok = llguidance.hf.from_tokenizer(tokenizer._tok)
    out = []
    for text in texts:
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()
        if ok:
            mask = matcher.compute_bitmask()
            allowed = [i for i in range(len(mask) * 8) if mask[i // 8] >> (i % 8) & 1]
            ok = allowed == [lltok.eos_token] and matcher.consume_token(lltok.eos_token) and matcher.is_stopped()
        out.append(bool(ok))
    return out


def test_a_forced_call_grammar_takes_a_valid_call_and_nothing_else():
    tools = [
        weather(),
        weather(
            "add",
            {
                "type": "object",
                "properties": {"a": {"type": "number"}},
                "required": ["a"],
                "additionalProperties": False,
            },
        ),
    ]
    required = tool_call_grammar(H, tools, REQUIRED)
    named = tool_call_grammar(H, tools, ToolChoice(ToolChoiceMode.NAMED, "add"))
    llama = tool_call_grammar(L, tools, REQUIRED)
    assert required and named and llama
    paris = f"<tool_call>\n{PARIS}\n</tool_call>"
    add = '<tool_call>\n{"name": "add", "arguments": {"a": 2.5}}\n</tool_call>'
    assert (
        acceptance(
            required,
            [
                paris,
                add,
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
                '<tool_call>\n{"name": "get_weather", "arguments": {"days": 3}}\n</tool_call>',  # city is required
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>',  # not a string
                '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',  # no more properties
                '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>',
                "Sure! " + paris,
                paris + "\nAnd more text",
                paris[:-3],
            ],
        )
        == [True, True, True, False, False, False, False, False, False, False]
    )
    assert acceptance(named, [add, paris]) == [True, False]
    assert acceptance(
        llama, ['{"name": "add", "parameters": {"a": 1}}', '{"name": "add", "arguments": {"a": 1}}', add]
    ) == [True, False, False]
    parsed = parse(H, [add])  # what the grammar forces, the parser reads
    assert parsed == [("add", {"a": 2.5})]


def test_no_grammar_without_a_forced_call_and_a_clear_error_for_a_bad_schema():
    assert tool_call_grammar(H, [weather()], AUTO) is None
    assert tool_call_grammar(H, [weather()], ToolChoice(ToolChoiceMode.NONE)) is None
    bad = weather("bad", {"type": "object", "properties": {"x": {"type": "nonsense"}}})
    with pytest.raises(ValueError, match="the parameters schema of function 'bad' cannot be enforced"):
        tool_call_grammar(H, [weather(), bad], REQUIRED)
    assert tool_call_grammar(H, [weather(), bad], ToolChoice(ToolChoiceMode.NAMED, "get_weather"))


def strict_weather(**extra) -> dict:
    tool = weather(
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        }
    )
    tool["function"].update(strict=True, **extra)
    return tool


def test_a_strict_tool_needs_openais_strict_subset():
    check_tools([strict_weather()], AUTO)
    loose = weather()
    loose["function"]["strict"] = True  # "days" not required, no additionalProperties
    with pytest.raises(ValueError) as info:
        check_tools([loose], AUTO)
    assert "tools[0].function.parameters: a strict schema's" in str(info.value)
    with pytest.raises(ValueError, match="tools.0..function.strict must be a boolean"):
        check_tools([weather() | {"function": {**weather()["function"], "strict": "yes"}}], AUTO)


def test_a_strict_tools_call_with_arguments_outside_its_schema_is_content():
    """Nothing forces a call under tool_choice auto; a strict tool's call is given out as a
    call only when its arguments match its schema (OpenAI's promise for strict tools)."""
    strict = strict_schemas([strict_weather()])
    assert set(strict) == {"get_weather"}
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    extra = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "t": 25}}\n</tool_call>'
    for text, is_call in ((good, True), (extra, False)):
        parser = ToolCallParser(H, {"get_weather"}, strict)
        out = parser.feed(text) + parser.finish()
        assert [isinstance(x, ToolCall) for x in out] == [is_call], out
    loose = ToolCallParser(H, {"get_weather"})
    assert isinstance((loose.feed(extra) + loose.finish())[0], ToolCall)


MARKED_TOOL = weather(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)


def test_a_forced_call_names_the_markers_the_model_has_as_tokens():
    """Where <tool_call> is one token (Qwen2.5's 151657), the grammar must force that token:
    written as text, llguidance (which takes every added token as special) allows the
    token and then rejects it; where it is text (SmolLM2), text it stays."""
    from test_tool_prompt import smollm2

    tokenizer = marker_tokenizer()
    markers = marker_tokens(tokenizer, H)
    assert markers == MARKER_TOKENS and marker_tokens(smollm2(), H) == {}
    paris = f"<tool_call>\n{PARIS}\n</tool_call>"
    ids = tokenizer.encode(paris, add_special_tokens=False)
    assert ids[0] == MARKER_TOKENS["<tool_call>"] and ids[-1] == MARKER_TOKENS["</tool_call>"]
    tools = [weather()]
    assert acceptance(tool_call_grammar(H, tools, REQUIRED, markers), [paris, PARIS], tokenizer) == [True, False]
    assert acceptance(tool_call_grammar(H, tools, REQUIRED), [paris], tokenizer) == [False]  # the fault
    assert acceptance(tool_call_grammar(H, tools, REQUIRED, {}), [paris]) == [True]
    assert "<[49152]>" in (tool_call_grammar(M, tools, REQUIRED, {"[TOOL_CALLS]": 49152}) or "")
    assert acceptance(tool_call_grammar(M, tools, REQUIRED), [f"[TOOL_CALLS] [{PARIS}]"]) == [True]


def test_the_detokenizer_keeps_the_markers_among_special_tokens():
    tokenizer = marker_tokenizer()
    ids = tokenizer.encode("<|im_start|><tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False)
    assert len(ids) == 7 and tokenizer.decode(ids) == "\n{}\n"  # special tokens skipped
    kept = "<tool_call>\n{}\n</tool_call>"
    assert tokenizer.decode(ids, keep=MARKER_TOKENS.values()) == kept
    detokenizer = IncrementalDetokenizer(tokenizer, keep=MARKER_TOKENS.values())
    assert "".join(detokenizer.push(i) for i in ids) + detokenizer.flush() == kept


@pytest.mark.parametrize(
    "choice", [REQUIRED, ToolChoice(ToolChoiceMode.NAMED, "get_weather")], ids=["required", "named"]
)
def test_a_forced_call_over_marker_tokens_is_parsed_as_a_call(choice):
    """Random logits masked by the runner's constraint under the forced-call grammar, the
    tokens detokenized and parsed as the API does: one call, its arguments in the schema."""
    import llguidance.hf
    import torch

    from shardline.runner.constraint import Constraint

    tokenizer = marker_tokenizer()
    lltok = llguidance.hf.from_tokenizer(tokenizer._tok, eos_token=tokenizer.eos_token_ids)
    other = weather(
        "add",
        {
            "type": "object",
            "properties": {"a": {"type": "integer", "maximum": 9}},
            "required": ["a"],
            "additionalProperties": False,
        },
    )
    tools = [MARKED_TOOL, other]
    stops = tuple(tokenizer.eos_token_ids)
    constraint = Constraint.start(
        tool_call_grammar(H, tools, choice, marker_tokens(tokenizer, H)) or "", lambda: lltok, stops
    )
    generator = torch.Generator().manual_seed(1)
    ids = []
    for _ in range(300):
        logits = torch.randn(tokenizer.vocab_size, generator=generator)
        constraint.apply(logits)
        token = int(logits.argmax())
        if token in stops:
            break
        constraint.consume(token)
        ids.append(token)
    assert constraint.failed is None and constraint.finished and MARKER_TOKENS["<tool_call>"] == ids[0]
    detokenizer = IncrementalDetokenizer(tokenizer, keep=marker_tokens(tokenizer, H).values())
    parser = ToolCallParser(H, tool_names(tools))
    out = [item for i in ids for item in parser.feed(detokenizer.push(i))]
    out += parser.feed(detokenizer.flush()) + parser.finish()
    [call] = out
    assert isinstance(call, ToolCall) and call.name in ({"get_weather"} if choice.name else {"get_weather", "add"})
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.name]
    assert matches_schema(json.loads(call.arguments), schema)
