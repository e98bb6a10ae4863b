"""Measured speeds of placements that served, and how they correct the preview's model.

The preview predicts tokens/s from the nodes' profiles
(:func:`~shardline.placement.speed.predict_tokens_per_s`); once an instance has served,
its node knows what it really did. A node that streams a request to its client times it
(:func:`request_rates`) and keeps the figures of each placement it served
(:class:`ServedSpeed`, :func:`record`); the coordinator, previewing a model, corrects each
candidate's predicted figures with what the cluster has measured (:func:`calibrate`):

1. the same placement (model, sharding, nodes in rank order, dtype, quantization)
   measured: the measured figure;
2. else placements of the same model, dtype, quantization and sharding measured on
   the same nodes in another rank order: the predicted figure times the median of
   their measured / predicted ratios (the model's error on those machines and links,
   carried over);
3. else the same from one-node placements on the candidate's nodes (the model's error
   on a machine alone, which every placement's compute pays). A placement of several
   nodes carries its ratio to no other node set: its error is mostly its own, in its
   links and collectives (trial 5: a pipeline over a rate-limited link measured 4.6x its
   prediction, and that ratio raised every placement sharing one of its nodes, a
   single node to 380 tokens/s);
4. else the predicted figure.

Decode and prefill are corrected each on its own (a placement may have measured one
and not the other). Everything here is pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

KEEP_SAMPLES = 16
"""Per-request rates a :class:`ServedSpeed` keeps of each kind (the newest); its figure is
their median."""

MIN_DECODE_STEPS = 7
"""Plain decode steps a request needs for its decode rate to count (steps that gave one
token with no draft beside it: 8 generated tokens without speculation, the first being
the prefill's)."""

MIN_PREFILL_TOKENS = 256
"""Prompt tokens a request needs for its prefill rate to count; the time to the first token
also holds a fixed part (the task's agreement round, one engine wake-up, the
first token's sampling and delivery; ~10-30 ms on a 2-core VM), which would understate
the rate of a short prompt against the preview's "one long prompt"."""

MOST_CACHED_SHARE = 1 / 8
"""Most of a prompt that may have come from a cached prefix for its prefill rate to count
(its computed tokens over its time to the first token): every conversation shares its
chat template's header (SmolLM2's system line, 30 tokens), so a new conversation's
prompt resumes there, while a next turn's computes only its new part, each row over the
whole conversation's keys, at a rate no cold prompt has."""

Basis = str
"""Where a candidate's figure comes from: ``"model"`` (the first-order prediction),
``"measured"`` (this very placement served) or ``"scaled"`` (the prediction times the
measured / predicted ratio of placements of the same model on some of its nodes)."""


@dataclass(frozen=True)
class PlacementKey:
    """What makes two instances the same placement for speed.

    Attributes:
        model_id: the model.
        sharding: ``"pipeline"``, ``"tensor"`` or ``"ring"``.
        node_ids: the nodes in rank order.
        dtype: the compute dtype.
        quantize: ``"int8"`` / ``"int4"`` quantization on load, or None.
    """

    model_id: str
    sharding: str
    node_ids: tuple[str, ...]
    dtype: str = "bfloat16"
    quantize: str | None = None


@dataclass(frozen=True)
class ServedSpeed:
    """What one placement did while serving, and what the model had predicted for it.

    Attributes:
        key: the placement.
        decode_samples: per-request decode rates of one sequence alone in the batch,
            tokens/s, oldest first (at most :data:`KEEP_SAMPLES`).
        prefill_samples: per-request prefill rates of prompts of at least
            :data:`MIN_PREFILL_TOKENS` that started with nothing else running, prompt
            tokens/s.
        decode_positions: each decode sample's mean position in its sequence (prompt
            tokens plus half the generated ones: the KV cache its steps read, on
            average), tokens.
        predicted_decode_tokens_per_s, predicted_prefill_tokens_per_s: the first-order
            prediction for this placement when the last sample was taken (from the
            profiles then, decode at the samples' median position, :attr:`context`,
            prefill of a prompt of their median length, :attr:`prompt_tokens`; 0:
            unknown), for the ratio :func:`calibrate` scales others by.
        at: when the last sample was taken, seconds since the epoch.
        prefill_lengths: each prefill sample's prompt tokens (a long prompt's attention
            costs more a token).
    """

    key: PlacementKey
    decode_samples: tuple[float, ...] = ()
    prefill_samples: tuple[float, ...] = ()
    decode_positions: tuple[float, ...] = ()
    predicted_decode_tokens_per_s: float = 0.0
    predicted_prefill_tokens_per_s: float = 0.0
    at: float = 0.0
    prefill_lengths: tuple[int, ...] = ()

    @property
    def decode_tokens_per_s(self) -> float | None:
        """The median measured decode rate, tokens/s (None: no sample)."""
        return statistics.median(self.decode_samples) if self.decode_samples else None

    @property
    def context(self) -> int | None:
        """The context to predict the decode samples at: twice their median position
        (the preview reads the KV cache of a sequence growing to ``context`` at
        ``context / 2``), at least 2; None: no sample."""
        if not self.decode_positions:
            return None
        return max(2, round(2 * statistics.median(self.decode_positions)))

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt length to predict the prefill samples at: their median, tokens;
        None: no sample (or none with its length: a record of an older version)."""
        if not self.prefill_lengths:
            return None
        return round(statistics.median(self.prefill_lengths))

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """The median measured prefill rate, prompt tokens/s (None: no sample)."""
        return statistics.median(self.prefill_samples) if self.prefill_samples else None

    def to_dict(self) -> dict:
        """A JSON form (:meth:`from_dict` reads it back), with the medians added."""
        return dict(
            dataclasses.asdict(self),
            decode_tokens_per_s=self.decode_tokens_per_s,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
        )

    @classmethod
    def from_dict(cls, data: dict) -> "ServedSpeed":
        """Read :meth:`to_dict`'s form.

        Raises:
            KeyError, TypeError, ValueError: not that form.
        """
        key = dict(data["key"])
        key["node_ids"] = tuple(key["node_ids"])
        return cls(
            PlacementKey(**key),
            tuple(float(x) for x in data.get("decode_samples", ())),
            tuple(float(x) for x in data.get("prefill_samples", ())),
            tuple(float(x) for x in data.get("decode_positions", ())),
            float(data.get("predicted_decode_tokens_per_s") or 0.0),
            float(data.get("predicted_prefill_tokens_per_s") or 0.0),
            float(data.get("at") or 0.0),
            tuple(int(x) for x in data.get("prefill_lengths", ())),
        )


def request_rates(
    prompt_tokens: int,
    cached_tokens: int,
    ttft: float | None,
    plain_steps: int,
    plain_s: float,
    alone: bool,
    started_alone: bool,
) -> tuple[float | None, float | None]:
    """(decode, prefill) tokens/s one finished request shows, or None for each it cannot.

    What the preview predicts is a plain decode step of one sequence and a cold prompt's
    prefill, so only those count: a step that carried drafts (speculative decoding)
    computes more rows and may give several tokens (a code edit's drafted decode ran
    3.1x the plain rate, and counted whole it had put the prediction at 0.32x "measured"),
    and a prompt resumed from a cached prefix computed only its new part (a next turn's
    2,321 tokens "prefilled" at 9,000-11,000 tokens/s where a cold one ran 1,600-2,400).

    Args:
        prompt_tokens: tokens of its prompt; ``cached_tokens`` of them came from a cached
            prefix (not computed).
        ttft: seconds from handing the task to its ranks to its first token reaching the
            node (None: no token).
        plain_steps, plain_s: its decode steps that gave one token with no draft beside
            it, and the seconds they took (from the token before each to its own).
        alone: no other sequence ran in its instance's batch from its first token to
            its last (decode of one sequence, what the preview predicts).
        started_alone: nothing else ran in the batch when it was handed over and up to
            its first token (its prefill had the ranks to itself).

    Returns:
        decode: ``plain_steps / plain_s`` when ``alone`` and ``plain_steps >=
        MIN_DECODE_STEPS``; prefill: ``(prompt_tokens - cached_tokens) / ttft`` when
        ``started_alone``, ``prompt_tokens >= MIN_PREFILL_TOKENS`` and ``cached_tokens``
        is at most :data:`MOST_CACHED_SHARE` of the prompt.
    """
    decode = prefill = None
    if alone and plain_steps >= MIN_DECODE_STEPS and plain_s > 0:
        decode = plain_steps / plain_s
    cold = cached_tokens <= MOST_CACHED_SHARE * prompt_tokens
    if ttft is not None and ttft > 0 and started_alone and cold and prompt_tokens >= MIN_PREFILL_TOKENS:
        prefill = (prompt_tokens - cached_tokens) / ttft
    return decode, prefill


def record(
    previous: ServedSpeed | None,
    key: PlacementKey,
    decode: float | None,
    prefill: float | None,
    position: float,
    at: float,
    prompt_tokens: int = 0,
) -> ServedSpeed:
    """``previous`` (None: nothing yet) with one request's rates added (None: not taken;
    ``position``: the decode sample's mean position, tokens; ``prompt_tokens``: the
    prefill sample's prompt), the newest :data:`KEEP_SAMPLES` of each kept; its
    prediction is set by :func:`with_prediction`."""
    old = previous or ServedSpeed(key)
    decodes, positions = old.decode_samples, old.decode_positions
    if decode is not None:
        decodes, positions = decodes + (decode,), positions + (position,)
    prefills, lengths = old.prefill_samples, old.prefill_lengths
    if prefill is not None:
        prefills, lengths = prefills + (prefill,), lengths + (prompt_tokens,)
    return dataclasses.replace(
        old,
        decode_samples=decodes[-KEEP_SAMPLES:],
        decode_positions=positions[-KEEP_SAMPLES:],
        prefill_samples=prefills[-KEEP_SAMPLES:],
        prefill_lengths=lengths[-KEEP_SAMPLES:],
        at=at,
    )


def with_prediction(speed: ServedSpeed, predicted: tuple[float, float]) -> ServedSpeed:
    """``speed`` with the model's (decode at :attr:`ServedSpeed.context`, prefill of a
    prompt of :attr:`ServedSpeed.prompt_tokens`) tokens/s for its placement."""
    return dataclasses.replace(
        speed, predicted_decode_tokens_per_s=predicted[0], predicted_prefill_tokens_per_s=predicted[1]
    )


def merge(speeds: Iterable[ServedSpeed]) -> dict[PlacementKey, ServedSpeed]:
    """One figure per placement from several nodes' records: for each key, the record
    taken last (each node times only the requests it streamed; the newest reflects the
    code and load of now)."""
    out: dict[PlacementKey, ServedSpeed] = {}
    for speed in speeds:
        kept = out.get(speed.key)
        if kept is None or speed.at > kept.at:
            out[speed.key] = speed
    return out


def _one(
    predicted: float, measured: float | None, related: Sequence[Sequence[tuple[float | None, float]]]
) -> tuple[float, Basis]:
    """``measured``, else ``predicted`` times the median measured / predicted ratio of the
    first tier of ``related`` (pairs of measured and predicted figures) that has one,
    else ``predicted``."""
    if measured is not None:
        return measured, "measured"
    for tier in related:
        ratios = [m / p for m, p in tier if m is not None and p > 0]
        if ratios and predicted > 0:
            return predicted * statistics.median(ratios), "scaled"
    return predicted, "model"


def calibrate(
    key: PlacementKey, predicted: tuple[float, float], speeds: Sequence[ServedSpeed]
) -> tuple[float, float, Basis, Basis]:
    """The candidate ``key``'s (decode, prefill) tokens/s corrected by what the cluster
    measured (the module's rule: measured, else scaled, else predicted), and the basis of
    each.

    Args:
        key: the candidate placement.
        predicted: the model's (decode, prefill) tokens/s for it.
        speeds: the cluster's records (:func:`merge`'s values).

    Returns:
        ``(decode, prefill, decode_basis, prefill_basis)``.
    """
    exact = next((s for s in speeds if s.key == key), None)
    nodes = set(key.node_ids)
    related = [
        s
        for s in speeds
        if s.key != key
        and s.key.model_id == key.model_id
        and s.key.dtype == key.dtype
        and s.key.quantize == key.quantize
        and nodes & set(s.key.node_ids)
    ]
    tiers = (
        [s for s in related if s.key.sharding == key.sharding and set(s.key.node_ids) == nodes],
        [s for s in related if len(s.key.node_ids) == 1],
    )
    decode, decode_basis = _one(
        predicted[0],
        exact.decode_tokens_per_s if exact else None,
        [[(s.decode_tokens_per_s, s.predicted_decode_tokens_per_s) for s in t] for t in tiers],
    )
    prefill, prefill_basis = _one(
        predicted[1],
        exact.prefill_tokens_per_s if exact else None,
        [[(s.prefill_tokens_per_s, s.predicted_prefill_tokens_per_s) for s in t] for t in tiers],
    )
    return decode, prefill, decode_basis, prefill_basis


__all__ = ["PlacementKey", "ServedSpeed", "calibrate", "merge", "record", "request_rates", "with_prediction"]
