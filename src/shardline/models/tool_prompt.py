"""Tool definitions and tool history for chat templates, with or without tool support.

A template that reads ``tools`` (Qwen2.5, Llama 3.1, Hermes ...) gets the tools and the
history as they are, call arguments as dicts (templates write them with ``|tojson``). For
one that does not (SmolLM2's, for one), :func:`with_tools_in_text` writes everything as
message text in the Hermes style (shardline's own wording): the tools in a system message
between ``<tools></tools>``, calls as ``<tool_call>`` JSON blocks, results as
``<tool_response>`` blocks in a user turn, so the model answers in that style.
"""

from __future__ import annotations

import json
import re
from typing import Any


def template_reads_tools(template: str | None) -> bool:
    """Whether the Jinja ``template`` reads a ``tools`` variable (found in its syntax
    tree; by a word match where Jinja cannot parse it, e.g. transformers' own tags)."""
    if not template:
        return False
    import jinja2
    import jinja2.meta

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return re.search(r"\btools\b", template) is not None
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def call_arguments(arguments: Any) -> dict[str, Any] | None:
    """``arguments`` as a dict: a dict as it is, JSON text of an object parsed; else None."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None
    return None


def _arguments(arguments: Any) -> Any:
    """Call arguments as a dict where they are JSON text of an object; else as given."""
    parsed = call_arguments(arguments)
    return arguments if parsed is None else parsed


def with_dict_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with its tool calls' ``arguments`` as dicts (a copy where any change)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        function = dict(call.get("function") or {})
        function["arguments"] = _arguments(function.get("arguments"))
        fixed.append({**call, "function": function})
    return {**message, "tool_calls": fixed}


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """The system-prompt text listing ``tools`` and the ``<tool_call>`` format to call them."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You can call functions to help answer the user. Each function is described by a JSON "
        "schema between <tools> and </tools>:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and its arguments between "
        "<tool_call> and </tool_call>, exactly like this:\n"
        '<tool_call>\n{"name": "function_name", "arguments": {"argument_name": "value"}}\n</tool_call>\n'
        "Write one such block for each call. The result of a call comes back to you between "
        "<tool_response> and </tool_response>."
    )


def call_text(call: dict[str, Any]) -> str:
    """One history call as a ``<tool_call>`` block."""
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": _arguments(function.get("arguments"))}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def with_tools_in_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` for a template without tool support: ``tools`` (when any) in the
    system message (added after the first system message's text, or as a new first
    message), assistant calls appended to the assistant's text as ``<tool_call>`` blocks,
    and each run of ``tool`` messages as one user message of ``<tool_response>`` blocks."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            parts = [message["content"]] if message.get("content") else []
            parts += [call_text(call) for call in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "_results": True})
        else:
            out.append(message)
    out = [{k: v for k, v in m.items() if k != "_results"} for m in out]
    if tools:
        text = tools_system_text(tools)
        if out and out[0].get("role") == "system":
            first = out[0].get("content")
            out[0] = {**out[0], "content": f"{first}\n\n{text}" if first else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
