"""The node's HTTP server: public APIs, the cluster API and the node-to-node endpoints."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from shardline.api import anthropic, completions, errors, metrics, ollama, openai, responses
from shardline.api.bounds import DEFAULT_MAX_BODY_BYTES, RequestBoundsMiddleware
from shardline.api.create_instance import CreateInstance, create
from shardline.api.heartbeat import HEARTBEAT_S
from shardline.api.http_extras import SCOPE_KEY, RequestIdMiddleware, allowed_methods
from shardline.api.http_guard import GuardConfig, GuardMiddleware, SignatureMiddleware, check_key, check_place
from shardline.api.internal import link_probe, transfer
from shardline.api.keep_alive import KeepAlive, unload
from shardline.api.response_store import ResponseStore, StoredResponse
from shardline.models.config import UnsupportedModelError
from shardline.models.store import ModelNotFoundError, ModelStoreError
from shardline.node.coordinator import free_port
from shardline.node.node import Node
from shardline.node.queue_bound import QueueFullError
from shardline.node.routing import request_tokens
from shardline.node.signing import MEMBER_HEADER
from shardline.node.speeds import placement_key
from shardline.node.state import instance_named
from shardline.node.status import InstanceStatus
from shardline.node.table import Instance, InstanceFailedError, NoInstanceError
from shardline.node.wire import (
    CancelMessage,
    Delivered,
    ForgottenResponse,
    FreePort,
    NodeInfo,
    RankReport,
    SharedResponse,
    StateMessage,
    StateReply,
    StreamLine,
    TaskMessage,
)
from shardline.placement.pipeline import PlacementError
from shardline.placement.ranks import PlacementRequestError, shardings_named
from shardline.runner.protocol import Cancel, PrefillProgress, TokenRequest

log = logging.getLogger(__name__)

DASHBOARD = Path(__file__).resolve().parent.parent / "api" / "static" / "dashboard.html"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") == "value_error" and param is None:  # a model validator's own words
        return str(first.get("msg")).removeprefix("Value error, "), None
    return f"{param or 'body'}: {first.get('msg')}", param


def cluster_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error answer of the cluster API (``{"error": {"message", "type", "param", "code"}}``,
    :mod:`shardline.api.errors`)."""
    return JSONResponse(status_code=status, content=errors.error_body(errors.API.CLUSTER, status, message, param))


