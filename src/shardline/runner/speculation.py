"""Speculative decoding's drafts by prompt lookup (n-gram speculation): a sequence guesses
its next tokens as those that followed the latest earlier occurrence of its last few
tokens, in its prompt or its output, and while those guesses are taken, as the tokens
that follow in the text it is copying (:class:`Drafter`). Code edits, quoted documents
and an agent's tool output repeat what the prompt holds, so the guess is often right; a
step then checks the guess in the decode batch (the draft's rows ride along, each at its
own position) and takes the tokens decoding would have given (greedy's, or a sample's
drawn as decoding draws it) up to the first that differs, plus that one (Saxena 2023,
"prompt lookup decoding"; vLLM's ngram proposer and llama.cpp's ``--spec-type ngram``
guess the same way; the index here is shardline's own).

Every rank holds the same tokens, so every rank keeps the same index and drafts the same
tokens with no message of its own.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_DRAFT_TOKENS = 16
"""Most tokens a request may have drafted a step (llama.cpp's ``speculative.n_max``
default is 16 too)."""

DRAFT_MODEL_TOKENS = 3
"""Tokens a request that names no ``speculative.n_max`` has drafted a step by a draft
model (:mod:`shardline.runner.draft_model`; llama.cpp's ``--spec-draft-n-max``
default): each costs a step of the draft model on the step's path, taken or not."""

NGRAM_MAX = 4
"""The longest suffix looked up, tokens."""
NGRAM_MIN = 3
"""The shortest suffix looked up, tokens (shorter ones repeat too often to guess from:
SmolLM2 telling a story drafted on 2-token matches and ran 13% slower)."""

FIRST_DRAFT = 2
"""Tokens a sequence drafts at first and after a draft none of whose tokens it took: a
decode step of 3 rows costs about what one of 1 does (a 1.5B Q4_K_M model on 2 Zen 4
cores: 31, 33, 36 ms for 1, 2, 3 rows; 58 ms for 5), so a wrong guess costs little."""


def default_drafts(moe: bool, draft_model: bool = False) -> int:
    """Tokens a request that names no ``speculative.n_max`` may draft a step on an
    instance of a mixture-of-experts model (``moe``) or a dense one (with a
    ``draft_model``, which drafts instead of prompt lookup:
    :data:`DRAFT_MODEL_TOKENS`):
    :data:`MAX_DRAFT_TOKENS` for a dense model, where it was measured to win (SmolLM2 on
    one node of a 2-vCPU VM, its calibrated 128- and 512-token prompts: decode 168 -> 223
    and 163 -> 351 tokens/s alone, 115 -> 132 and 93 -> 117 four at a time; see
    docs/performance.md), 0 for an MoE, whose drafted rows route to experts the step would
    not otherwise read. A draft costs little where nothing repeats: none is made without an
    earlier match of the last tokens, and a sequence drafts :data:`FIRST_DRAFT` tokens
    until one is taken whole. A function of the model alone, so every rank of an instance
    (whatever its device) drafts alike."""
    if moe:
        return 0
    return DRAFT_MODEL_TOKENS if draft_model else MAX_DRAFT_TOKENS


def accepted(draft: tuple[int, ...], taken: list[int] | tuple[int, ...]) -> int:
    """How many of ``draft``'s tokens a step took: those ``taken`` (the drafted tokens it
    matched, then the one after the last match, or fewer where the sequence finished)
    begins with."""
    n = 0
    while n < min(len(draft), len(taken)) and taken[n] == draft[n]:
        n += 1
    return n


