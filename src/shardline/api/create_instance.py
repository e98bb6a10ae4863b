"""Placing an instance as ``POST /cluster/instances`` does: its body (:class:`CreateInstance`)
and :func:`create`, which the route and Ollama's load on demand (:mod:`shardline.api.keep_alive`)
both call."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shardline.api.coordinator_forward import ask_coordinator
from shardline.api.errors import API, error_body
from shardline.models.config import Quantize, UnsupportedModelError
from shardline.models.store import ModelNotFoundError, ModelStoreError
from shardline.node.node import Node
from shardline.placement.layer_ranges import PlacementError
from shardline.placement.ranks import (
    SHARDINGS,
    DraftModelError,
    DraftModelNotFoundError,
    PlacementOptions,
    PlacementRequestError,
    shardings_named,
)


class CreateInstance(BaseModel):
    """The body of ``POST /cluster/instances`` and ``/cluster/placements/preview``. A key
    it does not know, or a value of another JSON type (``"force": "yes"``, ``"context":
    "2048"``), is refused (400) rather than ignored or coerced: a mistyped ``"nodez"``
    placed the model on every node. ``model`` None: the embedded default model."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    sharding: str = "pipeline"
    nodes: list[str] | None = Field(default=None, min_length=1)
    context: int | None = Field(default=None, ge=1)
    max_batch: int | None = Field(default=None, ge=1)
    kv_cache_bytes: int | None = Field(default=None, ge=1)  # the KV pool, all ranks together
    quantize: Literal["int8", "int4"] | None = None  # 16/32-bit weights quantized on load
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    force: bool = False  # skip memory admission
    prefix_cache: bool = True  # finished prompts kept for later ones that start the same
    draft_model: str | None = Field(default=None, min_length=1)  # of the same tokenizer: drafts for speculation
    min_nodes: int | None = Field(default=None, ge=1)  # without "nodes": the fewest to use
    max_nodes: int | None = Field(default=None, ge=1)  # without "nodes": the most to use

    @field_validator("nodes")
    @classmethod
    def _distinct(cls, nodes: list[str] | None) -> list[str] | None:
        if nodes is not None and len(set(nodes)) != len(nodes):
            twice = sorted({n for n in nodes if nodes.count(n) > 1})
            raise ValueError(f"a node can hold one rank of an instance; listed twice: {', '.join(twice)}")
        return nodes

    @model_validator(mode="after")
    def _node_counts(self) -> "CreateInstance":
        if self.nodes is not None and (self.min_nodes or self.max_nodes):
            raise ValueError("give nodes, or min_nodes / max_nodes, not both")
        if self.min_nodes and self.max_nodes and self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes {self.min_nodes} is above max_nodes {self.max_nodes}")
        return self

    def placement_options(self) -> PlacementOptions:
        """What this body asks the placement for.

        Raises:
            PlacementError: no sharding has its ``sharding``'s name.
        """
        return PlacementOptions(
            self.context,
            self.max_batch,
            self.dtype,
            shardings_named(self.sharding),
            self.min_nodes,
            self.max_nodes,
            self.kv_cache_bytes,
            Quantize(self.quantize) if self.quantize else None,
            self.force,
            self.prefix_cache,
            self.draft_model,
        )


async def adopt_models(node: Node, body: CreateInstance) -> tuple[str, str] | None:
    """Put ``body``'s ``model`` and ``draft_model`` into this node's store where they name a
    path or cached repo on this machine, so that the coordinator (perhaps another machine)
    finds them by id, and name them by id in ``body``; or the refusal, its message and the
    parameter it names, where one is not a model shardline can run."""
    try:
        body.model = await node.logistics.adopt(body.model)
    except (ModelStoreError, UnsupportedModelError) as exc:
        return str(exc), "model"
    if body.draft_model is not None:
        try:
            body.draft_model = await node.logistics.adopt(body.draft_model)
        except (ModelStoreError, UnsupportedModelError) as exc:
            return f"draft_model: {exc}", "draft_model"
    return None


async def create(node: Node, body: CreateInstance) -> tuple[int, dict]:
    """Place ``body``'s instance through the coordinator (this node, or a request to it): the
    HTTP status and JSON body ``POST /cluster/instances`` answers (201 and the instance; 400
    for a model or a request that cannot be placed, 404 for an unknown model, 409 when the
    cluster has no room, 503 while there is no coordinator to ask)."""
    refused = await adopt_models(node, body)
    if refused is not None:
        return 400, error_body(API.CLUSTER, 400, *refused)
    if not node.is_coordinator():
        return await ask_coordinator(node, "POST", "/cluster/instances", body.model_dump())
    try:
        inst = await node.coordinator.create_instance(body.model, body.nodes, body.placement_options())
    except DraftModelNotFoundError as exc:
        return 404, error_body(API.CLUSTER, 404, str(exc), "draft_model")
    except ModelNotFoundError as exc:
        return 404, error_body(API.CLUSTER, 404, str(exc), "model")
    except DraftModelError as exc:
        return 400, error_body(API.CLUSTER, 400, str(exc), "draft_model")
    except (ModelStoreError, UnsupportedModelError, PlacementRequestError) as exc:
        return 400, error_body(API.CLUSTER, 400, str(exc))
    except PlacementError as exc:
        if body.sharding not in SHARDINGS + ("auto",):  # no sharding of that name
            return 400, error_body(API.CLUSTER, 400, str(exc), "sharding")
        return 409, error_body(API.CLUSTER, 409, str(exc))
    return 201, inst.to_dict()
