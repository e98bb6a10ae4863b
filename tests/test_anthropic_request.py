"""The Anthropic Messages request (:mod:`shardline.api.anthropic_request`): what Claude
Code sends by default validates, and the context-management edits by tables."""

from __future__ import annotations

import pytest

from shardline.api.anthropic_request import (
    CLEARED_TOOL_RESULT,
    ContextManagement,
    Message,
    MessagesRequest,
    apply_edits,
)
from shardline.api.request_body import parse_raw
from shardline.api.text_stream import APIError

pytestmark = pytest.mark.fast


def _turns(uses: int, names: tuple[str, ...] = ("read",), thinking: bool = False) -> list[Message]:
    """A conversation of ``uses`` tool uses, each an assistant call and a user result of
    100 characters (a name from ``names`` in turn)."""
    out = [Message(role="user", content="start")]
    for i in range(uses):
        blocks: list[dict] = [{"type": "thinking", "thinking": f"t{i}", "signature": "s"}] if thinking else []
        blocks.append({"type": "tool_use", "id": f"u{i}", "name": names[i % len(names)], "input": {"i": i}})
        out.append(Message.model_validate({"role": "assistant", "content": blocks}))
        out.append(
            Message.model_validate(
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"u{i}", "content": "x" * 100}]}
            )
        )
    return out


def _results(messages: list[Message]) -> list[str]:
    return [b.text() for m in messages for b in m.blocks() if b.type == "tool_result"]


def _edits(*edits: dict) -> ContextManagement:
    return ContextManagement.model_validate({"edits": list(edits)})


CLEAR = {"type": "clear_tool_uses_20250919"}
C = CLEARED_TOOL_RESULT


@pytest.mark.parametrize(
    "edit,input_tokens,uses,names,cleared",
    [
        (CLEAR, 99_999, 5, ("read",), []),  # the default trigger, 100,000 input tokens, not passed
        (CLEAR, 100_001, 5, ("read",), [0, 1]),  # passed: all but the last 3 (the default keep)
        ({**CLEAR, "keep": {"type": "tool_uses", "value": 0}}, 100_001, 2, ("read",), [0, 1]),
        ({**CLEAR, "trigger": {"type": "tool_uses", "value": 4}}, None, 4, ("read",), []),  # 4 uses: not over 4
        ({**CLEAR, "trigger": {"type": "tool_uses", "value": 4}}, None, 5, ("read",), [0, 1]),
        (
            {**CLEAR, "keep": {"type": "tool_uses", "value": 1}, "exclude_tools": ["grep"]},
            10**6,
            4,
            ("read", "grep"),
            [0, 2],
        ),  # grep's uses stay
        (
            {
                **CLEAR,
                "keep": {"type": "tool_uses", "value": 1},
                "clear_at_least": {"type": "input_tokens", "value": 500},
            },
            10**6,
            4,
            ("read",),
            [],
        ),  # it would free 3 x (100 - placeholder) tokens: under 500, nothing cleared
        (
            {
                **CLEAR,
                "keep": {"type": "tool_uses", "value": 1},
                "clear_at_least": {"type": "input_tokens", "value": 100},
            },
            10**6,
            4,
            ("read",),
            [0, 1, 2],
        ),
    ],
)
def test_clear_tool_uses(edit, input_tokens, uses, names, cleared):
    turns = _turns(uses, names)
    out, applied = apply_edits(turns, _edits(edit), input_tokens, len)
    assert [i for i, text in enumerate(_results(out)) if text == C] == cleared
    assert _results(turns) == ["x" * 100] * uses  # the request's own turns are not changed
    if cleared:
        assert applied == [
            {
                "type": "clear_tool_uses_20250919",
                "cleared_tool_uses": len(cleared),
                "cleared_input_tokens": len(cleared) * (100 - len(C)),
            }
        ]
    else:
        assert applied == [] and out == turns


@pytest.mark.parametrize("inputs,cleared_inputs", [(True, [0, 1]), (["grep"], [1]), (False, [])])
def test_clear_tool_inputs(inputs, cleared_inputs):
    edit = {**CLEAR, "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": inputs}
    out, _ = apply_edits(_turns(3, ("read", "grep")), _edits(edit), 10**6, len)
    calls = [b for m in out for b in m.blocks() if b.type == "tool_use"]
    assert [i for i, b in enumerate(calls) if b.input == {"cleared": C}] == cleared_inputs


@pytest.mark.parametrize(
    "keep,kept",
    [
        (None, [3]),  # the default: the last turn's thinking
        ({"type": "thinking_turns", "value": 2}, [2, 3]),
        ({"type": "thinking_turns", "value": 0}, []),
        ("all", [0, 1, 2, 3]),
        ({"type": "all"}, [0, 1, 2, 3]),
    ],
)
def test_clear_thinking(keep, kept):
    edit = {"type": "clear_thinking_20251015", **({} if keep is None else {"keep": keep})}
    out, applied = apply_edits(_turns(4, thinking=True), _edits(edit), None, len)
    with_thinking = [
        i
        for i, m in enumerate(m for m in out if m.role == "assistant")
        if any(b.type == "thinking" for b in m.blocks())
    ]
    assert with_thinking == kept
    assert applied == (
        [{"type": "clear_thinking_20251015", "cleared_thinking_turns": 4 - len(kept), "cleared_input_tokens": 0}]
        if len(kept) < 4
        else []
    )


