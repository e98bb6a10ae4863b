"""Model logistics: model cards and tokenizers, manifests, and copying a rank's files
from the peers that hold them into this node's store. The role reads the node through
:class:`LogisticsView`, talks to peers through :class:`ModelPeers`
(``shardline.node.peer_client.PeerClient``) and acts through :class:`LogisticsEffects`
(``shardline.node.node`` wires them); it holds the node's tokenizers."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shardline.models.confine import resolve_under
from shardline.models.file_pieces import Piece
from shardline.models.rank_reads import RankReads
from shardline.models.store import (
    DEFAULT_MODEL_ID,
    Manifest,
    ModelCard,
    ModelNotFoundError,
    ModelStore,
    ModelStoreError,
    check_model_id,
    looks_like_path,
    shown,
)
from shardline.models.tokenizer import Tokenizer
from shardline.node.peer_client import PeerError
from shardline.node.table import Instance, Peer, RankPlacement
from shardline.node.transfer import CopyProgress, TransferError, what_peer_serves

log = logging.getLogger(__name__)

GGUF_HEADER_TIMEOUT_S = 300


class LogisticsView(Protocol):
    """What logistics reads of its node (read-only)."""

    @property
    def node_id(self) -> str: ...
    @property
    def peers(self) -> Mapping[str, Peer]: ...
    @property
    def instances(self) -> Mapping[str, Instance]: ...
    def live_node_ids(self) -> list[str]: ...


class ModelPeers(Protocol):
    """What logistics asks of peers (``shardline.node.peer_client.PeerClient``)."""

    async def manifest(self, address: str, model_id: str) -> Manifest | None: ...
    async def copy_files(
        self,
        address: str,
        store: ModelStore,
        manifest: Manifest,
        paths: list[str],
        progress: CopyProgress | None = None,
        pieces: dict[str, list[Piece]] | None = None,
    ) -> int: ...


@dataclass(frozen=True)
class LogisticsEffects:
    """What logistics asks of the node and the other roles."""

    poll: Callable[[str], Awaitable[bool]]
    """Poll a peer now (its store's summary; the membership)."""
    background: Callable[[Coroutine[object, object, object]], None]
    """Run a coroutine as a task of the node's."""
    report_fetching: Callable[[str, int, int], Coroutine[object, object, None]]
    """Report a rank's copy progress: ``(instance_id, done_bytes, total_bytes)`` (the
    supervisor)."""


class ModelLogistics:
    """Model cards, tokenizers and model files for this node. One per node.

    Args:
        view: the node, read.
        store: this node's model store.
        model_dirs: the directories a request may name a local model under (the store's
            first).
        peers: the peer client.
        effects: what it asks of the node.
    """

    def __init__(
        self,
        view: LogisticsView,
        store: ModelStore,
        model_dirs: list[Path],
        peers: ModelPeers,
        effects: LogisticsEffects,
    ) -> None:
        self.view = view
        self.store = store
        self.model_dirs = model_dirs
        self.peer_client = peers
        self.effects = effects
        self.tokenizers: dict[str, Tokenizer] = {}
        self._warming: set[str] = set()  # model ids whose tokenizer warm_tokenizer loads
        self._tokenizer_locks: dict[str, asyncio.Lock] = {}  # per model: one load, others wait
        self._fetch_lock = asyncio.Lock()

    def warm_tokenizer(self, model_id: str) -> None:
        """Load a model's tokenizer in the background, unless loaded or loading. The node
        of an instance's rank 0 does so when the instance is placed (the first requests
        of ``shardline cluster`` go there); the other nodes of its ranks once idle, not to
        take the CPU a load or the first requests need (transformers' import alone is
        2.5 s of CPU); a request on a node without it loads it first."""
        if model_id in self.tokenizers or model_id in self._warming:
            return
        self._warming.add(model_id)

        async def warm() -> None:
            try:
                await self.tokenizer(model_id)
            except (ModelNotFoundError, TransferError, PeerError, OSError, ValueError) as exc:
                log.warning("could not load the tokenizer of %s: %s", model_id, exc)
            finally:
                self._warming.discard(model_id)

        self.effects.background(warm())

    async def shard_weights(self, inst: Instance, rank: int, placement: RankPlacement) -> Path:
        """The local path the runner of ``rank`` opens, after copying from peers what it
        reads that this node's store lacks (:mod:`shardline.models.rank_reads`): the files
        of its shard, and of a GGUF file the header and its tensors' pieces (progress goes
        to the coordinator).

        Raises:
            ModelNotFoundError: no live node has the files.
            TransferError, PeerError: every copy failed.
        """
        return await self._weights(
            inst.model_id, inst.instance_id, lambda layers: RankReads.of(inst.sharding, rank, placement.share, layers)
        )

    async def draft_weights(self, inst: Instance) -> Path:
        """The local path of ``inst``'s draft model (:mod:`shardline.runner.draft_model`),
        which its sampling rank on this node reads whole, after copying from peers what
        this node's store lacks (progress goes to the coordinator, as the shard's).

        Raises:
            ModelNotFoundError: no live node has the files.
            TransferError, PeerError: every copy failed.
        """
        assert inst.draft_model is not None
        return await self._weights(inst.draft_model, inst.instance_id, RankReads.whole)

    async def _weights(self, model_id: str, instance_id: str, reads_of: Callable[[int], RankReads]) -> Path:
        """The local path of ``model_id``'s weights, once this node holds what a rank that
        reads ``reads_of(the model's layer count)`` reads (progress reported for
        ``instance_id``)."""
        if model_id == DEFAULT_MODEL_ID:
            return self.store.weights_path(model_id)
        manifest = await self.manifest(model_id)
        reads = reads_of(int(manifest.config["num_layers"]))

        loop = asyncio.get_running_loop()

        def progress(done: int, total: int) -> None:  # called from the copy's thread
            report = self.effects.report_fetching(instance_id, done, total)
            asyncio.run_coroutine_threadsafe(report, loop)

        await self._fetch(manifest, manifest.shard_files(reads), progress, manifest.shard_pieces(reads))
        return self.store.weights_path(model_id)

    async def manifest(self, model_id: str) -> Manifest:
        """The model's manifest from this node's store, else from a live peer's.

        Raises:
            ModelNotFoundError: no live node's store has the model.
        """
        manifest = self.store.manifest(model_id)
        if manifest is not None:
            return manifest
        for peer in await self._peers_holding(lambda models: model_id in models):
            try:
                manifest = await self.peer_client.manifest(peer.address, model_id)
                if manifest is not None:
                    return manifest
            except PeerError as exc:
                log.warning("manifest of %s from %s: %s", model_id, peer.node_id, exc)
        raise ModelNotFoundError(
            f"model {model_id!r} is not on any node: add it with `shardline models add {model_id}` "
            f"(a Hugging Face repo id) or `shardline models add PATH` (a .gguf file or a safetensors "
            f"directory) on one node"
        )

    async def _peers_holding(self, holds) -> list[Peer]:
        """The live peers whose store summary satisfies ``holds(models)``; when none does,
        after polling them all once (a model added a moment ago is in no summary yet)."""
        for attempt in range(2):
            live = set(self.view.live_node_ids())
            found = [p for p in self.view.peers.values() if p.node_id in live and holds(p.models)]
            if found or attempt:
                return found
            await self.refresh_peers()
        return []

    async def cluster_models(self) -> list[dict]:
        """Every model a live node holds (and the embedded default), by id: ``{"model_id",
        "format", "total_bytes", "embedded", "complete_on", "partial_on" (node ids holding
        all of its files, or some), "added_at" (the earliest a node holding it all added
        it, seconds since the epoch; None for the embedded one), "instances"}``; the peers
        asked afresh."""
        node = self.view
        await self.refresh_peers()
        live = set(node.live_node_ids())
        stores = {node.node_id: self.store.summary()}
        stores.update({p.node_id: p.models for p in node.peers.values() if p.node_id in live})
        out: dict[str, dict] = {
            DEFAULT_MODEL_ID: {
                "model_id": DEFAULT_MODEL_ID,
                "format": "gguf",
                "total_bytes": None,
                "embedded": True,
                "complete_on": sorted(live),
                "partial_on": [],
                "added_at": None,
            }
        }
        for node_id, summary in stores.items():
            for model_id, entry in summary.items():
                view = out.setdefault(
                    model_id,
                    {
                        "model_id": model_id,
                        "format": entry["format"],
                        "total_bytes": entry["total_bytes"],
                        "embedded": False,
                        "complete_on": [],
                        "partial_on": [],
                        "added_at": None,
                    },
                )
                complete = entry.get("complete", False)
                view["complete_on" if complete else "partial_on"].append(node_id)
                added = entry.get("added_at")
                if complete and added is not None and not view["embedded"]:
                    view["added_at"] = min(added, view["added_at"] or added)
        for view in out.values():
            view["instances"] = [
                {"instance_id": i.instance_id, "status": i.status}
                for i in node.instances.values()
                if i.model_id == view["model_id"]
            ]
        return sorted(out.values(), key=lambda v: v["model_id"])

    async def refresh_peers(self) -> None:
        """Poll every live peer now, rather than within the second (their stores, memory)."""
        live = set(self.view.live_node_ids())
        await asyncio.gather(*(self.effects.poll(p.address) for p in self.view.peers.values() if p.node_id in live))

    async def _fetch(
        self, manifest: Manifest, paths: list[str], on_progress=None, pieces: dict[str, list[Piece]] | None = None
    ) -> None:
        """Copy what this store lacks of ``paths`` (whole files) and ``pieces`` (of files
        held in part: :mod:`shardline.models.sparse_file`) of a model from live peers:
        each peer in turn, most of it first, copies what it holds of what is still
        missing (a broken copy resumes from the next; a piece a peer holds in part comes
        from a peer that holds it, or the file whole).

        Raises:
            ModelNotFoundError: no live peer has some of it.
            TransferError, PeerError: the last peer's copy failed, and some is still missing.
        """
        pieces = pieces or {}
        store, model_id = self.store, manifest.model_id

        def lacking() -> tuple[list[str], dict[str, list[Piece]]]:
            return store.missing(model_id, paths), store.missing_pieces(manifest, pieces)

        def size(files: list[str], parts: dict[str, list[Piece]]) -> int:
            return sum(manifest.file(f).size for f in files) + sum(p.size for ps in parts.values() for p in ps)

        async with self._fetch_lock:  # one copy at a time: a tokenizer and a shard share files
            files, parts = lacking()
            if not files and not parts:
                return
            first = (files, parts)
            holders = await self._peers_holding(
                lambda models: any(what_peer_serves(models.get(model_id, {}), files, parts))
            )
            holders.sort(key=lambda p: -size(*what_peer_serves(p.models.get(model_id, {}), files, parts)))
            total = size(paths, pieces)
            progress = CopyProgress(f"copying {model_id}", total, on_progress)
            error: Exception = ModelNotFoundError(
                f"no live node has {', '.join(files + list(parts))} of {model_id} (or the parts a rank reads)"
            )
            try:
                for peer in holders:
                    served = what_peer_serves(peer.models.get(model_id, {}), files, parts)
                    if not any(served):
                        continue
                    progress.done = total - size(files, parts)  # what is here already
                    try:
                        received = await self.peer_client.copy_files(
                            peer.address, store, manifest, served[0], progress, served[1]
                        )
                        log.info("copied %d bytes of %s from %s", received, model_id, peer.node_id)
                    except (TransferError, PeerError) as exc:
                        log.warning("copying %s from %s failed: %s", model_id, peer.node_id, exc)
                        error = exc
                    files, parts = lacking()
                    if not files and not parts:
                        await self._parse_gguf_headers(manifest, first[0] + list(first[1]))
                        return
            finally:
                progress.close()
            raise error

    async def _parse_gguf_headers(self, manifest: Manifest, paths: list[str]) -> None:
        """Parse the metadata of each copied ``.gguf`` file once, in a short-lived process
        (:mod:`shardline.models.gguf_header`), so that the runners that load it find it
        cached rather than each paying the parse's transient memory while loading. A
        failure is logged: the runner then parses it itself."""
        for path in paths:
            if not path.endswith(".gguf"):
                continue
            file = self.store.model_dir(manifest.model_id) / path
            command = [sys.executable, "-m", "shardline.models.gguf_header", str(file)]
            try:
                await asyncio.to_thread(
                    subprocess.run, command, check=True, capture_output=True, timeout=GGUF_HEADER_TIMEOUT_S
                )
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("parsing %s's metadata ahead of its runners failed: %s", file, exc)

    async def adopt(self, model: str | None) -> str:
        """The model id for what a request names, taking what only this machine has into
        this node's store (whence the others copy it): a local path (a ``.gguf`` file or a
        safetensors directory) whose real path lies under one of the node's model
        directories (``--model-dir``, and the store), or a repo id in this machine's Hugging
        Face cache that no node's store holds. The default for None is the embedded default
        model. A name that looks like a path (:func:`looks_like_path`) but lies elsewhere is
        refused with one message, whether or not it exists (the reason is logged).

        Raises:
            ModelStoreError, UnsupportedModelError: a path outside the model directories,
                one under them that is not a model shardline can run, or a name that is
                neither a path nor a model id.
        """
        model = model or DEFAULT_MODEL_ID
        if self.held(model):
            return model
        try:
            local = resolve_under(model, self.model_dirs)
            exists = local is not None and local.exists()
        except OSError:  # not a name a path can have (too long: ENAMETOOLONG)
            local, exists = None, False
        if local is not None and (exists or looks_like_path(model)):
            try:
                return (await asyncio.to_thread(self.store.add_local, model, None, self.model_dirs)).model_id
            except OSError as exc:
                raise ModelStoreError(f"cannot read the model at {shown(model)}: {exc.strerror}") from exc
        if looks_like_path(model):
            log.warning(
                "refused to take in %r: its real path is under none of the model directories %s",
                model,
                [str(d) for d in self.model_dirs],
            )
            raise ModelStoreError(
                f"model {shown(model)} is not a model id known to the cluster, nor a path under a --model-dir"
            )
        check_model_id(model)  # neither a path nor an id: a clear 400, not a failed lookup
        if "/" in model:
            try:
                return (await asyncio.to_thread(self.store.add_from_hub, model, False)).model_id
            except (ModelNotFoundError, ModelStoreError):
                pass
        return model

    async def check_whole(self, model_id: str) -> None:
        """Check that a live node holds every file of ``model_id`` (the embedded default:
        every node), so that each rank can get its shard: a node that copied only a
        model's tokenizer lists it as well, and a placement from that alone would fail in
        the background on every try.

        Raises:
            ModelNotFoundError: no live node holds it whole (naming the nodes with part).
        """
        if model_id == DEFAULT_MODEL_ID:
            return
        mine = self.store.summary().get(model_id, {})
        if mine.get("complete"):
            return
        await self.refresh_peers()  # their summaries are up to a second old: an add, a remove
        live = set(self.view.live_node_ids())
        holders = {
            p.node_id: p.models.get(model_id, {})
            for p in self.view.peers.values()
            if p.node_id in live and model_id in p.models
        }
        if any(h.get("complete") for h in holders.values()):
            return
        partial = sorted(([self.view.node_id] if mine else []) + list(holders))
        raise ModelNotFoundError(
            f"no live node holds all of model {model_id!r}'s files"
            + (f" (part of it is on {', '.join(partial)})" if partial else "")
            + ": add it again with `shardline models add` on a node"
        )

    def held(self, model_id: str) -> bool:
        """Whether ``model_id`` is the embedded default, in this node's store, or in a live
        peer's (as the peer last reported its store)."""
        live = set(self.view.live_node_ids())
        return (
            model_id == DEFAULT_MODEL_ID
            or self.store.manifest(model_id) is not None
            or any(model_id in p.models for p in self.view.peers.values() if p.node_id in live)
        )

    async def model_card(self, model_id: str) -> ModelCard:
        """A model's id and config, for placement: the embedded default, or a model in this
        node's store or a live peer's.

        Raises:
            ModelNotFoundError: none of these has it.
        """
        if model_id == DEFAULT_MODEL_ID or self.store.manifest(model_id) is not None:
            return await asyncio.to_thread(self.store.card, model_id)
        manifest = await self.manifest(model_id)
        return manifest.card()

    async def tokenizer(self, model_id: str) -> Tokenizer:
        """The tokenizer of a model, loaded once per node; a node without the model's
        tokenizer files copies them (not the weights) from a peer.

        Raises:
            ModelNotFoundError: no live node has the model.
            TransferError, PeerError: the copy failed.
        """
        if model_id in self.tokenizers:
            return self.tokenizers[model_id]
        async with self._tokenizer_locks.setdefault(model_id, asyncio.Lock()):  # one model's loads wait
            if model_id not in self.tokenizers:
                if model_id != DEFAULT_MODEL_ID:
                    manifest = await self.manifest(model_id)
                    await self._fetch(manifest, manifest.tokenizer_files())
                self.tokenizers[model_id] = await asyncio.to_thread(
                    lambda: Tokenizer(self.store.tokenizer_path(model_id))
                )
            return self.tokenizers[model_id]
