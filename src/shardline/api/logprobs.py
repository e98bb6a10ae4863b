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

from dataclasses import dataclass, replace


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
    """A token's log-probability and the most likely tokens at its position (most likely
    first; empty when the request asked for none).

    ``offset`` is the character at which the token's text starts in the text it belongs
    to (the generated text, or the echoed prompt); the tokens that together spell a
    character split across them all start where the first of them starts."""

    token: str
    logprob: float
    bytes: list[int]
    top: tuple[TopLogprob, ...] = ()
    offset: int = 0


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
    return {
        "token": t.token,
        "logprob": t.logprob,
        "bytes": t.bytes,
        "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": a.bytes} for a in t.top],
    }


class HeldLogprobs:
    """Generated tokens' log-probabilities, each held until the text it spelled is sent.

    Text reaches a client later than its tokens are sampled: the detokenizer holds back
    part of a character split across tokens, and a stop string's possible beginning is
    held until it is known not to be one (:class:`~shardline.api.text_stream.StopMatcher`).
    A token's log-probability goes out with the text it spelled, and a token that spelled
    any of a stop string never goes: so the tokens sent spell the text sent, but where a
    token spelled both the answer's last characters and the stop string's first (the
    stop string ``"Paris"`` in the token ``" Paris"``), which only a shorter text would
    have.

    Example: tokens spelling ``"Hi"``, ``"\\n"`` under the stop string ``"\\n"``:
    ``push(a, 2)``, ``send(2, False)`` gives ``a``; ``push(b, 1)``, ``send(0, True)``
    gives nothing: ``b`` spelled only the stop string.
    """

    def __init__(self) -> None:
        self._held: list[tuple[TokenLogprob, int]] = []  # (entry with its offset, its text's end)
        self._pushed = 0  # characters the detokenizer has given
        self._sent = 0  # characters sent

    def push(self, entry: TokenLogprob | None, chars: int) -> None:
        """A token sampled: its log-probability (None: the request asked for none) and the
        characters of text the detokenizer gave for it (0 while a character is split)."""
        if entry is not None:
            self._held.append((replace(entry, offset=self._pushed), self._pushed + chars))
        self._pushed += chars

    def send(self, chars: int, stopped: bool) -> tuple[TokenLogprob, ...]:
        """The entries to send with ``chars`` more characters of text: those whose text
        has all been sent (a token without text of its own goes with the next token's).
        ``stopped``: that text ends before a stop string, and the output with it: the
        rest are dropped."""
        self._sent += chars
        done = 0
        for i, (entry, end) in enumerate(self._held):
            if end > self._sent:
                break
            if end > entry.offset:
                done = i + 1
        out, self._held = self._held[:done], ([] if stopped else self._held[done:])
        return tuple(entry for entry, _ in out)

    def flush(self) -> tuple[TokenLogprob, ...]:
        """Every entry still held (the output ended without a stop string)."""
        out, self._held = self._held, []
        return tuple(entry for entry, _ in out)


def legacy_token(raw: list[int]) -> str:
    """A token as the legacy Completions name it, from its UTF-8 bytes: its text, or for a
    token that is part of a character split across tokens (not whole UTF-8), ``bytes:``
    and its text with each stray byte as a ``\\xNN`` escape. The legacy API has no
    ``bytes`` field, and its ``top_logprobs`` are keyed by token: so two such tokens keep
    two keys (as U+FFFD each, they would overwrite one another).

    >>> legacy_token([0xE6, 0x97])
    'bytes:\\\\xe6\\\\x97'
    """
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + bytes(raw).decode("utf-8", errors="backslashreplace")


def completion_logprobs(tokens: list[TokenLogprob], start: int) -> dict:
    """The legacy Completions' ``logprobs`` object for tokens of text that starts at
    character ``start`` of the choice's text: ``tokens`` (:func:`legacy_token`),
    ``token_logprobs``, ``top_logprobs`` (a ``{token: logprob}`` dict per position) and
    ``text_offset`` (``start`` plus each token's :attr:`TokenLogprob.offset`)."""
    return {
        "tokens": [legacy_token(t.bytes) for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{legacy_token(a.bytes): a.logprob for a in t.top} for t in tokens],
        "text_offset": [start + t.offset for t in tokens],
    }


def echoed_completion_logprobs(
    first: str, prompt: list[TokenLogprob], generated: list[TokenLogprob], echo_length: int
) -> dict:
    """The legacy Completions' ``logprobs`` object of a choice that echoes its prompt:
    the prompt's first token (its text ``first``, with no log-probability: nothing comes
    before it, so ``null`` as OpenAI writes it), each later prompt token's (offsets in the
    echoed text), then the generated tokens' from character ``echo_length`` (the echoed
    text's length)."""
    head = completion_logprobs(prompt, 0)
    tail = completion_logprobs(generated, echo_length)
    return {
        "tokens": [first, *head["tokens"], *tail["tokens"]],
        "token_logprobs": [None, *head["token_logprobs"], *tail["token_logprobs"]],
        "top_logprobs": [None, *head["top_logprobs"], *tail["top_logprobs"]],
        "text_offset": [0, *head["text_offset"], *tail["text_offset"]],
    }


def ollama_logprobs(tokens: list[TokenLogprob]) -> list[dict]:
    """Ollama's ``logprobs``: ``[{token, logprob, bytes, top_logprobs: [...]}]``."""
    return [logprob_entry(t) for t in tokens]
