"""A lower bound on a prompt's tokens from its characters, so that a prompt which cannot
fit the context is refused before it is tokenized (tokenizing tens of megabytes of text
held a node at gigabytes for minutes).

The bound: a token stands for at most ``max_token_chars`` characters of text, the longest
token string in the tokenizer's vocabulary (added and special tokens included). In a
byte-level BPE vocabulary (GPT-2, Llama 3, Qwen, SmolLM2) each vocabulary character stands
for one byte, and a text character is at least one byte; in a SentencePiece vocabulary
(Llama 2, Mistral) ``▁`` stands for one space and byte-fallback tokens such as ``<0xE3>``
for one byte. A normalizer may compose code points into fewer (Unicode NFC/NFKC: at most
three into one, Hangul jamo), hence the factor :data:`SAFETY`. Tokenizers that drop
whitespace altogether (WordPiece) would break the bound; generation models do not use them.
"""

from __future__ import annotations

from typing import Any

SAFETY = 4  # text characters per vocabulary character at most, after normalization, with margin


def prompt_chars(prompt: str | list[dict[str, Any]]) -> int:
    """Characters of a text prompt, or of the chat messages' text that every chat template
    renders: the contents of system, user and tool messages (an assistant's earlier turns
    may be shortened by a template, e.g. without their reasoning)."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(m["content"]) for m in prompt if m.get("role") != "assistant" and isinstance(m.get("content"), str))


def min_prompt_tokens(prompt: str | list[dict[str, Any]], max_token_chars: int) -> int:
    """Tokens the prompt takes at least: its characters (:func:`prompt_chars`) over what
    one token can stand for (``max_token_chars`` x :data:`SAFETY`), rounded up; for chat
    messages also one per message, of any role and empty or not (each has its own turn,
    whose markup no token shares with another turn's: a million empty messages took 42 s
    to render and tokenize before this counted them).

    Raises:
        ValueError: ``max_token_chars`` below 1.
    """
    if max_token_chars < 1:
        raise ValueError(f"max_token_chars must be at least 1, not {max_token_chars}")
    by_chars = -(-prompt_chars(prompt) // (max_token_chars * SAFETY))
    if isinstance(prompt, str):
        return by_chars
    return max(by_chars, len(prompt))


def droppable(messages: list[dict[str, Any]]) -> int:
    """How many of a chat's messages :func:`without_oldest` may drop: all but the system
    messages and the last one."""
    return sum(m.get("role") != "system" for m in messages[:-1])


def without_oldest(messages: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """A chat shortened to fit a context as Ollama's ``/api/chat`` does (its
    ``server/prompt.go`` ``chatPrompt``: a chat past the context loses its oldest
    messages, never the system messages nor the last message): ``messages`` without its
    first ``count`` messages that are neither (at most :func:`droppable`)."""
    out, left = [], count
    for i, m in enumerate(messages):
        if left > 0 and i < len(messages) - 1 and m.get("role") != "system":
            left -= 1
            continue
        out.append(m)
    return out
