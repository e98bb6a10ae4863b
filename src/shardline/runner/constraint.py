"""Constrained decoding on the sampling rank: one llguidance matcher per sequence.

A task whose ``sampling.grammar`` is set (the JSON text of an llguidance
``TopLevelGrammar``, made by :mod:`shardline.api.structured`) gets a :class:`Constraint`
on the sampling rank. Before each token its matcher's token mask is applied to that
sequence's logits row alone (forbidden tokens get -inf; the other rows of the batch are
not touched); after the token is chosen the matcher consumes it.

End of output: where the grammar allows the end (llguidance's EOS bit: the grammar may
stop here) the task's ``stop_token_ids`` are allowed instead, so that every rank, which
knows only the token ids, ends the sequence with finish "stop"; once the grammar is
finished nothing but those tokens is allowed. A task without stop tokens keeps
llguidance's EOS token (it then runs to ``max_tokens``).

Failures do not take the runner down: a grammar that does not compile, a tokenizer that
cannot be built, or a matcher that reaches an error state is logged and the sequence is
ended by allowing only its stop tokens (finish "stop"; the API validates grammars before
sending them, so this is a backstop). With no stop tokens the sequence then runs
unconstrained.

The llguidance tokenizer is built from the model's own tokenizer
(:class:`shardline.models.tokenizer.Tokenizer`, then ``llguidance.hf.from_tokenizer``) on
the first constrained task only, and kept (about 1.5 s for SmolLM2's 49,152 tokens from
its tokenizer files: :func:`tokenizer_source`). That first task's token waits for it, and
so does the rest of the batch (the engine is one loop).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


class GrammarTokenizer:
    """The llguidance tokenizer of the model at ``model_path`` (a ``.gguf`` file or a Hugging
    Face directory with tokenizer files), built at the first call and cached, the failure
    too (it is not retried).

    Calling it returns the ``llguidance.LLTokenizer``; raises RuntimeError naming the cause
    when it cannot be built (no tokenizer files, not a fast tokenizer)."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._error: str | None = None

    def __call__(self) -> Any:
        with self._lock:
            if self._tokenizer is None and self._error is None:
                try:
                    self._tokenizer = self._build()
                except Exception as exc:  # noqa: BLE001 - any failure: no constrained decoding
                    self._error = f"{type(exc).__name__}: {exc}"
            if self._error is not None:
                raise RuntimeError(f"no grammar tokenizer for {self.model_path}: {self._error}")
            return self._tokenizer

    def _build(self) -> Any:
        import llguidance.hf

        from shardline.models.tokenizer import Tokenizer

        source = tokenizer_source(Path(self.model_path))
        log.info("building the grammar tokenizer from %s", source)
        tokenizer = Tokenizer(source)
        return llguidance.hf.from_tokenizer(tokenizer._tok, eos_token=tokenizer.eos_token_ids)


def tokenizer_source(model_path: Path) -> Path:
    """Where to read a model's tokenizer from: for a ``.gguf`` file, the Hugging Face
    tokenizer files saved for it where they exist (the model store's ``tokenizer/`` beside
    it, or the machine cache's copy it makes of the embedded default's), since rebuilding
    a tokenizer from GGUF metadata takes seconds to tens of seconds (SmolLM2: about 1 s
    from the files, 5-20 s from the GGUF); else ``model_path`` itself."""
    from shardline.machine_cache import cache_path
    from shardline.models.store import GGUF_TOKENIZER_DIR

    if not model_path.is_file():
        return model_path
    candidates = [model_path.parent / GGUF_TOKENIZER_DIR]
    try:
        candidates.append(cache_path("tokenizers", model_path))
    except OSError:
        pass
    for candidate in candidates:
        if (candidate / "tokenizer.json").is_file():
            return candidate
    return model_path


