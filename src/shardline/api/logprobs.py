"""Token log-probabilities as the APIs report them.

The runner sends each token's log-probability and its top alternatives as token ids
(:class:`~shardline.runner.protocol.TokenEvent`); here they become token strings and UTF-8
bytes, and the objects of OpenAI's Chat Completions (``logprobs.content``), legacy
Completions (``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``) and
Ollama's ``logprobs``.

A token's bytes come from its vocabulary piece: byte-level BPE vocabularies (GPT-2's,
used by Llama 3, Qwen2 and SmolLM2) spell each byte as one printable character (Radford et
al., "Language Models are Unsupervised Multitask Learners", 2019, and GPT-2's
``encoder.py``); SentencePiece vocabularies spell a space as U+2581 and an unprintable
byte as ``<0xNN>``.
"""

from __future__ import annotations

from dataclasses import dataclass


def _byte_level_alphabet() -> dict[str, int]:
    """The character byte-level BPE writes for each byte value 0-255: printable Latin-1
    characters stand for themselves, every other byte for ``chr(256 + n)``, n counting
    those bytes in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            alphabet[chr(256 + extra)] = b
            extra += 1
    return alphabet


_BYTE_OF = _byte_level_alphabet()


def piece_bytes(piece: str) -> bytes:
    """The UTF-8 bytes a vocabulary piece stands for (see the module docstring).

    >>> piece_bytes("ĠParis")
    b' Paris'
    >>> piece_bytes("<0xE2>")
    b'\\xe2'
    """
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    if piece and all(ch in _BYTE_OF for ch in piece):
        return bytes(_BYTE_OF[ch] for ch in piece)
    return piece.replace("\u2581", " ").encode("utf-8")


@dataclass(frozen=True)
class TopLogprob:
    """One alternative at a position: its text, log-probability (natural log) and bytes."""

    token: str
    logprob: float
    bytes: list[int]


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely tokens at its position
    (most likely first; empty when the request asked for none)."""

    token: str
    logprob: float
    bytes: list[int]
    top: tuple[TopLogprob, ...] = ()


def token_logprob(piece_of, token_id: int, logprob: float, top: tuple[tuple[int, float], ...]) -> TokenLogprob:
    """A :class:`TokenLogprob` from token ids; ``piece_of(id)`` gives a token's vocabulary
    piece. Text is the bytes decoded as UTF-8 (a piece holding part of a character shows
    U+FFFD; ``bytes`` is exact)."""

    def entry(tid: int) -> tuple[str, list[int]]:
        raw = piece_bytes(piece_of(tid))
        return raw.decode("utf-8", errors="replace"), list(raw)

    alternatives = []
    for tid, alt_logprob in top:
        alt_text, alt_raw = entry(tid)
        alternatives.append(TopLogprob(alt_text, alt_logprob, alt_raw))
    text, raw = entry(token_id)
    return TokenLogprob(text, logprob, raw, tuple(alternatives))


def chat_logprobs(tokens: list[TokenLogprob]) -> dict:
    """OpenAI Chat Completions' ``logprobs`` object: ``{"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}], "refusal": null}``."""
    return {"content": [logprob_entry(t) for t in tokens], "refusal": None}


def logprob_entry(t: TokenLogprob) -> dict:
    """One token's entry as OpenAI (Chat Completions, Responses) and Ollama write it:
    ``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``."""
    return {"token": t.token, "logprob": t.logprob, "bytes": t.bytes,
            "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": a.bytes} for a in t.top]}


def completion_logprobs(tokens: list[TokenLogprob], offset: int) -> dict:
    """The legacy Completions' ``logprobs`` object for tokens whose text starts at
    character ``offset`` of the choice's text: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (a ``{token: logprob}`` dict per position) and ``text_offset``."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{a.token: a.logprob for a in t.top} for t in tokens], "text_offset": offsets}


def echoed_completion_logprobs(first: str, prompt: list[TokenLogprob], generated: list[TokenLogprob],
                               echo_length: int) -> dict:
    """The legacy Completions' ``logprobs`` object of a choice that echoes its prompt:
    the prompt's first token (its text ``first``, with no log-probability: nothing comes
    before it, so ``null`` as OpenAI writes it), each later prompt token's, then the
    generated tokens' from character ``echo_length`` (the echoed text's length)."""
    head = completion_logprobs(prompt, len(first))
    tail = completion_logprobs(generated, echo_length)
    return {"tokens": [first, *head["tokens"], *tail["tokens"]],
            "token_logprobs": [None, *head["token_logprobs"], *tail["token_logprobs"]],
            "top_logprobs": [None, *head["top_logprobs"], *tail["top_logprobs"]],
            "text_offset": [0, *head["text_offset"], *tail["text_offset"]]}


def ollama_logprobs(tokens: list[TokenLogprob]) -> list[dict]:
    """Ollama's ``logprobs``: ``[{token, logprob, bytes, top_logprobs: [...]}]``."""
    return [logprob_entry(t) for t in tokens]