class NgramIndex:
    """Where each n-gram (``NGRAM_MIN`` to ``NGRAM_MAX`` tokens) of a growing token
    sequence last occurred, to look up its last tokens in O(``NGRAM_MAX``) per token.

    ``tokens``: the sequence so far (a prompt, then each token as it is agreed). Tokens
    are indexed when first looked up (:meth:`find`), not as they come: a request's first
    draft follows its first token, so its prompt's index (~0.6 us a token in CPython:
    2 ms for a 3,000-token prompt, 11 for an agent's 18,000, on every rank) is not built
    before its prefill.
    """

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = list(tokens)
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it
        self._indexed = 0  # tokens[:_indexed] have their n-grams ending before them indexed

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` (indexed at the next :meth:`find`)."""
        self.tokens.extend(tokens)

    def _index(self) -> None:
        """Index each n-gram that ends before the last token (the last one's follower is
        not known yet)."""
        tokens, after = self.tokens, self._after
        for end in range(max(self._indexed, 1), len(tokens)):  # the n-grams ending here are followed
            for n in range(NGRAM_MIN, min(NGRAM_MAX, end) + 1):
                after[tuple(tokens[end - n : end])] = end
        self._indexed = len(tokens)

    def find(self) -> int | None:
        """Index of the token that followed the latest earlier occurrence of the longest
        suffix of ``NGRAM_MAX`` down to ``NGRAM_MIN`` tokens found: where a draft is read
        from; None where none occurred before."""
        self._index()
        end = len(self.tokens)
        for n in range(min(NGRAM_MAX, end), NGRAM_MIN - 1, -1):
            start = self._after.get(tuple(self.tokens[end - n :]))
            if start is not None:
                return start
        return None


class Drafter:
    """A speculating sequence's drafts, read from its tokens (:class:`NgramIndex`).

    Where from: while its drafts are taken, at least in part, from where the last one's
    source goes on past the tokens taken (the text it copies, followed token by token);
    once more after a draft whose first token differed (an edit that changed a token, a
    name or a number, and copies on); otherwise from the latest earlier occurrence of
    its last tokens. Followed, a copy keeps its place where its n-grams occur in many
    places (a file's boilerplate).

    How many, up to ``k``: :data:`FIRST_DRAFT` at first and after a draft none of
    whose tokens it took (where the copy may have moved on), as many again after one
    it took in part (a copy that changed a token goes on: a name or a number, then the
    copied text), twice as many after one it took whole.

    A function of the agreed tokens only, so alike on every rank. Replayed over
    SmolLM2's greedy text (512 tokens) with a decode step's cost by its rows as measured
    (a 2-vCPU VM: SmolLM2 at ~1,800 positions, a 1.5B Q4_K_M model), against every draft
    looked up: the bench's three code edits 1.84 -> 2.47x and 1.70 -> 2.15x the speed
    without drafts (geometric means), its looping chat answers and a story 1.68 -> 1.62x
    and 1.57 -> 1.55x. Drafting one more than a draft in part took gave the edits more
    (2.74x, 2.16x) and the chat answers less (1.60x, 1.49x). Replayed again (SmolLM2's
    greedy text of the bench's four code edits, six chat questions, two summaries, a
    story and an explanation; its step costs at 1,800 and 400 positions), a draft taken
    in part followed by one as long rather than :data:`FIRST_DRAFT`: the edits 2.03 ->
    2.32x, the chat answers 1.554 -> 1.551x, the rest 1.35 -> 1.33x; by one more than
    it took, 2.14x, 1.552x, 1.34x.
    """

    def __init__(self, prompt: Iterable[int], k: int) -> None:
        self.ngrams = NgramIndex(prompt)
        self.k = k
        self.length = min(FIRST_DRAFT, k)
        self.follow: int | None = None  # where the followed source goes on
        self.missed = False  # the last draft, followed, was not taken at all

    def _source(self) -> int | None:
        """Index of the token the next draft starts at (None: no draft)."""
        return self.ngrams.find() if self.follow is None else self.follow

    def draft(self, room: int) -> tuple[int, ...]:
        """The next draft, at most ``room`` tokens."""
        start, n = self._source(), min(self.length, room)
        return () if start is None or n < 1 else tuple(self.ngrams.tokens[start : start + n])

    def took(self, drafted: int, tokens: list[int] | tuple[int, ...]) -> int:
        """A step checked a draft of ``drafted`` tokens (:meth:`draft`'s, before this
        call) and the sequence took ``tokens`` (those of the draft it matched, then one
        more, or fewer where it finished); returns how many of the draft it took. Without
        a draft it looks nothing up (a prefill's first token is not held for the index)."""
        start = self._source() if drafted else None
        taken = 0 if start is None else accepted(tuple(self.ngrams.tokens[start : start + drafted]), tokens)
        self.ngrams.extend(tokens)
        followed = self.follow is not None
        self.missed = bool(drafted) and not taken and followed and not self.missed
        self.follow = start + len(tokens) if start is not None and drafted and (taken or self.missed) else None
        if drafted and len(tokens) > drafted:  # taken whole
            self.length = min(self.k, self.length * 2)
        elif drafted and not taken:  # none taken (in part: as long again)
            self.length = min(FIRST_DRAFT, self.k)
        return taken
