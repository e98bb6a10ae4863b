"""Tokenizer and chat template from the model's own files, through ``transformers``.

For a GGUF file the tokenizer is rebuilt from the file's ``tokenizer.ggml.*`` metadata by
transformers' GGUF converter; for a Hugging Face directory it is read from
``tokenizer.json`` / ``tokenizer_config.json``. The chat template is the model's own
(Jinja, rendered by transformers).

The node process runs without torch (``shardline run`` makes ``import torch`` fail
there, so transformers, which would import it, takes its torch-free path: 1.6 s to load
a tokenizer instead of 3.8 s, and ~200 MB less in the node). transformers' GGUF converter
needs torch, so :func:`save_tokenizer_files` converts in a child process
(``python -m shardline.models.tokenizer GGUF DIRECTORY``).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from shardline.models.tool_prompt import template_reads_tools, with_dict_arguments, with_tools_in_text

THINK_OPEN = "<think>"
"""What a reasoning model writes before its thinking (``</think>`` after it)."""


def template_reasons(template: str | None) -> bool:
    """Whether the model of chat template ``template`` reasons before it answers: the
    template writes :data:`THINK_OPEN` (Qwen3, QwQ, DeepSeek-R1 distills) or harmony
    messages (gpt-oss: :func:`template_is_harmony`)."""
    return THINK_OPEN in (template or "") or template_is_harmony(template)


def template_is_harmony(template: str | None) -> bool:
    """Whether chat template ``template`` writes OpenAI's harmony messages (gpt-oss's:
    ``<|channel|>`` and ``<|message|>``; :mod:`shardline.api.harmony` reads them)."""
    return "<|channel|>" in (template or "") and "<|message|>" in (template or "")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template."""