def test_thinking_and_system_turns_render_as_the_template_takes_them():
    """Thinking blocks are left out of the prompt; a system turn between the others is a
    system message where it stands."""
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "system": "be brief",
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "redacted_thinking", "data": "abc"},
                        {"type": "text", "text": "hello"},
                    ],
                },
                {"role": "system", "content": "The user's files changed."},
                {"role": "user", "content": "and now?"},
            ],
        }
    )
    assert req.chat() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "system", "content": "The user's files changed."},
        {"role": "user", "content": "and now?"},
    ]


def _body(**extra) -> bytes:
    import json

    return json.dumps(
        {"model": "m", "max_tokens": 32000, "messages": [{"role": "user", "content": "hi"}], **extra}
    ).encode()


@pytest.mark.parametrize(
    "extra",
    [
        {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}},
        {"thinking": {"type": "enabled", "budget_tokens": 31999}},
        {"thinking": {"type": "disabled"}},
        {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}},
        {
            "tools": [
                {
                    "name": "Bash",
                    "description": "run",
                    "input_schema": {"type": "object"},
                    "eager_input_streaming": True,
                    "strict": False,
                }
            ]
        },
    ],
)
def test_claude_codes_defaults_validate(extra):
    parse_raw(_body(**extra), MessagesRequest)


@pytest.mark.parametrize(
    "extra,named",
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 32000}}, "budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1023}}, "budget_tokens"),
        ({"thinking": {"type": "adaptive", "budget_tokens": 2000}}, "budget_tokens"),
        ({"output_config": {"effort": "none"}}, "effort"),
        ({"context_management": {"edits": [{"type": "compact_20260112"}]}}, "context_management"),
        # a threshold of the wrong kind, and a keep without its count (found by a trial)
        ({"context_management": {"edits": [{**CLEAR, "keep": {"type": "input_tokens", "value": 0}}]}}, "keep"),
        (
            {"context_management": {"edits": [{**CLEAR, "clear_at_least": {"type": "tool_uses", "value": 1}}]}},
            "clear_at_least",
        ),
        (
            {
                "context_management": {
                    "edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns"}}]
                }
            },
            "value",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "x"}]},
                ]
            },
            "system turn",
        ),
    ],
)
def test_malformed_reasoning_is_refused(extra, named):
    with pytest.raises(APIError) as caught:
        parse_raw(_body(**extra), MessagesRequest)
    assert caught.value.status == 400 and named in caught.value.message


def test_deferred_tools_are_not_offered():
    """A tool with defer_loading is for a tool search, which is not run here: the model is
    not offered it, and the request says so (Claude Code's DeferredToolPlaceholder)."""
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [
                {"name": "Bash", "input_schema": {"type": "object"}},
                {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True},
            ],
        }
    )
    assert [t["function"]["name"] for t in req.to_generation().tools] == ["Bash"]
    assert req.not_offered() == ["custom:Later"]


def test_a_deferred_tool_cannot_be_forced():
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True}],
            "tool_choice": {"type": "tool", "name": "Later"},
        }
    )
    with pytest.raises(APIError, match="defer_loading") as caught:
        req.to_generation()
    assert caught.value.param == "tool_choice.name"


@pytest.mark.parametrize(
    "system, text",
    [
        # Claude Code's first block: a header whose cch changes with every request
        (
            [
                {
                    "type": "text",
                    "text": "x-anthropic-billing-header: cc_version=2.0.76.1a2; cc_entrypoint=cli; cch=9f3e1;",
                },
                {"type": "text", "text": "You are Claude Code."},
            ],
            "You are Claude Code.",
        ),
        ("x-anthropic-billing-header: cc_version=2.0.76.1a2; cch=00000;\nYou are Claude Code.", "You are Claude Code."),
        ("You are Claude Code.\nx-anthropic-billing-header: cch=1;", "You are Claude Code.\n"),
        # not a header line: kept
        ("Mention x-anthropic-billing-header: a; in prose", "Mention x-anthropic-billing-header: a; in prose"),
        ("x-anthropic-note: no semicolon at the end", "x-anthropic-note: no semicolon at the end"),
    ],
)
def test_volatile_system_lines_are_left_out_of_the_prompt(system, text):
    """Two requests that differ only in Claude Code's per-request header give one prompt,
    so the second turn finds the first's prefix cached."""
    req = MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "system": system, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert req.chat()[0] == {"role": "system", "content": text}


def test_a_system_prompt_of_only_volatile_lines_is_no_system_turn():
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "system": "x-anthropic-billing-header: cch=1;",
            "messages": [{"role": "user", "content": "hi"}],
        }
    )
    assert req.chat() == [{"role": "user", "content": "hi"}]


def test_claude_codes_recorded_request_has_no_header_line_in_its_prompt():
    import json
    from pathlib import Path

    recorded = Path(__file__).parent / "fixtures/clients/claude-code/01-messages.json"
    body = json.loads(recorded.read_text())["body"]
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header:")
    system = MessagesRequest.model_validate(body).chat()[0]
    assert system["role"] == "system" and system["content"].startswith("You are a Claude agent")
