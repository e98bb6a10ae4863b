"""The one client a node talks to other nodes through: each ``/internal`` route as a
method that sends and returns :mod:`shardline.node.wire` messages, over one connection
pool that signs every request (:mod:`shardline.node.signing`: the cluster key is never
sent); model file copies run in a worker thread on a blocking client that signs the same way.

A peer that cannot be reached, answers with an unexpected status, answers without a good
signature, or sends a message that does not validate raises :class:`PeerError`; a peer that
refuses this node's signature raises :class:`KeyRefusedError`. Callers decide what a failure means (a missed poll, a rank that
never got its task).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import httpx
import pydantic

from shardline.models.confine import UnsafePathError
from shardline.models.file_pieces import Piece
from shardline.models.store import Manifest, ModelStore
from shardline.node.link_probe import measure_link
from shardline.node.peer_error import PeerError
from shardline.node.queue_bound import QueueFullError, retry_after
from shardline.node.signing import MEMBER_HEADER, SignatureError, SignedAuth, check_answer
from shardline.node.state import ClusterState
from shardline.node.table import EndCode, InstanceFailedError
from shardline.node.transfer import CopyProgress, TransferError, fetch_files, fetch_pieces
from shardline.node.wire import (
    CancelMessage,
    Delivered,
    ForgottenResponse,
    FreePort,
    KeepAliveMessage,
    NodeInfo,
    RankReport,
    SharedResponse,
    StateMessage,
    StateReply,
    StreamLine,
    TaskMessage,
)
from shardline.runner.protocol import PrefillProgress, TokenEvent, TokenRequest

log = logging.getLogger(__name__)


class KeyRefusedError(PeerError):
    """The peer answered 401: it belongs to another cluster (another key), or its clock is
    more than ``signing.CLOCK_SKEW_S`` off (the message says which)."""


class PeerClient:
    """Node-to-node calls (``host:port`` addresses). Use inside the node's event loop.

    Args:
        signing_key: the cluster's signing key (:func:`shardline.node.signing.signing_key`).
        own_address: this node's ``host:port``, named in polls (:data:`MEMBER_HEADER`).
    """

    def __init__(self, signing_key: bytes, own_address: str) -> None:
        self.own_address = own_address
        self.key = signing_key
        self.auth = SignedAuth(signing_key)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None), auth=self.auth)

    def _check(self, response: httpx.Response, where: str, streamed: bool = False) -> None:
        try:
            check_answer(self.key, response, streamed)
        except SignatureError as exc:
            raise PeerError(f"{where}: {exc}") from exc

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _call(
        self,
        method: str,
        address: str,
        path: str,
        *,
        ok: tuple[int, ...] = (200,),
        timeout: float = 10.0,
        message: pydantic.BaseModel | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        if message is not None:  # the body: a wire message as JSON
            kwargs["content"] = message.model_dump_json()
            kwargs["headers"] = {**kwargs.get("headers", {}), "Content-Type": "application/json"}
        try:
            response = await self.http.request(method, f"http://{address}{path}", timeout=timeout, **kwargs)
        except httpx.HTTPError as exc:
            raise PeerError(f"{method} {address}{path}: {exc!r}") from exc
        if response.status_code == 401:
            raise KeyRefusedError(f"{address} refused this node's signature: {_detail(response)}")
        self._check(response, f"{method} {address}{path}")
        if response.status_code not in ok:
            raise PeerError(f"{method} {address}{path}: {response.status_code} {response.text[:200]}")
        return response

    @staticmethod
    def _parse(model: type[pydantic.BaseModel], response: httpx.Response, where: str):
        try:
            return model.model_validate_json(response.content)
        except pydantic.ValidationError as exc:
            raise PeerError(f"{where}: not a {model.__name__}: {exc}") from exc

    async def info(self, address: str, timeout: float = 2.0) -> NodeInfo:
        """Poll a peer (``GET /internal/info``), naming this node as a member."""
        response = await self._call(
            "GET", address, "/internal/info", timeout=timeout, headers={MEMBER_HEADER: self.own_address}
        )
        return self._parse(NodeInfo, response, address)

    async def state(self, address: str) -> ClusterState:
        """The instance table a peer holds (``GET /internal/state``)."""
        return self._parse(StateMessage, await self._call("GET", address, "/internal/state"), address).state()

    async def push_state(self, address: str, state: ClusterState) -> bool:
        """Send a table (``POST /internal/state``); whether the peer adopted it (False: it
        holds a newer or the same epoch)."""
        response = await self._call("POST", address, "/internal/state", ok=(200, 409), message=StateMessage.of(state))
        self._parse(StateReply, response, address)
        return response.status_code == 200

    async def free_port(self, address: str) -> int:
        """A TCP port free on the peer now (``GET /internal/free-port``)."""
        return self._parse(FreePort, await self._call("GET", address, "/internal/free-port"), address).port

    async def report(self, address: str, report: RankReport) -> bool:
        """Report a rank's status to the coordinator at ``address``; False when that node
        does not coordinate (503)."""
        response = await self._call("POST", address, "/internal/runner-status", ok=(200, 503), message=report)
        return response.status_code == 200

    async def keep_alive(self, address: str, message: KeepAliveMessage) -> bool:
        """Ask the coordinator at ``address`` to keep instances (``POST
        /internal/keep-alive``); False when that node does not coordinate (503)."""
        response = await self._call("POST", address, "/internal/keep-alive", ok=(200, 503), message=message)
        return response.status_code == 200

    async def share_response(self, address: str, message: SharedResponse | ForgottenResponse) -> bool:
        """Give the peer a stored response, or tell it one was deleted; whether it kept
        (or held) it."""
        path = "/internal/responses" if isinstance(message, SharedResponse) else "/internal/responses/forget"
        response = await self._call("POST", address, path, message=message)
        return self._parse(Delivered, response, address).delivered

    async def deliver(self, address: str, message: TaskMessage | CancelMessage) -> bool:
        """Hand a task or cancellation to the peer's runner of the instance; whether it
        took it."""
        path = "/internal/tasks" if isinstance(message, TaskMessage) else "/internal/cancel"
        response = await self._call("POST", address, path, message=message)
        return self._parse(Delivered, response, address).delivered

    async def generate(
        self, address: str, request: TokenRequest, ran_on: Callable[[str], None] | None = None
    ) -> AsyncGenerator[TokenEvent | PrefillProgress, None]:
        """Run ``request`` through the peer (``POST /internal/generate``) and yield its
        events; ``ran_on`` is called with the id of each instance the peer runs it on,
        before that instance's events.

        Raises:
            PeerError: the peer could not be reached, or refused the request.
            QueueFullError: the peer refused it with 429 (as many requests wait there as
                it queues).
            InstanceFailedError: the request failed there (the peer's error, which names
                the rank that failed; ``final``: the peer has waited for the model to be
                served again).
        """
        body = json.dumps(dataclasses.asdict(request))
        try:
            async with self.http.stream(
                "POST",
                f"http://{address}/internal/generate",
                content=body,
                headers={"Content-Type": "application/json"},
            ) as response:
                if response.status_code == 429:
                    raise QueueFullError(
                        f"{address}: the model's queue is full; retry later",
                        retry_after(response.headers.get("retry-after")),
                    )
                if response.status_code != 200:
                    raise PeerError(f"{address} refused the request: {response.status_code}")
                self._check(response, f"{address}/internal/generate", streamed=True)
                async for raw in response.aiter_lines():
                    if not raw:
                        continue
                    line = self._parse_line(raw, address)
                    if line.error is not None:
                        codes = {c.value: c for c in EndCode}
                        raise InstanceFailedError(
                            line.error, codes.get(line.code or "", EndCode.INSTANCE_FAILED), final=True
                        )
                    if line.instance_id is not None and ran_on is not None:
                        ran_on(line.instance_id)
                    event = line.token or line.progress
                    if event is not None:
                        yield event
        except httpx.HTTPError as exc:
            raise PeerError(f"lost {address}: {exc!r}") from exc

    @staticmethod
    def _parse_line(raw: str, address: str) -> StreamLine:
        try:
            return StreamLine.model_validate_json(raw)
        except pydantic.ValidationError as exc:
            raise PeerError(f"{address}: not a stream line: {exc}") from exc

    async def manifest(self, address: str, model_id: str) -> Manifest | None:
        """A model's manifest from the peer's store (None: it does not hold the model),
        checked by ``Manifest.from_dict`` (no file path leaves the model's directory).

        Raises:
            PeerError: the call failed, or the answer is not a safe manifest of ``model_id``
                (the reason is logged too).
        """
        response = await self._call(
            "GET", address, "/internal/models/manifest", ok=(200, 404), params={"model": model_id}
        )
        if response.status_code == 404:
            return None
        try:
            manifest = Manifest.from_dict(response.json())
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("refused the manifest of %s from %s: %s", model_id, address, exc)
            raise PeerError(f"{address}: not a manifest: {exc}") from exc
        if manifest.model_id != model_id:
            log.warning("refused the manifest of %s from %s: it is %s's", model_id, address, manifest.model_id)
            raise PeerError(f"{address}: sent the manifest of {manifest.model_id!r} for {model_id!r}")
        return manifest

    async def measure_link(self, address: str) -> dict:
        """Latency and bandwidth to the peer (a 1 MiB upload), by
        :func:`shardline.node.link_probe.measure_link`."""
        try:
            return await measure_link(self.http, f"http://{address}", payload_bytes=2**20)
        except (httpx.HTTPError, ValueError) as exc:
            raise PeerError(f"link to {address}: {exc!r}") from exc

    async def copy_files(
        self,
        address: str,
        store: ModelStore,
        manifest: Manifest,
        paths: list[str],
        progress: CopyProgress | None = None,
        pieces: dict[str, list[Piece]] | None = None,
    ) -> int:
        """Copy a model's files ``paths`` whole, and ``pieces`` of its files held in part,
        from the peer's store into ``store``, in a worker thread
        (:func:`shardline.node.transfer.fetch_files` and ``fetch_pieces``: resumable,
        checked by SHA-256); the bytes received.

        Raises:
            TransferError: a file arrived wrong, the peer lacks it, or a file would lie
                outside the model's directory in the store (refused, nothing written there).
            PeerError: the connection failed (what arrived is kept for a resume).
        """

        def copy() -> int:
            with httpx.Client(auth=self.auth) as client:
                received = fetch_files(client, f"http://{address}", store, manifest, paths, progress)
                if pieces:
                    received += fetch_pieces(client, f"http://{address}", store, manifest, pieces, progress)
                return received

        try:
            return await asyncio.to_thread(copy)
        except httpx.HTTPError as exc:
            raise PeerError(f"copy from {address}: {exc!r}") from exc
        except UnsafePathError as exc:
            raise TransferError(f"copy from {address} refused: {exc}") from exc

    async def forward(self, method: str, address: str, path: str, body: dict | None) -> tuple[int, Any]:
        """A cluster-API request sent on to another node (the coordinator): its status
        and JSON body.

        Raises:
            PeerError: the node could not be reached or did not answer JSON.
        """
        try:
            response = await self.http.request(method, f"http://{address}{path}", json=body, timeout=60.0)
            self._check(response, f"{method} {address}{path}")
            return response.status_code, response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise PeerError(f"{method} {address}{path}: {exc!r}") from exc


def _detail(response: httpx.Response) -> str:
    """The reason in a refusal's JSON body (``{"detail": ...}``), or its status."""
    try:
        return str(response.json()["detail"])
    except (ValueError, KeyError, TypeError):
        return str(response.status_code)