def create_app(node: Node, guard: GuardConfig, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               heartbeat_s: float = HEARTBEAT_S) -> FastAPI:
    """The node's FastAPI app. ``guard``: the API key, Host allow-list and CORS origins
    (:mod:`shardline.api.http_guard`); request bodies over ``max_body_bytes`` are refused
    (413, :mod:`shardline.api.bounds`); streams send their API's keep-alive after
    ``heartbeat_s`` seconds with nothing else to send."""

    keep_alive = KeepAlive()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await node.start()
        expiry = asyncio.create_task(keep_alive.run(node))
        try:
            yield
        finally:
            expiry.cancel()
            await node.stop()

    app = FastAPI(title="shardline", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return errors.error_response(request.url.path, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # every method the path takes, not the first route's
            headers["Allow"] = allowed_methods(app.router.routes, request.scope) or headers.get("Allow", "")
        return errors.error_response(request.url.path, exc.status_code, str(exc.detail), headers=headers)

    @app.exception_handler(QueueFullError)
    async def on_queue_full(request: Request, exc: QueueFullError):
        return errors.error_response(request.url.path, 429, str(exc), code="queue_full",
                                     headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(ClientDisconnect)
    async def on_client_gone(request: Request, exc: ClientDisconnect):
        """A client that left before its request was read: one line, not a traceback."""
        log.info("%s %s: the client disconnected before its request was read", request.method,
                 request.url.path)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        """A JSON 500 in the API's format; the traceback goes to the log (uvicorn's)."""
        log.error("%s %s failed: %r", request.method, request.url.path, exc)
        # Answered outside the middleware (Starlette's ServerErrorMiddleware): its id here.
        rid = request.scope.get(SCOPE_KEY)
        return errors.error_response(request.url.path, 500, "internal error: the node's log has the details",
                                     headers={"X-Request-Id": rid} if rid else None)

    # The last added runs first: Host and origin (a disallowed origin's preflight too),
    # CORS (preflight and headers for allowed origins, refusals included), the body
    # bounds, node signatures (which read a body within them), the API key.
    app.add_middleware(GuardMiddleware, config=guard, decide=check_key)
    app.add_middleware(SignatureMiddleware, key=node.signing_key, names=guard.allowed_hosts)
    app.add_middleware(RequestBoundsMiddleware, max_body_bytes=max_body_bytes)
    if guard.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=sorted(guard.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After", "X-Request-Id"], max_age=600)
    app.add_middleware(GuardMiddleware, config=guard, decide=check_place)
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer carries the id

    request_metrics = metrics.RequestMetrics(node)
    app.include_router(openai.router(node, request_metrics, heartbeat_s))
    app.include_router(completions.router(node, request_metrics, heartbeat_s))
    stored = ResponseStore()  # the Responses API's, this node's and those its peers share
    app.include_router(responses.router(node, request_metrics, stored, heartbeat_s=heartbeat_s))
    app.include_router(anthropic.router(node, request_metrics, heartbeat_s))
    app.include_router(ollama.router(node, request_metrics, keep_alive, heartbeat_s))
    app.include_router(metrics.router(request_metrics))
    app.include_router(link_probe.router())
    app.include_router(transfer.router(node.store))

    # -- dashboard, health and cluster API -----------------------------------------------

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def dashboard():
        """The web dashboard: nodes, instances and their shards, placing, a chat panel."""
        # Not inside another site's frame: a framed dashboard is same-origin to the node,
        # and a click there (say on Delete) would be the node's own page's (clickjacking).
        return FileResponse(DASHBOARD, media_type="text/html", headers={
            "X-Frame-Options": "DENY", "Content-Security-Policy": "frame-ancestors 'none'"})

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers
    async def health(cluster: bool = False):
        """This node's own state: its id, the coordinator it follows, the term of the table
        it holds, and its ranks (instance, rank, status). With ``?cluster=1`` also each
        placed model's readiness: 503 with ``"status": "degraded"`` while a placed model
        has no ready instance (a load balancer's check that the cluster serves)."""
        own = [{"instance_id": inst.instance_id, "model_id": inst.model_id, "rank": rank,
                "status": placement.status}
               for inst in node.instances.values()
               for rank, placement in enumerate(inst.ranks) if placement.node_id == node.node_id]
        body = {"status": "ok", "node_id": node.node_id, "coordinator": node.coordinator_id(),
                "term": node.epoch.term, "settled": node.is_settled(), "ranks": own}
        if not cluster:
            return body
        models: dict[str, dict] = {}
        for inst in node.instances.values():
            entry = models.setdefault(inst.model_id, {"ready": False, "instances": []})
            entry["ready"] = entry["ready"] or inst.status == InstanceStatus.READY
            entry["instances"].append({"instance_id": inst.instance_id, "status": inst.status,
                                       "error": inst.error})
        body["models"] = models
        if all(m["ready"] for m in models.values()):
            return body
        return JSONResponse(status_code=503, content=dict(body, status="degraded"))

    @app.get("/cluster/nodes")
    async def nodes() -> dict:
        live = set(node.live_node_ids())
        out = [dict(node.info().model_dump(mode="json"), live=True)]
        for peer in node.peers.values():
            memory = node.memory.of(peer.node_id)  # walks the table: once a peer
            out.append({"node_id": peer.node_id, "address": peer.address, "live": peer.node_id in live,
                        "available_bytes": memory["free_bytes"], **memory, "total_bytes": peer.total_bytes,
                        "profile": peer.profile, "links": peer.links, "models": peer.models})
        # the epoch's majority mark is its term's start; hears_majority is now (a node cut
        # off alone keeps serving in its term, which a majority's table outranks)
        return {"coordinator": node.coordinator_id(), "epoch": node.epoch.to_dict(),
                "hears_majority": node.hears_majority(),
                "node_id": node.node_id, "acting": node.is_coordinator(),
                "nodes": sorted(out, key=lambda n: n["node_id"])}  # one order from every node

    async def instance_view(inst, served: dict) -> dict:
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
            inst, measured.context if measured else None, wait=False,
            prompt_tokens=measured.prompt_tokens if measured else None)
        speed = {"predicted_decode_tokens_per_s": decode or None,
                 "predicted_prefill_tokens_per_s": prefill or None,
                 "measured_decode_tokens_per_s": measured.decode_tokens_per_s if measured else None,
                 "measured_prefill_tokens_per_s": measured.prefill_tokens_per_s if measured else None,
                 "decode_samples": len(measured.decode_samples) if measured else 0,
                 "decode_context": measured.context if measured else inst.context,
                 "prefill_samples": len(measured.prefill_samples) if measured else 0,
                 "prefill_prompt_tokens": measured.prompt_tokens if measured else None}
        return dict(inst.to_dict(), local_engine=node.engine_stats.get(inst.instance_id),
                    local_memory=node.worker.memory(inst.instance_id), speed=speed)

    @app.get("/cluster/models")
    async def models() -> dict:
        """Every model a live node holds (and the embedded default): which nodes hold
        all of its files or some, its size, and its instances (the peers asked afresh)."""
        return {"models": await node.logistics.cluster_models()}

    @app.get("/cluster/instances")
    async def instances() -> dict:
        served = node.forecast.served_speeds()
        return {"instances": [await instance_view(i, served) for i in node.instances.values()]}

    @app.get("/cluster/instances/{instance_id}")
    async def instance(instance_id: str):
        inst = instance_named(node.instances, instance_id)  # or the one placed in its place
        if inst is None:
            return cluster_error(404, f"no instance {instance_id}", "instance_id")
        return await instance_view(inst, node.forecast.served_speeds())

    @app.post("/cluster/placements/preview")
    async def placement_preview(body: CreateInstance):
        """Feasible placements with predicted tokens/s (fastest first), then refused ones;
        ``serving``: an instance of the model (in the asked dtype and quantization) runs
        on this placement now."""
        try:
            shardings = shardings_named(body.sharding)
            model_id = await node.logistics.adopt(body.model)
            card = await node.logistics.model_card(model_id)
            candidates = await node.coordinator.preview(card, body.nodes, body.context,
                                                        body.max_batch, body.dtype,
                                                        shardings=shardings, force=body.force,
                                                        min_nodes=body.min_nodes or 1,
                                                        max_nodes=body.max_nodes,
                                                        kv_cache_bytes=body.kv_cache_bytes,
                                                        quantize=body.quantize)
        except ModelNotFoundError as exc:
            return cluster_error(404, str(exc), "model")
        except (PlacementError, ModelStoreError, UnsupportedModelError, PlacementRequestError) as exc:
            return cluster_error(400, str(exc))
        serving = {(str(i.sharding), tuple(i.node_ids())) for i in node.instances.values()
                   if i.model_id == card.model_id and i.status != InstanceStatus.FAILED
                   and i.dtype == body.dtype and i.quantize == body.quantize}
        return {"candidates": [
            {"sharding": c.sharding, "node_ids": list(c.node_ids), "feasible": c.feasible,
             "serving": (str(c.sharding), tuple(c.node_ids)) in serving,
             "predicted_decode_tokens_per_s": c.predicted_decode_tokens_per_s,
             "predicted_prefill_tokens_per_s": c.predicted_prefill_tokens_per_s,
             "model_decode_tokens_per_s": c.model_decode_tokens_per_s,
             "model_prefill_tokens_per_s": c.model_prefill_tokens_per_s,
             "decode_basis": c.decode_basis, "prefill_basis": c.prefill_basis,
             "shares": [dataclasses.asdict(s) for s in c.shares], "error": c.error,
             "kv_tokens": c.kv_tokens}
            for c in candidates]}

    @app.post("/cluster/instances", status_code=201)
    async def create_instance(body: CreateInstance):
        status, content = await create(node, body)
        return JSONResponse(status_code=status, content=content)

    @app.delete("/cluster/instances/{instance_id}")
    async def delete_instance(instance_id: str):
        status, content = await unload(node, instance_id)  # through the coordinator
        return JSONResponse(status_code=status, content=content)

    # -- node-to-node --------------------------------------------------------------------

    @app.get("/internal/info")
    async def info(request: Request) -> NodeInfo:
        caller = request.headers.get(MEMBER_HEADER)
        if caller:
            node.add_peer(caller)
        return node.info()

    @app.get("/internal/state")
    async def get_state() -> StateMessage:
        return StateMessage.of(node.cluster_state)

    @app.post("/internal/state")
    async def put_state(message: StateMessage):
        """A coordinator's table: adopted when its epoch is newer than this node's, else
        refused with 409 (an older term's, or a replay)."""
        if not await node.apply_state(message.state()):
            return JSONResponse(status_code=409, content=StateReply(
                epoch=node.epoch, detail="the state is not newer than this node's").model_dump(mode="json"))
        return StateReply(epoch=node.epoch)

    @app.get("/internal/free-port")
    async def get_free_port() -> FreePort:
        return FreePort(port=free_port())

    @app.post("/internal/runner-status")
    async def runner_status(report: RankReport):
        if not await node.coordinator.runner_status(report.event()):
            return JSONResponse(status_code=503, content={"detail": "this node does not coordinate"})
        return {"ok": True}

    @app.post("/internal/tasks")
    async def tasks(message: TaskMessage) -> Delivered:
        return Delivered(delivered=node.router.deliver_local(message.instance_id, message.task))

    @app.post("/internal/cancel")
    async def cancel(message: CancelMessage) -> Delivered:
        return Delivered(delivered=node.router.deliver_local(message.instance_id, Cancel(message.task_id)))

    @app.post("/internal/responses")
    async def share_response(message: SharedResponse) -> Delivered:
        entry = StoredResponse.of(message.response, message.items)
        return Delivered(delivered=stored.put(message.response_id, entry))

    @app.post("/internal/responses/forget")
    async def forget_response(message: ForgottenResponse) -> Delivered:
        return Delivered(delivered=stored.delete(message.response_id))

    @app.post("/internal/generate")
    async def generate(request: TokenRequest):
        routed: Instance | None = None
        try:  # a full queue is a 429 here (QueueFullError), before the stream begins
            routed = node.router.route(request.prompt, node.router.ready_instance(
                request.model_id, request_tokens(request)), local_only=True)
            task_id = node.router.reserve(routed, request, bounded=request.sampling.resumed == 0)
        except NoInstanceError:
            task_id = None  # told in the stream
        ran_on: list[str] = []  # the instances it runs on, in order
        events = node.router.generate(request, task_id, lambda inst: ran_on.append(inst.instance_id), routed)

        async def lines():
            named = 0  # of ran_on
            try:
                async for event in events:
                    if named < len(ran_on):
                        named = len(ran_on)
                        yield StreamLine(instance_id=ran_on[-1]).model_dump_json() + "\n"
                    line = StreamLine(progress=event) if isinstance(event, PrefillProgress) else StreamLine(token=event)
                    yield line.model_dump_json() + "\n"
            except (InstanceFailedError, NoInstanceError) as exc:
                code = exc.code if isinstance(exc, InstanceFailedError) else None
                yield StreamLine(error=str(exc), code=code).model_dump_json() + "\n"
            finally:
                await events.aclose()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app
