"""``GET /health`` (and ``HEAD``, for load balancers): this node's own state, and with
``?cluster=1`` whether every placed model is served."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from shardline.node.node import Node
from shardline.node.status import InstanceStatus


def router(node: Node) -> APIRouter:
    """The health check of ``node``."""
    routes = APIRouter()

    @routes.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers
    async def health(cluster: bool = False):
        """This node's own state: its id, the coordinator it follows, the term of the table
        it holds, and its ranks (instance, rank, status). With ``?cluster=1`` also each
        placed model's readiness: 503 with ``"status": "degraded"`` while a placed model
        has no ready instance (a load balancer's check that the cluster serves)."""
        body = node_health(node)
        if not cluster:
            return body
        body["models"] = models_health(node)
        if all(m["ready"] for m in body["models"].values()):
            return body
        return JSONResponse(status_code=503, content=dict(body, status="degraded"))

    return routes


def node_health(node: Node) -> dict:
    """This node's id, the coordinator it follows, its table's term, whether it has
    settled, and its ranks."""
    own = [
        {"instance_id": inst.instance_id, "model_id": inst.model_id, "rank": rank, "status": placement.status}
        for inst in node.instances.values()
        for rank, placement in enumerate(inst.ranks)
        if placement.node_id == node.node_id
    ]
    return {
        "status": "ok",
        "node_id": node.node_id,
        "coordinator": node.coordinator_id(),
        "term": node.epoch.term,
        "settled": node.is_settled(),
        "ranks": own,
    }


def models_health(node: Node) -> dict[str, dict]:
    """Each placed model: whether an instance of it is ready, and its instances' status
    and error."""
    models: dict[str, dict] = {}
    for inst in node.instances.values():
        entry = models.setdefault(inst.model_id, {"ready": False, "instances": []})
        entry["ready"] = entry["ready"] or inst.status == InstanceStatus.READY
        entry["instances"].append({"instance_id": inst.instance_id, "status": inst.status, "error": inst.error})
    return models