def allowed_bits(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """The uint8 ``[vocab]`` (1: allowed, 0: not) of a bitmask: llguidance's int32 words,
    token ``i`` in bit ``i % 32`` of word ``i // 32`` (little-endian); tokens past the
    mask's end are not allowed."""
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")
    if bits.shape[0] >= vocab:
        return bits[:vocab]
    return np.concatenate([bits, np.zeros(vocab - bits.shape[0], dtype=np.uint8)])


def mask_logits(logits: torch.Tensor, bits: np.ndarray) -> None:
    """Add -inf to the logits ``[vocab]`` where ``bits`` (uint8 ``[vocab]``) is 0 and 0.0
    where it is 1, in place. Arithmetic rather than a boolean ``masked_fill``: (bit - 1)
    times 1e38 twice overflows to -inf or stays 0, with no branch per token (3-10x faster
    on a CPU, the mask being scattered over the vocabulary)."""
    add = torch.from_numpy(bits).to(torch.float32).sub_(1).mul_(1e38).mul_(1e38)
    logits.add_(add)


class Constraint:
    """One sequence's grammar on the sampling rank (see the module docstring).

    Use :meth:`start`, which never raises: a failure gives a constraint that ends the
    sequence.

    Attributes:
        failed: why the constraint ends the sequence at once (None while it works).
    """

    def __init__(
        self,
        matcher: Any,
        eos_tokens: tuple[int, ...],
        stop_token_ids: tuple[int, ...],
        vocab: int = 0,
        failed: str | None = None,
    ) -> None:
        self.matcher = matcher
        self.eos_tokens = eos_tokens
        self.stop_token_ids = stop_token_ids
        self.failed = failed
        self._mask = np.zeros((vocab + 31) // 32, dtype=np.int32)  # llguidance's bitmask

    @classmethod
    def start(cls, grammar: str, tokenizer: Any, stop_token_ids: tuple[int, ...], task_id: int = 0) -> "Constraint":
        """A constraint for ``grammar`` (llguidance ``TopLevelGrammar`` JSON text), with
        ``tokenizer`` a callable returning the llguidance tokenizer (it may raise)."""
        try:
            import llguidance

            llt = tokenizer()
            matcher = llguidance.LLMatcher(llt, grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(matcher.get_error())
        except Exception as exc:  # noqa: BLE001 - never fails the runner (module docstring)
            log.error("task %d: grammar refused, ending the sequence: %s", task_id, exc)
            return cls(None, (), stop_token_ids, failed=str(exc))
        return cls(matcher, tuple(int(t) for t in llt.eos_tokens), stop_token_ids, vocab=int(llt.vocab_size))

    def bits(self, vocab: int) -> np.ndarray:
        """The uint8 ``[vocab]`` of tokens allowed next (1) and not (0)."""
        if self.failed is None and self.matcher.is_error():
            self.failed = self.matcher.get_error()
            log.error("grammar matcher failed, ending the sequence: %s", self.failed)
        if self.failed is not None:
            return self._only_stop(vocab)
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        bits = allowed_bits(self._mask, vocab).copy()
        if self.stop_token_ids:
            ends = [t for t in self.eos_tokens if t < vocab]
            may_end = bool(bits[ends].any()) if ends else False
            bits[ends] = 0
            if may_end:
                bits[[t for t in self.stop_token_ids if 0 <= t < vocab]] = 1
        if not bits.any():
            self.failed = "the grammar allows no token"
            log.error("grammar allows no token, ending the sequence")
            return self._only_stop(vocab)
        return bits

    def allowed(self, vocab: int) -> torch.Tensor:
        """The bool ``[vocab]`` of tokens allowed next."""
        return torch.from_numpy(self.bits(vocab).astype(bool))

    def _only_stop(self, vocab: int) -> np.ndarray:
        stops = [t for t in self.stop_token_ids if 0 <= t < vocab]
        if not stops:
            return np.ones(vocab, dtype=np.uint8)  # nothing ends it: unconstrained
        bits = np.zeros(vocab, dtype=np.uint8)
        bits[stops] = 1
        return bits

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits ``[vocab]`` of tokens the grammar forbids to -inf, in place."""
        mask_logits(logits, self.bits(logits.shape[-1]))

    def consume(self, token: int) -> None:
        """Advance the matcher past ``token`` (a stop token ends the sequence instead)."""
        if self.failed is not None or token in self.stop_token_ids:
            return
        if not self.matcher.consume_token(token):
            log.error("grammar rejected token %d: %s", token, self.matcher.get_error())

    @property
    def finished(self) -> bool:
        """The grammar is complete: only the stop tokens are allowed now."""
        return self.failed is None and self.matcher.is_stopped()
