"""The cluster API (``/cluster/...``): the nodes, the models they hold, the instances and
their placement preview, placing an instance and deleting one, and the settings that point
a coding agent at a placed model (``shardline connect``'s). Any node answers; placing and
deleting go through the coordinator. Errors are OpenAI-shaped (:func:`cluster_error`,
:mod:`shardline.api.errors`)."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from shardline.api import errors
from shardline.api.create_instance import CreateInstance, adopt_models, create
from shardline.api.http_guard import presented_key
from shardline.api.keep_alive import unload
from shardline.connect import CLIENTS, connection
from shardline.models.config import UnsupportedModelError
from shardline.models.store import ModelNotFoundError, ModelStoreError
from shardline.node.node import Node
from shardline.node.speeds import placement_key
from shardline.node.state import instance_named
from shardline.node.status import InstanceStatus
from shardline.node.table import Instance
from shardline.placement.layer_ranges import PlacementError
from shardline.placement.ranks import DraftModelError, DraftModelNotFoundError, PlacementRequestError


def cluster_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error answer of the cluster API (``{"error": {"message", "type", "param", "code"}}``,
    :mod:`shardline.api.errors`)."""
    return JSONResponse(status_code=status, content=errors.error_body(errors.API.CLUSTER, status, message, param))


def router(node: Node) -> APIRouter:
    """The cluster API of ``node``."""
    routes = APIRouter()

    @routes.get("/cluster/nodes")
    async def nodes() -> dict:
        return nodes_view(node)

    @routes.get("/cluster/models")
    async def models() -> dict:
        """Every model a live node holds (and the embedded default): which nodes hold
        all of its files or some, its size, and its instances (the peers asked afresh)."""
        return {"models": await node.logistics.cluster_models()}

    @routes.get("/cluster/instances")
    async def instances() -> dict:
        served = node.forecast.served_speeds()
        return {"instances": [await instance_view(node, i, served) for i in node.instances.values()]}

    @routes.get("/cluster/instances/{instance_id}")
    async def instance(instance_id: str):
        inst = instance_named(node.instances, instance_id)  # or the one placed in its place
        if inst is None:
            return cluster_error(404, f"no instance {instance_id}", "instance_id")
        return await instance_view(node, inst, node.forecast.served_speeds())

    @routes.post("/cluster/placements/preview")
    async def placement_preview(body: CreateInstance):
        """Feasible placements with predicted tokens/s (fastest first), then refused ones;
        ``serving``: an instance of the model (in the asked dtype and quantization) runs
        on this placement now."""
        return await preview(node, body)

    @routes.post("/cluster/instances", status_code=201)
    async def create_instance(body: CreateInstance):
        status, content = await create(node, body)
        return JSONResponse(status_code=status, content=content)

    @routes.delete("/cluster/instances/{instance_id}")
    async def delete_instance(instance_id: str):
        status, content = await unload(node, instance_id)  # through the coordinator
        return JSONResponse(status_code=status, content=content)

    @routes.get("/cluster/connect/{client}")
    async def connect(client: str, request: Request, model: str | None = None):
        """The settings that point ``client`` (Claude Code, Codex, opencode, aider, llm) at
        a ready model, as ``shardline connect CLIENT --url`` this node prints them: 404 for
        an unknown client, or where no model (``model``) is ready."""
        base_url = str(request.base_url).rstrip("/")  # the node as the client reached it
        key = presented_key(request.headers.get("authorization"), request.headers.get("x-api-key")) or None
        return connect_view(node, client, model or None, base_url, key)

    return routes


def connect_view(node: Node, client: str, model: str | None, base_url: str, key: str | None) -> dict | JSONResponse:
    """``GET /cluster/connect/{client}``'s answer: ``client``'s settings for ``model`` (else
    the first ready instance's model, as ``shardline connect`` picks) at ``base_url``, with
    the instance's context: ``{"client", "model", "context", "base_url", "env", "files",
    "command", "notes", "text"}`` (``text``: what ``shardline connect`` prints). A 404 (in
    the cluster API's error shape) for a client not in :data:`~shardline.connect.CLIENTS`,
    or where no instance of the model is ready."""
    if client not in CLIENTS:
        return cluster_error(404, f"unknown client {shown(client)}: one of {', '.join(CLIENTS)}", "client")
    ready = [
        i
        for i in node.instances.values()
        if i.status == InstanceStatus.READY and (model is None or i.model_id == model)
    ]
    if not ready:
        which = (
            f"model {shown(model)} is not ready on the cluster: place it" if model else "no model is ready: place one"
        )
        return cluster_error(404, f"{which} first", "model")
    chosen = ready[0]
    settings = connection(client, base_url, chosen.model_id, chosen.context, key)
    return {
        "client": client,
        "model": chosen.model_id,
        "context": chosen.context,
        "base_url": base_url,
        "env": settings.env,
        "files": settings.files,
        "command": list(settings.command),
        "notes": list(settings.notes),
        "text": settings.text(),
    }


SHOWN_CHARS = 200
"""Most characters of a value an error message repeats (a 100,000-character one is not
worth sending back)."""


