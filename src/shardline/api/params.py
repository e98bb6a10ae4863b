"""Which request parameters each API endpoint honours, and the screen that refuses the rest.

The rule: every parameter of an API's reference either works as that reference says or is
refused with a 400 naming it; nothing is accepted and ignored. :data:`PARAMETERS` is the
one table of it (the table of API parameters in docs/api.md is rendered from it, and each
row names the test that checks it). :func:`screen` runs on every request body before its
fields are validated:

- a ``null`` value is taken as the parameter's default (clients send null for "unset");
- a refused parameter is allowed only at a value that asks for nothing (``store: false``,
  ``modalities: ["text"]``, ...), else 400 naming it;
- a parameter the table does not know is refused as the API itself refuses it (OpenAI:
  "Unrecognized request argument supplied"; Anthropic: "Extra inputs are not permitted").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any

from pydantic import Field


class Endpoint(str, Enum):
    """The generation endpoints whose parameters are screened."""

    CHAT = "POST /v1/chat/completions"
    COMPLETIONS = "POST /v1/completions"
    RESPONSES = "POST /v1/responses"
    MESSAGES = "POST /v1/messages"
    COUNT_TOKENS = "POST /v1/messages/count_tokens"
    OLLAMA_CHAT = "POST /api/chat"
    OLLAMA_GENERATE = "POST /api/generate"
    OLLAMA_OPTIONS = "options of /api/chat and /api/generate"


class ParamError(ValueError):
    """A parameter refused by :func:`screen`: ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


StopString = Annotated[str, Field(min_length=1)]
"""A stop sequence: an empty one would match before any text (each API's server refuses
it or never stops on it; here it is a 400 naming it)."""


@dataclass(frozen=True)
class Param:
    """One row of the table: a parameter of an endpoint, whether it works, how, and the
    test that checks it (``file.py::test_name``).

    ``allowed``: for a refused parameter, the values that ask for nothing and pass."""

    endpoint: Endpoint
    name: str
    works: bool
    note: str
    test: str
    allowed: tuple[Any, ...] = ()


def screen(endpoint: Endpoint, data: Any, table: tuple[Param, ...] | None = None) -> Any:
    """``data`` (a parsed JSON body) with its null parameters dropped, after refusing what
    :data:`PARAMETERS` refuses for ``endpoint``; bodies that are not objects pass as they
    are (the request model refuses them).

    Raises:
        ParamError: a refused parameter at a value other than its ``allowed`` ones, or one
            the table does not list for the endpoint.
    """
    if not isinstance(data, dict):
        return data
    rows = {p.name: p for p in (PARAMETERS if table is None else table) if p.endpoint == endpoint}
    out = {}
    for name, value in data.items():
        if value is None:
            continue
        row = rows.get(name)
        if row is None:
            raise ParamError(name, _unknown(endpoint, name))
        if not row.works and value not in row.allowed:
            raise ParamError(name, f"{name}: {row.note}")
        out[name] = value
    return out


def _unknown(endpoint: Endpoint, name: str) -> str:
    if endpoint in (Endpoint.MESSAGES, Endpoint.COUNT_TOKENS):
        return f"{name}: Extra inputs are not permitted"
    if endpoint is Endpoint.OLLAMA_OPTIONS:
        return f"{name}: not an option shardline knows"
    if endpoint in (Endpoint.OLLAMA_CHAT, Endpoint.OLLAMA_GENERATE):
        return f"{name}: not a parameter of this endpoint"
    return f"Unrecognized request argument supplied: {name}"


def _rows(endpoint: Endpoint, test_file: str, *rows: tuple) -> tuple[Param, ...]:
    """Rows of one endpoint: ``(name, works, note, test[, allowed])``; a test without
    ``::`` is a function of ``test_file``."""
    out = []
    for name, works, note, test, *allowed in rows:
        out.append(
            Param(
                endpoint,
                name,
                works,
                note,
                test if "::" in test else f"{test_file}::{test}",
                tuple(allowed[0]) if allowed else (),
            )
        )
    return tuple(out)