class Tokenizer:
    """Encode, decode and render chats for one model.

    Args:
        path: a ``.gguf`` file, or a directory with the tokenizer files of a Hugging Face
            model (or of one saved by :meth:`save`).
    """

    def __init__(self, path: str | Path) -> None:
        import transformers
        from transformers import AutoTokenizer

        transformers.logging.set_verbosity_error()
        path = Path(path)
        if path.is_file():
            self._tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            self._tok = AutoTokenizer.from_pretrained(str(path))
        self.eos_token_ids: list[int] = sorted(self._end_token_ids(path))

    def _end_token_ids(self, path: Path) -> set[int]:
        ids = set()
        if self._tok.eos_token_id is not None:
            ids.add(int(self._tok.eos_token_id))
        generation_config = path / "generation_config.json" if path.is_dir() else None
        if generation_config is not None and generation_config.is_file():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos)
        # Chat models end a turn with these even where the declared EOS is another token
        # (gpt-oss: <|return|> after its answer, <|call|> after a tool call; its <|end|>
        # ends a message, not the output, as llama.cpp treats it).
        for token in ("<|im_end|>", "<|eot_id|>", "<|return|>", "<|call|>"):
            token_id = self._tok.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != self._tok.unk_token_id:
                ids.add(token_id)
        return ids

    def save(self, directory: str | Path) -> None:
        """Write the tokenizer and chat template as Hugging Face tokenizer files, so a
        node can tokenize a GGUF model's prompts without the weights."""
        self._tok.save_pretrained(str(directory))
        eos = Path(directory) / "generation_config.json"
        eos.write_text(json.dumps({"eos_token_id": self.eos_token_ids}))

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def tokens(self) -> list[str]:
        """Every id's vocabulary piece, in id order (added tokens included)."""
        return [str(t) for t in self._tok.convert_ids_to_tokens(list(range(len(self._tok))))]

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest token string in the vocabulary, added and special
        tokens included (in a byte-level vocabulary a character stands for one byte)."""
        return max((len(token) for token in self._tok.get_vocab()), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (the model's BOS is added when it asks for one).

        Special-token text in ``text`` (e.g. ``<|im_end|>``) becomes that special token: a
        raw prompt is its writer's own template (OpenAI Completions, Ollama ``raw``). Chat
        messages go through :meth:`encode_chat` instead, which keeps them text.
        """
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def piece(self, token_id: int) -> str:
        """The vocabulary piece of one token id (e.g. ``ĠParis``; see
        :func:`shardline.api.logprobs.piece_bytes` for its bytes)."""
        return str(self._tok.convert_ids_to_tokens(token_id))

    def decode(self, ids: list[int], skip_special_tokens: bool = True, keep: Collection[int] = ()) -> str:
        """The text of ``ids``; special tokens are left out with ``skip_special_tokens``,
        except those in ``keep`` (a tool-call marker that is a special token, e.g. Mistral's
        ``[TOOL_CALLS]``, written out for the call parser)."""
        if skip_special_tokens and keep:
            special = self._special_ids
            ids = [i for i in ids if i in keep or i not in special]
            skip_special_tokens = False
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        """The ids of the added tokens marked special (those decoding skips)."""
        return frozenset(i for i, token in self._tok.added_tokens_decoder.items() if token.special)

    def added_token_id(self, text: str) -> int | None:
        """The id of the added token (special or not) whose text is ``text``; None where
        ``text`` is no added token (it is then ordinary vocabulary text)."""
        return self._added.get(text)

    @functools.cached_property
    def _added(self) -> dict[str, int]:
        return {str(token): int(i) for token, i in self._tok.get_added_vocab().items()}

    @property
    def chat_template(self) -> str | None:
        """The chat template's Jinja text that a chat with tools is rendered with (of a model
        with several named templates, its ``tool_use`` one, else its ``default``), or None
        for a model without one."""
        template = self._tok.chat_template
        if isinstance(template, dict):
            template = template.get("tool_use") or template.get("default")
        return template if isinstance(template, str) else None

    @functools.cached_property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` argument (it reads the variable)."""
        return template_reads_tools(self.chat_template)

    @functools.cached_property
    def reasons(self) -> bool:
        """Whether the model reasons before it answers (:func:`template_reasons`; its
        output is split by :class:`~shardline.api.reasoning.ReasoningSplitter`)."""
        return template_reasons(self.chat_template)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        thinking: bool | None = None,
        effort: str | None = None,
    ) -> str:
        """The prompt text for ``messages`` with the assistant's turn opened, or with the
        final (assistant) message left open to be continued (``continue_final_message``:
        Anthropic's prefill; transformers' option of that name).

        ``thinking``: whether a reasoning model thinks before its answer, given to the
        template as ``enable_thinking`` (what Qwen3's reads; a template that does not read
        it renders the same); None: not given (the template's default). ``effort``: the
        reasoning effort asked (OpenAI's levels, "none" to "max"), given as
        ``reasoning_effort`` in the levels gpt-oss's template writes into its system
        message (:func:`reasoning_level`); None: not given (gpt-oss's default, medium).

        ``tools`` are OpenAI function tools. A template that takes tools renders them (and
        the history's calls and results) itself; for one that does not, they are listed in
        a Hermes-style system message and the history's calls and results written as
        ``<tool_call>`` / ``<tool_response>`` text (see :func:`with_tools_in_text`), so the
        model answers in :attr:`~shardline.api.tools.ToolFormat.HERMES`. Assistant call
        ``arguments`` given as JSON text are passed to the template as dicts.

        Raises:
            ChatTemplateError: the template rejects the messages (e.g. roles out of order),
                or there is no final message to continue.
        """
        messages, tools = self._chat_inputs(messages, tools)
        try:
            return str(
                self._tok.apply_chat_template(
                    messages,
                    tools=tools,
                    add_generation_prompt=not continue_final_message,
                    continue_final_message=continue_final_message,
                    tokenize=False,
                    **_thinking_kwargs(thinking, effort),
                )
            )
        except Exception as exc:  # jinja2's TemplateError and template-raised exceptions
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def unrendered_names(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        thinking: bool | None = None,
        effort: str | None = None,
    ) -> list[int]:
        """Indices of the messages other than tool results whose ``name`` (a participant's)
        the chat template leaves out: the prompt :meth:`render_chat` gives is the same
        without it (most templates render no participant names; a request's name would be
        accepted and do nothing). The first named message of each role is tried (a
        template renders a role's names all or none; a render a role, not one per message
        of a long chat). A tool result's name ties it to its call
        (:func:`~shardline.api.tools.check_history` checks it) and is not listed.

        Raises:
            ChatTemplateError: as :meth:`render_chat`.
        """
        first: dict[str, int] = {}
        for i, m in enumerate(messages):
            if m.get("name") is not None and m.get("role") != "tool":
                first.setdefault(str(m.get("role")), i)
        named = sorted(first.values())
        if not named:
            return []
        full = self.render_chat(messages, tools, continue_final_message, thinking, effort)
        unrendered = []
        for i in named:
            without = [{k: v for k, v in m.items() if k != "name"} if j == i else m for j, m in enumerate(messages)]
            if self.render_chat(without, tools, continue_final_message, thinking, effort) == full:
                unrendered.append(i)
        return unrendered

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        thinking: bool | None = None,
        effort: str | None = None,
    ) -> list[int]:
        """Token ids of :meth:`render_chat`'s prompt (same arguments), where only the
        template's own markup makes control tokens.

        A control token's text inside a message or tool (any role, e.g. a user's literal
        ``<|im_end|>`` and ``<|im_start|>assistant`` forging a turn) is encoded as the ids
        that text has with added-token matching off (``<`` ``|`` ``im`` ``_`` ...), never as the token itself,
        so message text cannot open or close turns. Control tokens are the tokenizer's
        special tokens plus the added tokens the template's text contains. This is
        transformers' ``apply_chat_template(..., sanitize_control_tokens=True)``: it marks
        those tokens in the messages before rendering and encodes each marked token as
        text, and the rest of the prompt (message text included) as before, so a chat
        without such text gets exactly ``encode(render_chat(messages),
        add_special_tokens=False)`` (except that the two private-use characters it marks
        with, U+F0000 and U+F0001, are dropped from message text). It works whatever the
        template does with the text. It does not switch the shared (Rust) tokenizer's
        special-token mode (transformers encodes the marked text through the backend's
        normalizer, pre-tokenizer and model directly), so calls from several threads at
        once are safe.

        Raises:
            ChatTemplateError: the template rejects the messages (e.g. roles out of order),
                there is no final message to continue, or a control token's text cannot be
                encoded other than as the token.
        """
        messages, tools = self._chat_inputs(messages, tools)
        try:
            ids = self._tok.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=not continue_final_message,
                continue_final_message=continue_final_message,
                tokenize=True,
                return_dict=False,
                sanitize_control_tokens=True,
                **_thinking_kwargs(thinking, effort),
            )
        except Exception as exc:  # jinja2's errors, template-raised ones, "Can't sanitize ..."
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        return [int(i) for i in ids]

    def _chat_inputs(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools to give the template (a chat without tools unchanged)."""
        tools = tools or None
        has_calls = any(m.get("tool_calls") for m in messages)
        if tools is None and not has_calls:
            return messages, None
        if self.supports_tools:
            return [with_dict_arguments(m) for m in messages], tools
        return with_tools_in_text(messages, tools), None


REASONING_LEVELS = {
    "none": "low",
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}
"""OpenAI's reasoning efforts (Chat Completions' ``reasoning_effort``, Responses'
``reasoning.effort``, Anthropic's ``output_config.effort``; Ollama's ``think`` levels are
low to max) as the levels
gpt-oss's chat template writes (``Reasoning: low|medium|high``, harmony's three): a
model that cannot reason less than low spends its least on "none" and "minimal", and its
most on the levels above high."""


VOCAB_SIZE_SLACK = 128
"""Most ids a draft model's vocabulary may differ from its target's by (llama.cpp's
``SPEC_VOCAB_MAX_SIZE_DIFFERENCE``: a family's models pad their vocabularies apart)."""


def draft_mismatch(target: Tokenizer, draft: Tokenizer) -> str | None:
    """Why ``draft``'s token ids do not stand for the same text as ``target``'s, so a draft
    model of that tokenizer cannot draft for the target; None where they do: vocabulary
    sizes within :data:`VOCAB_SIZE_SLACK`, the same end-of-sequence ids and the same piece
    for every id both have (the checks of llama.cpp's ``common_speculative_are_compatible``,
    which compares the pieces past the first few ids only)."""
    if abs(target.vocab_size - draft.vocab_size) > VOCAB_SIZE_SLACK:
        return f"vocabularies of {target.vocab_size} and {draft.vocab_size} tokens"
    if target.eos_token_ids != draft.eos_token_ids:
        return f"end-of-sequence ids {target.eos_token_ids} and {draft.eos_token_ids}"
    for token_id, (a, b) in enumerate(zip(target.tokens(), draft.tokens())):
        if a != b:
            return f"token {token_id} is {a!r} in one and {b!r} in the other"
    return None


def reasoning_level(effort: str | None) -> str | None:
    """The template's ``reasoning_effort`` for the ``effort`` asked (:data:`REASONING_LEVELS`);
    None for none asked.

    Raises:
        KeyError: an effort not in :data:`REASONING_LEVELS` (the APIs' own checks refuse
            one before it gets here).
    """
    return None if effort is None else REASONING_LEVELS[effort]


def _thinking_kwargs(thinking: bool | None, effort: str | None = None) -> dict[str, bool | str]:
    """The chat template's variables for ``thinking`` and ``effort`` (:meth:`Tokenizer.render_chat`)."""
    kwargs: dict[str, bool | str] = {} if thinking is None else {"enable_thinking": thinking}
    level = reasoning_level(effort)
    if level is not None:
        kwargs["reasoning_effort"] = level
    return kwargs


SAVE_TIMEOUT_S = 300.0
"""The most a child process may take to convert a GGUF file's tokenizer."""


def save_tokenizer_files(gguf_file: Path, directory: Path) -> None:
    """Write the tokenizer and chat template of ``gguf_file`` to ``directory`` as Hugging
    Face tokenizer files (:meth:`Tokenizer.save`), converted in a child process that may
    import torch (see the module's docstring).

    Raises:
        ValueError: the conversion failed (the message ends with the child's last error line).
    """
    try:
        done = subprocess.run(
            [sys.executable, "-m", "shardline.models.tokenizer", str(gguf_file), str(directory)],
            capture_output=True,
            text=True,
            timeout=SAVE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise ValueError(f"reading the tokenizer of {gguf_file} took over {SAVE_TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise ValueError(
            f"cannot read the tokenizer of {gguf_file}: {lines[-1] if lines else f'exit code {done.returncode}'}"
        )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Holds back text while the last tokens decode to an incomplete UTF-8 character (the
    replacement character), and re-decodes only a short window each step, as text
    generation servers do. Special tokens are left out with ``skip_special_tokens``,
    except those in ``keep`` (:meth:`Tokenizer.decode`).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, keep: Collection[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._keep = frozenset(keep)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], self._skip, self._keep)
        full = self._tokenizer.decode(self._ids[self._prefix_offset :], self._skip, self._keep)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """The text held back, the output having ended: the tokens' text since the last
        delta, a character they end inside of read as U+FFFD (as decoding all the ids
        would read it); nothing is held after."""
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], self._skip, self._keep)
        full = self._tokenizer.decode(self._ids[self._prefix_offset :], self._skip, self._keep)
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


def text_starts(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[int]:
    """The character at which each token's text starts in ``ids`` decoded, by
    :class:`IncrementalDetokenizer`: one entry per id. The tokens that together spell a
    character split across them all start where the first of them starts."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    starts, pushed = [], 0
    for token_id in ids:
        starts.append(pushed)
        pushed += len(detokenizer.push(token_id))
    return starts


if __name__ == "__main__":  # python -m shardline.models.tokenizer GGUF DIRECTORY
    import gguf

    from shardline.models.gguf_header import in_memory_fields_reader

    # transformers' converter opens the file with gguf.GGUFReader: this process's own
    # (it exits after the conversion) parses the metadata ~3x faster. Without the RoPE
    # scaling keys, which a tokenizer does not use: transformers 5.24 reads gpt-oss's
    # (every llama.cpp conversion has a YaRN factor) from the field's first part, the
    # key's length, and NumPy 2.4's float() refuses that one-element array, so a gpt-oss
    # GGUF could not be added ("only 0-dimensional arrays can be converted").
    gguf.GGUFReader = in_memory_fields_reader(leave_out=(".rope.scaling.",))
    Tokenizer(sys.argv[1]).save(sys.argv[2])