def shown(value: str) -> str:
    """``value`` as an error message quotes it (``repr``), cut to :data:`SHOWN_CHARS`."""
    return repr(value) if len(value) <= SHOWN_CHARS else repr(value[:SHOWN_CHARS]) + f"... ({len(value)} characters)"


def nodes_view(node: Node) -> dict:
    """``GET /cluster/nodes``: this node and every peer (live or not), with its memory,
    profile, links and models; who coordinates and in which epoch."""
    live = set(node.live_node_ids())
    out = [dict(node.info().model_dump(mode="json"), live=True)]
    for peer in node.peers.values():
        memory = node.memory.of(peer.node_id)  # walks the table: once a peer
        out.append(
            {
                "node_id": peer.node_id,
                "address": peer.address,
                "live": peer.node_id in live,
                "available_bytes": memory["free_bytes"],
                **memory,
                "total_bytes": peer.total_bytes,
                "profile": peer.profile,
                "links": peer.links,
                "models": peer.models,
            }
        )
    # the epoch's majority mark is its term's start; hears_majority is now (a node cut
    # off alone keeps serving in its term, which a majority's table outranks)
    return {
        "coordinator": node.coordinator_id(),
        "epoch": node.epoch.to_dict(),
        "hears_majority": node.hears_majority(),
        "node_id": node.node_id,
        "acting": node.is_coordinator(),
        "nodes": sorted(out, key=lambda n: n["node_id"]),
    }  # one order from every node


async def instance_view(node: Node, inst: Instance, served: dict) -> dict:
    """An instance; ``local_engine`` is this node's rank's batch (EngineStats),
    ``local_memory`` its runner's memory (see ``Worker.memory``) and ``speed`` the
    preview's first-order prediction for its placement now (decode at the context
    its measured requests ran at, else the instance's; prefill at their median
    prompt, ``prefill_prompt_tokens``, else one chunk's) beside what the cluster
    measured it doing (``served``: ``Forecast.served_speeds()``; None: no request
    measured yet, or the model's card is still being read) and how many requests each
    figure is the median of."""
    measured = served.get(placement_key(inst))
    decode, prefill = await node.forecast.first_order(
        inst,
        measured.context if measured else None,
        wait=False,
        prompt_tokens=measured.prompt_tokens if measured else None,
    )
    speed = {
        "predicted_decode_tokens_per_s": decode or None,
        "predicted_prefill_tokens_per_s": prefill or None,
        "measured_decode_tokens_per_s": measured.decode_tokens_per_s if measured else None,
        "measured_prefill_tokens_per_s": measured.prefill_tokens_per_s if measured else None,
        "decode_samples": len(measured.decode_samples) if measured else 0,
        "decode_context": measured.context if measured else inst.context,
        "prefill_samples": len(measured.prefill_samples) if measured else 0,
        "prefill_prompt_tokens": measured.prompt_tokens if measured else None,
    }
    return dict(
        inst.to_dict(),
        local_engine=node.engine_stats.get(inst.instance_id),
        local_memory=node.worker.memory(inst.instance_id),
        speed=speed,
    )


async def preview(node: Node, body: CreateInstance) -> dict | JSONResponse:
    """``POST /cluster/placements/preview``'s answer: the candidates, or a refusal (404
    for an unknown model, 400 for one or a request that cannot be placed)."""
    refused = await adopt_models(node, body)
    if refused is not None:
        return cluster_error(400, *refused)
    try:
        options = body.placement_options()
    except PlacementError as exc:  # no sharding of that name
        return cluster_error(400, str(exc), "sharding")
    try:
        assert body.model is not None  # adopted: the default model's id where none was named
        card = await node.logistics.model_card(body.model)
        candidates = await node.coordinator.preview(card, body.nodes, options)
    except DraftModelNotFoundError as exc:
        return cluster_error(404, str(exc), "draft_model")
    except ModelNotFoundError as exc:
        return cluster_error(404, str(exc), "model")
    except DraftModelError as exc:
        return cluster_error(400, str(exc), "draft_model")
    except (PlacementError, ModelStoreError, UnsupportedModelError, PlacementRequestError) as exc:
        return cluster_error(400, str(exc))
    serving = {
        (str(i.sharding), tuple(i.node_ids()))
        for i in node.instances.values()
        if i.model_id == card.model_id
        and i.status != InstanceStatus.FAILED
        and i.dtype == body.dtype
        and i.quantize == body.quantize
    }
    return {
        "candidates": [
            {
                "sharding": c.sharding,
                "node_ids": list(c.node_ids),
                "feasible": c.feasible,
                "serving": (str(c.sharding), tuple(c.node_ids)) in serving,
                "predicted_decode_tokens_per_s": c.predicted_decode_tokens_per_s,
                "predicted_prefill_tokens_per_s": c.predicted_prefill_tokens_per_s,
                "model_decode_tokens_per_s": c.model_decode_tokens_per_s,
                "model_prefill_tokens_per_s": c.model_prefill_tokens_per_s,
                "decode_basis": c.decode_basis,
                "prefill_basis": c.prefill_basis,
                "shares": [dataclasses.asdict(s) for s in c.shares],
                "error": c.error,
                "kv_tokens": c.kv_tokens,
                "rank_bytes": list(c.rank_bytes),
            }
            for c in candidates
        ]
    }