_E2E = "test_api_params_e2e.py"
_REFUSED = "test_refused_parameters"
_OPENAI_SAMPLING: tuple[tuple, ...] = (
    ("model", True, "the model's id (GET /v1/models)", "test_cluster_e2e.py::test_unknown_model_error_code"),
    (
        "stream",
        True,
        "server-sent events ending with data: [DONE]",
        "test_cluster_e2e.py::test_streaming_chunks_follow_openai_format",
    ),
    (
        "stream_options",
        True,
        "include_usage: a last chunk with the usage; include_obfuscation (default "
        "true): text chunks padded to 16s (with stream only)",
        "test_cluster_e2e.py::test_streaming_chunks_follow_openai_format",
    ),
    ("temperature", True, "0-2 (0: greedy); null: 1", "test_null_is_the_default"),
    ("top_p", True, "0-1 (0: greedy); null: 1", "test_top_p_zero_is_greedy"),
    ("seed", True, "reproducible sampling for this request alone", "test_seed_reproduces_a_sample"),
    (
        "stop",
        True,
        "a string, or up to 4; the text ends before the first",
        "test_cluster_e2e.py::test_stop_string_ends_the_text",
    ),
    ("n", True, "1-8 choices, each its own sequence in the batch", "test_n_choices"),
    ("frequency_penalty", True, "-2 to 2, per time a token was generated", "test_penalties_change_a_repetitive_answer"),
    ("presence_penalty", True, "-2 to 2, once for each token generated", "test_penalties_change_a_repetitive_answer"),
    ("logit_bias", True, "token id -> -100..100 added to its logit", "test_logit_bias_bans_a_token"),
    ("user", True, "an end-user id: recorded nowhere, as the reference allows", "test_identifiers_are_accepted"),
    ("safety_identifier", True, "an end-user id: recorded nowhere", "test_identifiers_are_accepted"),
    (
        "prompt_cache_key",
        True,
        "a cache hint: every prompt's prefix is cached without it, so no effect",
        "test_identifiers_are_accepted",
    ),
    ("service_tier", False, "only 'auto' or 'default' (one tier here)", _REFUSED, ("auto", "default")),
    ("store", False, "stored completions are not kept (false only)", _REFUSED, (False,)),
    ("metadata", False, "stored completions are not kept (metadata needs store)", _REFUSED, ({},)),
    # shardline's extensions, as vLLM and llama.cpp's server take them
    ("top_k", True, "extension (vLLM): the k most likely tokens only", "test_sampling_extensions_are_checked"),
    (
        "min_p",
        True,
        "extension (vLLM): drop tokens under min_p x the top one's probability",
        "test_sampling_extensions_are_checked",
    ),
    (
        "repetition_penalty",
        True,
        "extension (vLLM): CTRL's penalty over prompt and output",
        "test_penalties_change_a_repetitive_answer",
    ),
    (
        "ignore_eos",
        True,
        "extension (vLLM): generate max_tokens whatever the model says",
        "test_sampling_extensions_are_checked",
    ),
    (
        "return_progress",
        True,
        "extension (llama.cpp): prefill progress chunks while streaming",
        "test_cluster_e2e.py::test_long_prompt_streams_prefill_progress_when_asked",
    ),
    (
        "cache_prompt",
        True,
        "extension (llama.cpp): false prefills the whole prompt, its cached prefix unused (default true)",
        "test_prefix_cache_e2e.py::test_cache_prompt_false_prefills_the_whole_prompt",
    ),
    (
        "speculative.n_max",
        True,
        "extension (llama.cpp): most tokens drafted a step (by prompt lookup, or the instance's "
        "draft model) and checked in the decode step (0 to 16; 0: none; absent: 16 for a dense "
        "model, 3 with a draft model, 0 for a mixture of experts); requests without logprobs or "
        "a grammar, greedy or sampled; the same text (a seeded sample's too), in fewer steps "
        "where the output repeats the prompt",
        "test_speculative_decoding_is_the_same_greedy_text",
    ),
    (
        "speculative.p_min",
        True,
        "extension (llama.cpp): on an instance with a draft model, its draft ends before a "
        "guess it gives a lower probability (0 to 1; absent: 0, as llama.cpp's); prompt lookup "
        "ignores it",
        "test_draft_model.py::test_openai_speculative_p_min_reaches_the_task",
    ),
)

