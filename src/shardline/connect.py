"""The settings that point a coding agent at a placed model: ``shardline connect CLIENT``.

:func:`connection` (pure) gives, for one client and one model, the environment, the
configuration files and the command line; docs/clients/ shows the same for each client,
and tests/test_agents_live_e2e.py runs each real client with exactly these settings.

The clients and what they read (their own documentation is the source):

- ``claude``: Claude Code, Anthropic Messages. ``ANTHROPIC_BASE_URL``,
  ``ANTHROPIC_AUTH_TOKEN`` (sent as ``Authorization: Bearer``), ``ANTHROPIC_MODEL`` and
  the ``ANTHROPIC_DEFAULT_{OPUS,SONNET,HAIKU}_MODEL`` aliases (its background tasks ask
  for the Haiku alias), ``CLAUDE_CODE_SUBAGENT_MODEL``, ``CLAUDE_CODE_MAX_OUTPUT_TOKENS``,
  ``CLAUDE_CODE_AUTO_COMPACT_WINDOW`` (a context of 100,000 tokens or more),
  ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC`` (no telemetry or update checks).
- ``codex``: Codex CLI, OpenAI Responses. ``~/.codex/config.toml``: a model provider with
  ``base_url`` and ``wire_api = "responses"``, ``model``, ``model_context_window``.
- ``opencode``: opencode, Chat Completions through ``@ai-sdk/openai-compatible`` (bundled
  in its binary). ``opencode.json``: the provider, the model and its ``limit`` (opencode
  asks for ``limit.output`` tokens, 32,000 when unset, which a smaller context refuses).
- ``aider``: aider, Chat Completions through LiteLLM. ``--model openai/ID``,
  ``--openai-api-base``, ``--openai-api-key``; ``~/.aider.model.metadata.json`` gives
  LiteLLM the model's context.
- ``llm``: Simon Willison's llm, Chat Completions. ``extra-openai-models.yaml`` in its user
  directory.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

CLIENTS = ("claude", "codex", "opencode", "aider", "llm")
NO_KEY = "shardline"
"""The key a client is given where the cluster has none: each client insists on one, and
a node without an API key takes any."""


@dataclass(frozen=True)
class Connection:
    """How to run one client against one model.

    Attributes:
        client: one of :data:`CLIENTS`.
        env: environment variables to set.
        files: configuration files, by path (``~`` is the home directory; a relative path
            is the project's folder), with their whole content.
        command: the command line that starts the client (interactive).
        notes: what else to know, one line each.
    """

    client: str
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    command: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def text(self) -> str:
        """The settings as ``shardline connect`` prints them: the environment as shell
        lines to paste, each file's content under its path (to write, or to merge into the
        file where it exists: it may hold other settings), the command, then the notes."""
        lines = [f"# {self.client}"]
        if self.env:
            lines += ["# environment:"] + [f"export {name}={shlex.quote(value)}" for name, value in self.env.items()]
        for path, content in self.files.items():
            lines += [f"# file {path}:", content.rstrip("\n")]
        lines += ["# then run:", shlex.join(self.command)]
        lines += [f"# {note}" for note in self.notes]
        return "\n".join(lines) + "\n"


AGENT_PROMPTS = {"claude": 12_800, "codex": 9_000, "opencode": 7_800}
"""Tokens of each agent's first request before the user's first word (its system prompt
and tools), counted with SmolLM2's tokenizer (Claude Code 2.1.332, Codex 0.171.0,
opencode 1.18.33; 2026-12-07; more with more tools or MCP servers)."""


def output_tokens(context: int, prompt: int = 0) -> int:
    """The completion tokens a client is told to ask for: a quarter of the context (the
    rest for the conversation), or half what its own first prompt of ``prompt`` tokens
    leaves where that is less (a turn's next requests add the tool calls and results);
    at least 256 and at most 32,000 (what Claude Code and opencode ask for by default).
    opencode at 8,192 tokens asked for 2,048 beside its 7.8 thousand, was refused and
    compacted in a loop; at 256 its first turn's requests (7,779 and 7,842 tokens) fit."""
    return min(32_000, max(256, min(context // 4, (context - prompt) // 2)))


CLAUDE_MIN_WINDOW = 100_000
"""The smallest ``CLAUDE_CODE_AUTO_COMPACT_WINDOW`` Claude Code 2.1.332 takes (a smaller one
reads as this): a model of a longer context is given it, so Claude Code compacts before
the model's context is full."""
AGENT_CONTEXT = 32768
"""The context an agent needs: its own system prompt and tools (:data:`AGENT_PROMPTS`),
then the conversation and the answer."""


def _context_note(t: _Target) -> tuple[str, ...]:
    """An agent's note where the context is short of :data:`AGENT_CONTEXT`: whether its own
    first prompt fits beside the output it is told to ask for."""
    if t.context >= AGENT_CONTEXT:
        return ()
    prompt = AGENT_PROMPTS[t.client]
    fits = "fits" if prompt + t.out <= t.context else "does not fit"
    return (
        f"this model's context is {t.context} tokens; the agent's own prompt and tools take about "
        f"{prompt:,} ({fits} with {t.out} output tokens): place it with --context {AGENT_CONTEXT} or more "
        "where its trained context allows",
    )


def connection(client: str, base_url: str, model: str, context: int, api_key: str | None = None) -> Connection:
    """The settings of ``client`` for ``model`` (served with ``context`` tokens) at the node
    ``base_url`` (``http://host:port``, no path).

    Raises:
        ValueError: a client not in :data:`CLIENTS`.
    """
    settings = _SETTINGS.get(client)
    if settings is None:
        raise ValueError(f"unknown client {client!r}: one of {', '.join(CLIENTS)}")
    return settings(_Target(client, base_url, model, context, api_key or NO_KEY))


@dataclass(frozen=True)
class _Target:
    """What a client's settings name: the client, the node (``base_url``), the model, its
    context (tokens) and the API key."""

    client: str
    base_url: str
    model: str
    context: int
    key: str

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def out(self) -> int:
        """The output tokens a client is told to ask for at most (:func:`output_tokens`)."""
        return output_tokens(self.context, AGENT_PROMPTS.get(self.client, 0))


def _claude(t: _Target) -> Connection:
    """Claude Code: Anthropic's API, by its environment."""
    # its compaction window, where it takes the model's (100,000 tokens at the least)
    window = {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(t.context)} if t.context >= CLAUDE_MIN_WINDOW else {}
    return Connection(
        t.client,
        env={
            "ANTHROPIC_BASE_URL": t.base_url,
            "ANTHROPIC_AUTH_TOKEN": t.key,
            "ANTHROPIC_MODEL": t.model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": t.model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": t.model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": t.model,
            "CLAUDE_CODE_SUBAGENT_MODEL": t.model,
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(t.out),
            **window,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        },
        command=("claude",),
        notes=_context_note(t)
        + (
            "Claude Code takes a model it does not know for a 1,000,000-token one and compacts by that "
            "(CLAUDE_CODE_AUTO_COMPACT_WINDOW takes no less than 100,000); a conversation past the model's "
            "context gets Anthropic's 'prompt is too long', which it shows: /compact shortens the conversation",
        ),
    )


def _codex(t: _Target) -> Connection:
    """Codex: the Responses API, a provider in its config.toml."""
    provider = [
        f'model = "{t.model}"',
        'model_provider = "shardline"',
        f"model_context_window = {t.context}",
        "",
        "[model_providers.shardline]",
        'name = "shardline"',
        f'base_url = "{t.v1}"',
        'wire_api = "responses"',
        'env_key = "SHARDLINE_API_KEY"',
    ]
    return Connection(
        t.client,
        env={"SHARDLINE_API_KEY": t.key},
        files={"~/.codex/config.toml": "\n".join(provider)},
        command=("codex",),
        notes=_context_note(t)
        + (
            "hosted tools (web_search) are not run by shardline: they are left out of the "
            "model's tools and named in the X-Shardline-Tools-Not-Offered header",
        ),
    )


def _opencode(t: _Target) -> Connection:
    """opencode: an OpenAI-compatible provider in opencode.json."""
    config = {
        "$schema": "https://opencode.ai/config.json",
        "model": f"shardline/{t.model}",
        "provider": {
            "shardline": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "shardline",
                "options": {"baseURL": t.v1, "apiKey": t.key},
                "models": {
                    t.model: {"name": t.model, "tool_call": True, "limit": {"context": t.context, "output": t.out}}
                },
            }
        },
    }
    return Connection(
        t.client,
        files={"opencode.json": json.dumps(config, indent=2)},
        command=("opencode",),
        notes=_context_note(t)
        + ("opencode.json goes in the project's folder (or ~/.config/opencode/opencode.json for every project)",),
    )


def _aider(t: _Target) -> Connection:
    """aider: OpenAI's API by its flags, the model's limits in its metadata file."""
    metadata = {
        f"openai/{t.model}": {
            "max_input_tokens": t.context - t.out,
            "max_output_tokens": t.out,
            "max_tokens": t.out,
            "input_cost_per_token": 0.0,
            "output_cost_per_token": 0.0,
            "litellm_provider": "openai",
            "mode": "chat",
        }
    }
    return Connection(
        t.client,
        files={"~/.aider.model.metadata.json": json.dumps(metadata, indent=2)},
        command=("aider", "--model", f"openai/{t.model}", "--openai-api-base", t.v1, "--openai-api-key", t.key),
    )


def _llm(t: _Target) -> Connection:
    """llm: an extra OpenAI model in its YAML file."""
    entry = f'- model_id: {t.model}\n  model_name: {t.model}\n  api_base: "{t.v1}"\n  supports_tools: true\n'
    return Connection(
        t.client,
        files={"~/.config/io.datasette.llm/extra-openai-models.yaml": entry},
        command=("llm", "-m", t.model, "--key", t.key, "hello"),
        notes=(
            'the file lives in llm\'s user directory: `dirname "$(llm logs path)"` prints it '
            "(on macOS ~/Library/Application Support/io.datasette.llm); add to it if it exists",
        ),
    )


_SETTINGS = {"claude": _claude, "codex": _codex, "opencode": _opencode, "aider": _aider, "llm": _llm}
