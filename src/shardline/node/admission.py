"""Admission: what a request for a model gets from a table, decided once (:func:`admit`):
a ready instance to tokenize and check it against (and the wider one to fall back to
where its prompt exceeds that one's context), an instance to check it against before it
waits for its model to load, or a refusal with the facts the API words it from. Pure:
values in, a value out; the API tokenizes and waits
(:func:`shardline.api.preparation.tokenize`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias

from shardline.node.routing import awaited, ready_instances, served_models
from shardline.node.table import Instance


@dataclass(frozen=True)
class Ready:
    """A ready instance serves the model: tokenize the request and check it against
    ``instance``; where its prompt exceeds that instance's context, against ``wider``
    (the ready instance of the longest context, where longer than ``instance``'s)."""

    instance: Instance
    wider: Instance | None = None


@dataclass(frozen=True)
class Wait:
    """None is ready, but one is loading (placed, or placed again) or failed and about to
    be placed again: tokenize the request and check it against ``instance`` (of those
    the longest context, then the newest), so that one its context refuses is refused at
    once, then wait for a ready one."""

    instance: Instance


@dataclass(frozen=True)
class Refused:
    """Nothing to serve the model nor wait for: ``placed``, its instances in the table
    (empty: none is placed, a 404; else each failed and given up on, or waited for in
    vain, a 503), and ``available``, the models with a ready instance (table order)."""

    model_id: str
    placed: tuple[Instance, ...]
    available: tuple[str, ...]


Admission: TypeAlias = Ready | Wait | Refused
"""What :func:`admit` decides for a request."""


def admit(instances: Mapping[str, Instance], model_id: str, node_id: str, window: int | None = None) -> Admission:
    """What a request for ``model_id`` taken by ``node_id`` gets from the table
    ``instances``, given the request's own ``window`` (Ollama's ``num_ctx``; None: the
    instance's context).

    Returns:
        :class:`Ready` with the first of :func:`~shardline.node.routing.ready_instances`
        (a rank on ``node_id`` first, then the oldest; none superseded), or the first whose
        context holds ``window`` where that one's does not; :class:`Wait` where none is
        ready but one of the model is not ``given_up``; else :func:`refused`'s answer.
    """
    ready = ready_instances(instances, model_id, node_id)
    if ready:
        chosen = ready[0]
        if window is not None and chosen.context < window:
            chosen = next((i for i in ready if i.context >= window), chosen)
        widest = max(ready, key=lambda i: i.context)  # the first of the longest
        return Ready(chosen, widest if widest.context > chosen.context else None)
    waiting = awaited(instances, model_id)
    if waiting:
        return Wait(max(waiting, key=lambda i: (i.context, i.created_at)))
    return refused(instances, model_id)


def refused(instances: Mapping[str, Instance], model_id: str) -> Refused:
    """The refusal of a request for ``model_id`` that found nothing to run on (at once, or
    after its wait): the model's instances in ``instances`` and the models with a ready
    instance, each in table order.

    Returns:
        The :class:`Refused`; never raises.
    """
    placed = tuple(i for i in instances.values() if i.model_id == model_id)
    return Refused(model_id, placed, tuple(served_models(instances)))