_OLLAMA_COMMON: tuple[tuple, ...] = (
    (
        "model",
        True,
        "the model's id, with or without :latest",
        "test_ollama_e2e.py::test_tags_list_the_served_model_and_names_take_ollamas_tag",
    ),
    ("stream", True, "newline-delimited JSON (default true)", "test_ollama_e2e.py::test_chat_streams_by_default"),
    ("options", True, "see the options rows", "test_ollama_options_work"),
    ("format", True, '"json" or a JSON schema: constrained decoding', "test_ollama_format_parses"),
    (
        "keep_alive",
        True,
        "0 unloads; a duration unloads after that idle time; negative: never",
        "test_ollama_client_e2e.py::test_keep_alive_unloads",
    ),
    ("logprobs", True, "each token's log-probability", "test_logprobs_match_the_greedy_choice"),
    ("top_logprobs", True, "0-20 alternatives per token (needs logprobs)", "test_logprobs_match_the_greedy_choice"),
    ("images", False, "text only", _REFUSED, ([],)),
    (
        "think",
        True,
        "a reasoning model (Qwen3's kind) thinks (true) or not (false), or thinks at a level (low, "
        "medium, high, max: gpt-oss's reasoning effort, max as high; another value: Ollama's \"invalid think value\"); absent: as its chat template's default. Its thinking: "
        "message.thinking (chat) / thinking (generate), unless false; no effect on a model that does not reason",
        "test_reasoning_api.py::test_ollama_thinking",
    ),
)

PARAMETERS: tuple[Param, ...] = (
    *_rows(
        Endpoint.CHAT,
        _E2E,
        *_OPENAI_SAMPLING,
        (
            "messages",
            True,
            "system/developer/user/assistant/tool; text parts only; a name only where "
            "the chat template renders it (a tool result's must name an earlier call)",
            "test_http_conventions.py::test_refusals_that_need_no_model",
        ),
        (
            "max_completion_tokens",
            True,
            "most completion tokens",
            "test_cluster_e2e.py::test_completion_longer_than_the_context_is_refused",
        ),
        (
            "max_tokens",
            True,
            "most completion tokens (older name)",
            "test_cluster_e2e.py::test_completion_longer_than_the_context_is_refused",
        ),
        ("logprobs", True, "each token's log-probability", "test_logprobs_match_the_greedy_choice"),
        ("top_logprobs", True, "0-20 alternatives per token (needs logprobs)", "test_logprobs_match_the_greedy_choice"),
        (
            "response_format",
            True,
            "text, json_object, json_schema: constrained decoding (strict: "
            "OpenAI's strict subset of JSON Schema, else 400)",
            "test_response_format_json_schema_parses",
        ),
        (
            "tools",
            True,
            "function tools, rendered by the model's chat template; a strict tool's schema "
            "in OpenAI's strict subset (else 400), its calls' arguments valid under it",
            "test_tools_e2e.py::test_openai_tool_round_trip",
        ),
        (
            "tool_choice",
            True,
            "none, auto, required, or a named function (forced by grammar)",
            "test_tools_e2e.py::test_openai_tool_round_trip",
        ),
        ("parallel_tool_calls", True, "false: at most one call", "test_tools_e2e.py::test_openai_tool_round_trip"),
        ("modalities", False, "text only", _REFUSED, (["text"],)),
        ("audio", False, "text only: no audio output", _REFUSED),
        ("prediction", False, "predicted outputs are not supported", _REFUSED),
        (
            "reasoning_effort",
            True,
            "none to max: a reasoning model (Qwen3's kind) thinks unless none, its "
            "thinking in reasoning_content and its tokens in usage.completion_tokens_details.reasoning_tokens "
            "(the level does not bound it; gpt-oss's template writes it as its level: none and minimal low, "
            "xhigh and max high); a model that does not reason spends no effort",
            "test_reasoning_api.py::test_chat_completions_reasoning_content",
        ),
        (
            "chat_template_kwargs",
            True,
            "extension (vLLM): enable_thinking only: whether a reasoning model thinks (over reasoning_effort)",
            "test_reasoning_api.py::test_chat_completions_thinking",
        ),
        (
            "verbosity",
            True,
            "low, medium, high: a hint a model without that training does not follow",
            "test_reasoning_settings_are_not_spent",
        ),
        ("web_search_options", False, "no web search", _REFUSED),
        ("functions", False, "deprecated: use tools", _REFUSED),
        ("function_call", False, "deprecated: use tool_choice", _REFUSED),
    ),
    *_rows(
        Endpoint.COMPLETIONS,
        _E2E,
        *_OPENAI_SAMPLING,
        (
            "prompt",
            True,
            "a text, or token ids; or one of either in a list",
            "test_completions_e2e.py::test_token_id_prompts_are_taken_as_they_are",
        ),
        (
            "max_tokens",
            True,
            "most completion tokens (default 16; 0 with echo: the prompt alone, scored)",
            "test_completions_e2e.py::test_a_text_prompt_is_continued",
        ),
        (
            "logprobs",
            True,
            "0-5: each token's log-probability and that many alternatives",
            "test_logprobs_match_the_greedy_choice",
        ),
        (
            "echo",
            True,
            "the prompt first in the text; with logprobs, each prompt token's too (the first null)",
            "test_completions_e2e.py::test_echo_with_logprobs_scores_the_prompt_as_lm_evaluation_harness_reads_it",
        ),
        ("best_of", False, "only 1 (no server-side ranking)", _REFUSED, (1,)),
        ("suffix", False, "insertion is not supported", _REFUSED),
    ),
    *_rows(
        Endpoint.RESPONSES,
        "test_responses_e2e.py",
        ("model", True, "the model's id", "test_create_answers_as_chat_completions_do"),
        (
            "input",
            True,
            "a string, or message, function_call and function_call_output items (text parts only)",
            "test_create_answers_as_chat_completions_do",
        ),
        (
            "instructions",
            True,
            "a system message first",
            "test_responses_api.py::test_a_request_maps_to_a_generation_request",
        ),
        (
            "max_output_tokens",
            True,
            "most output tokens; then status incomplete",
            "test_max_output_tokens_leaves_it_incomplete",
        ),
        ("temperature", True, "0-2; null: 1", "test_responses_api.py::test_sampling"),
        ("top_p", True, "0-1 (0: greedy); null: 1", "test_responses_api.py::test_sampling"),
        ("stream", True, "the reference's events, numbered", "test_stream_events_build_the_same_text"),
        (
            "stream_options",
            True,
            "include_obfuscation",
            "test_responses_api.py::test_tool_calls_are_function_call_items",
        ),
        (
            "store",
            True,
            "kept in the node's memory (1,000 responses, 64 MiB, least recently used dropped)",
            "test_store_false_is_not_kept",
        ),
        (
            "previous_response_id",
            True,
            "continues a stored response's conversation",
            "test_previous_response_id_continues_the_conversation",
        ),
        (
            "tools",
            True,
            "function and custom tools, and a namespace's, rendered by the chat template "
            "(strict as in Chat Completions); hosted tools (web_search, file_search, mcp, ...) and deferred "
            "ones are not offered to the model, named in the X-Shardline-Tools-Not-Offered header",
            "test_tools_e2e.py::test_responses_tool_round_trip",
        ),
        (
            "tool_choice",
            True,
            "none, auto, required, a named function, allowed_tools",
            "test_tools_e2e.py::test_responses_tool_round_trip",
        ),
        (
            "parallel_tool_calls",
            True,
            "false: at most one call",
            "test_responses_api.py::test_tool_calls_are_function_call_items",
        ),
        (
            "text",
            True,
            "format text, json_object, json_schema (constrained decoding); verbosity low, medium, "
            "high: a hint a model without that training does not follow",
            "test_api_params_e2e.py::test_responses_format_and_logprobs",
        ),
        (
            "include",
            True,
            "message.output_text.logprobs; the reference's other values ask for what is never "
            "made here (reasoning's encrypted content, hosted tools' calls): nothing to include",
            "test_api_params_e2e.py::test_responses_format_and_logprobs",
        ),
        (
            "top_logprobs",
            True,
            "0-20 alternatives per token (with the logprobs include)",
            "test_api_params_e2e.py::test_responses_format_and_logprobs",
        ),
        ("metadata", True, "up to 16 pairs, echoed", "test_responses_api.py::test_fields_accepted"),
        ("user", True, "an end-user id, echoed", "test_responses_api.py::test_fields_accepted"),
        ("safety_identifier", True, "an end-user id, echoed", "test_responses_api.py::test_fields_accepted"),
        (
            "prompt_cache_key",
            True,
            "a cache hint: every prompt's prefix is cached without it, so no effect",
            "test_responses_api.py::test_fields_accepted",
        ),
        (
            "max_tool_calls",
            True,
            "limits built-in tools, of which there are none here",
            "test_responses_api.py::test_fields_accepted",
        ),
        (
            "truncation",
            True,
            "disabled only (auto refused)",
            "test_responses_api.py::test_fields_refused_name_the_parameter",
        ),
        (
            "service_tier",
            True,
            "auto or default only (one tier)",
            "test_responses_api.py::test_fields_refused_name_the_parameter",
        ),
        (
            "background",
            False,
            "background responses are not run (false only)",
            "test_responses_api.py::test_fields_refused_name_the_parameter",
            (False,),
        ),
        (
            "reasoning",
            True,
            "effort, summary, context: a reasoning model (Qwen3's kind) thinks unless effort is "
            "none, its thinking a reasoning item (reasoning_text, no summary) before the message and its tokens in "
            "output_tokens_details.reasoning_tokens (effort: gpt-oss's level, as reasoning_effort's); a model "
            "that does not reason spends no effort and writes no summary",
            "test_reasoning_api.py::test_responses_reasoning_item",
        ),
        (
            "client_metadata",
            True,
            "the client's own ids (Codex's): recorded nowhere",
            "test_responses_api.py::test_codex_fields_are_taken",
        ),
        *(
            (name, False, "not supported", "test_responses_api.py::test_fields_refused_name_the_parameter", allowed)
            for name, allowed in (
                ("access_programs", ()),
                ("background_options", ()),
                ("context_management", ([],)),
                ("conversation", ()),
                ("image", ()),
                ("moderation", ()),
                ("prompt", ()),
                ("prompt_cache_options", ()),
                ("prompt_cache_retention", ()),
            )
        ),
    ),
    *_rows(
        Endpoint.MESSAGES,
        _E2E,
        ("model", True, "the model's id", "test_anthropic_e2e.py::test_bad_requests_get_anthropic_errors"),
        (
            "messages",
            True,
            "user/assistant turns, and system turns where they stand; text, tool_use and "
            "tool_result blocks; thinking blocks of earlier turns left out of the prompt; a last assistant "
            "turn is continued (prefill)",
            "test_assistant_prefill_is_continued",
        ),
        (
            "max_tokens",
            True,
            "most output tokens",
            "test_anthropic_e2e.py::test_a_message_is_answered_as_the_openai_api_answers_it",
        ),
        (
            "system",
            True,
            "a string or text blocks",
            "test_anthropic_e2e.py::test_a_message_is_answered_as_the_openai_api_answers_it",
        ),
        ("temperature", True, "0-1", "test_anthropic_sampling_is_checked"),
        ("top_p", True, "0-1", "test_anthropic_sampling_is_checked"),
        ("top_k", True, "the k most likely tokens only", "test_anthropic_sampling_is_checked"),
        (
            "stop_sequences",
            True,
            "the text ends before the first; stop_reason stop_sequence",
            "test_anthropic_e2e.py::test_a_stop_sequence_ends_the_message_and_is_named",
        ),
        (
            "stream",
            True,
            "Anthropic's event stream",
            "test_anthropic_e2e.py::test_streamed_events_follow_anthropics_order",
        ),
        ("metadata", True, "user_id: an end-user id, recorded nowhere", "test_identifiers_are_accepted"),
        (
            "tools",
            True,
            "client tools {name, description, input_schema}; those with defer_loading (for a "
            "tool search, not run here) not offered, named in the X-Shardline-Tools-Not-Offered header",
            "test_tools_e2e.py::test_anthropic_tool_round_trip",
        ),
        (
            "tool_choice",
            True,
            "auto, any, tool (forced by grammar), none",
            "test_tools_e2e.py::test_anthropic_tool_round_trip",
        ),
        (
            "output_config",
            True,
            "format json_schema: constrained decoding; effort: a reasoning model thinks "
            "as it would without it (gpt-oss: at that level, xhigh and max high); no effect on a model that does "
            "not reason",
            "test_anthropic_output_format_parses",
        ),
        (
            "thinking",
            True,
            "enabled (budget_tokens 1,024 to max_tokens - 1), adaptive, between_tools: a "
            "reasoning model (Qwen3's kind) thinks, its thinking a thinking block first (display omitted: with no "
            "text; empty signature; the budget does not bound it); disabled or absent: it does not think. A model "
            "that does not reason answers without thinking blocks, its budget not spent",
            "test_reasoning_api.py::test_anthropic_thinking_blocks",
        ),
        (
            "context_management",
            True,
            "clear_tool_uses_20250919 and clear_thinking_20251015 edits, applied "
            "before the prompt is rendered; applied_edits in the answer",
            "test_anthropic_context_edits",
        ),
        (
            "cache_control",
            True,
            "a prompt-cache hint: every prompt's prefix is cached without it "
            "(usage.cache_read_input_tokens), so no effect",
            "test_identifiers_are_accepted",
        ),
        ("service_tier", False, "only 'auto' or 'standard_only' (one tier here)", _REFUSED, ("auto", "standard_only")),
        ("speed", False, "one speed here ('standard' only)", _REFUSED, ("standard",)),
        ("diagnostics", False, "not supported", _REFUSED),
        ("inference_geo", False, "runs where the cluster is", _REFUSED),
        ("user_profile_id", False, "not supported", _REFUSED),
        ("workspace_id", False, "not supported", _REFUSED),
        ("container", False, "no code-execution containers", _REFUSED),
        ("mcp_servers", False, "no MCP connector", _REFUSED),
    ),
    *_rows(
        Endpoint.COUNT_TOKENS,
        _E2E,
        ("model", True, "the model's id", "test_count_tokens_matches_the_message_usage"),
        ("messages", True, "as in /v1/messages", "test_count_tokens_matches_the_message_usage"),
        ("system", True, "as in /v1/messages", "test_count_tokens_matches_the_message_usage"),
        ("tools", True, "counted as the template renders them", "test_count_tokens_matches_the_message_usage"),
        ("tool_choice", True, "as in /v1/messages", "test_count_tokens_matches_the_message_usage"),
        (
            "thinking",
            True,
            "as in /v1/messages: a reasoning model's prompt with thinking on or off",
            "test_anthropic_reasoning_is_accepted",
        ),
        (
            "context_management",
            True,
            "as in /v1/messages; original_input_tokens in the answer",
            "test_anthropic_context_edits",
        ),
        ("mcp_servers", False, "no MCP connector", _REFUSED),
    ),
    *_rows(
        Endpoint.OLLAMA_CHAT,
        _E2E,
        *_OLLAMA_COMMON,
        (
            "messages",
            True,
            "system/user/assistant/tool (tool_name: an earlier call's); none: load the model",
            "test_ollama_e2e.py::test_chat_answers_as_the_openai_api_does",
        ),
        (
            "tools",
            True,
            "function tools; calls in message.tool_calls",
            "test_tools_e2e.py::test_ollama_tool_round_trip",
        ),
        (
            "tool_choice",
            True,
            "extension (OpenAI's values): none, auto, required, a named function",
            "test_tools_e2e.py::test_ollama_tool_round_trip",
        ),
    ),
    *_rows(
        Endpoint.OLLAMA_GENERATE,
        _E2E,
        *_OLLAMA_COMMON,
        (
            "prompt",
            True,
            "rendered as a user turn by the chat template unless raw; none: load the model",
            "test_ollama_e2e.py::test_generate_applies_the_chat_template_unless_raw",
        ),
        (
            "system",
            True,
            "a system turn before the prompt",
            "test_ollama_e2e.py::test_generate_applies_the_chat_template_unless_raw",
        ),
        (
            "raw",
            True,
            "the prompt as it is, no template",
            "test_ollama_e2e.py::test_generate_applies_the_chat_template_unless_raw",
        ),
        ("suffix", False, "insertion is not supported", _REFUSED),
        ("template", False, "the model's own chat template only", _REFUSED),
        ("context", False, "deprecated token context: send the conversation instead", _REFUSED),
        *((name, False, "not an image generation model", _REFUSED) for name in ("width", "height", "steps")),
    ),
    *_rows(
        Endpoint.OLLAMA_OPTIONS,
        _E2E,
        ("temperature", True, "default 0.8 (Ollama's)", "test_ollama_options_work"),
        ("top_p", True, "default 0.9", "test_ollama_options_work"),
        ("top_k", True, "default 40", "test_ollama_options_work"),
        ("min_p", True, "default 0", "test_ollama_options_work"),
        ("seed", True, "reproducible sampling", "test_ollama_options_work"),
        (
            "num_predict",
            True,
            "most tokens; 0 (no limit, as Ollama's runner reads it), -1 or -2 (fill the context): until the "
            "context is full; less is refused",
            "test_ollama_options_work",
        ),
        ("stop", True, "stop strings", "test_ollama_options_work"),
        (
            "num_ctx",
            True,
            "the request's context window (/api/chat: a chat past it loses its oldest messages, not "
            "system ones nor the last, as Ollama's; a prompt still past it: 400); a larger one than the "
            "instance's is the instance's, as Ollama caps it at the model's",
            "test_ollama_options_work",
        ),
        ("repeat_penalty", True, "CTRL's penalty; default 1.0 here (off)", "test_penalties_change_a_repetitive_answer"),
        (
            "repeat_last_n",
            True,
            "tokens the repeat penalty looks back at (0: off, -1: the whole context)",
            "test_ollama_options_work",
        ),
        ("presence_penalty", True, "as OpenAI's", "test_penalties_change_a_repetitive_answer"),
        ("frequency_penalty", True, "as OpenAI's", "test_penalties_change_a_repetitive_answer"),
        ("typical_p", False, "locally typical sampling is not supported (1.0 only)", _REFUSED, (1.0, 1)),
        ("tfs_z", False, "tail-free sampling is not supported (1.0 only)", _REFUSED, (1.0, 1)),
        ("mirostat", False, "mirostat is not supported (0 only)", _REFUSED, (0,)),
        ("mirostat_tau", False, "mirostat is not supported", _REFUSED),
        ("mirostat_eta", False, "mirostat is not supported", _REFUSED),
        ("penalize_newline", False, "not supported", _REFUSED),
        *(
            (name, False, "set by shardline's placement, not per request", _REFUSED)
            for name in (
                "num_keep",
                "numa",
                "num_batch",
                "num_gpu",
                "main_gpu",
                "use_mmap",
                "use_mlock",
                "num_thread",
                "low_vram",
                "f16_kv",
                "vocab_only",
            )
        ),
    ),
)


def render_table(table: tuple[Param, ...] = PARAMETERS) -> str:
    """The table of API parameters in docs/api.md (Markdown): a section per endpoint, a row
    per parameter with what it does or why it is refused, and the test that checks it."""
    out = []
    for endpoint in Endpoint:
        rows = [p for p in table if p.endpoint is endpoint]
        if not rows:
            continue
        out += [f"**{endpoint.value}**", "", "| parameter | | what it does / why refused | test |", "|---|---|---|---|"]
        for p in rows:
            allowed = f" (accepted: {', '.join(json.dumps(v) for v in p.allowed)})" if p.allowed else ""
            out.append(f"| `{p.name}` | {'works' if p.works else 'refused'} | {p.note}{allowed} | `{p.test}` |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":  # docs/api.md's table: python -m shardline.api.params
    print(render_table())
