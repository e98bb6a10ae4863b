"""A shardline node: membership, the replicated instance table, placement, request routing.

One node runs per machine and never runs model code itself (its runners do). Nodes talk
over HTTP (``/internal/*``):

- membership: every node polls its peers' ``/internal/info`` each second, naming itself
  (:data:`MEMBER_HEADER`); the polled node adds it to its peers and answers with the
  members it knows, so a node that contacts one member joins all of them. A node silent
  for ``down_after_s`` is down. The coordinator is the live node with the smallest id,
  once settled (``shardline.node.cluster_state``: terms, epochs and their invariants).
- instances: the coordinator places a model, writes the instance table, and pushes it to
  every node (``/internal/state``) with its epoch; a node adopts only a newer epoch and
  keeps the table on disk. Each node reconciles its runners with the table (starts the
  ranks placed on it, stops those no longer there) and reports runner status back.
- requests: the node that takes a request hands the task to every rank's node
  (``/internal/tasks``); its own runner streams the tokens back. A node that hosts no rank
  of the instance forwards the request to one that does (``/internal/generate``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import signal
import socket
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from dataclasses import dataclass, field

import httpx
import psutil

from shardline.models.config import ModelConfig, Quantize, Sharding
from shardline.models.store import (
    DEFAULT_MODEL_ID,
    Manifest,
    ModelCard,
    ModelNotFoundError,
    ModelStore,
    ModelStoreError,
    looks_like_path,
)
from shardline.models.tokenizer import Tokenizer
from shardline.node.transfer import CopyProgress, TransferError, fetch_files
from shardline.node.worker import Worker
from shardline.machine_cache import write_atomically
from shardline.node.cluster_state import (
    Epoch,
    RejoinView,
    lost_instances,
    newer,
    next_term,
    paused,
    rejoinable,
    settled,
)
from shardline.placement.pipeline import NodeCapacity, PlacementError
from shardline.placement.memory import committed_bytes, free_bytes, runtime_baseline
from shardline.placement.ranks import (
    SHARDINGS,
    kv_tokens_for_bytes,
    place_with_kv_pool,
    rank_bytes,
    ring_prefill_chunk,
)
from shardline.runner.protocol import (
    Cancel,
    EngineStats,
    Failed,
    Loaded,
    RunnerSpec,
    SamplingParams,
    Task,
    PrefillProgress,
    TokenEvent,
    Tokens,
)

log = logging.getLogger(__name__)



class NoInstanceError(LookupError):
    """No ready instance serves the requested model."""


class InstanceFailedError(RuntimeError):
    """The instance serving a request failed while the request was in flight."""


MEMBER_HEADER = "X-Shardline-Node"
"""The header a node's poll carries its own address in: the polled member adds it to its
peers (a node that knows one member becomes known to all)."""


@dataclass
class RankPlacement:
    node_id: str
    address: str
    layer_start: int
    layer_end: int
    tensor_share: dict | None = None  # tensor sharding: heads, KV heads and MLP columns
    status: str = "loading"  # loading | fetching | ready | failed | stopped (another rank failed)
    error: str | None = None
    loaded: dict | None = None  # the runner's Loaded report: layers and bytes it read
    fetched: dict | None = None  # while its node copies the shard's files: done_bytes, total_bytes
    estimated_bytes: int = 0  # what placement counts this rank to hold (placement.ranks.rank_bytes)
    incarnation: float = 0.0  # its node's start time when placed (the rank dies with the node)


@dataclass
class Instance:
    """A model placed on an ordered list of nodes (rank i on ``ranks[i]``)."""

    instance_id: str
    model_id: str
    sharding: Sharding
    ranks: list[RankPlacement]
    master_addr: str
    master_port: int
    context: int
    max_batch: int
    dtype: str = "bfloat16"  # compute dtype of every rank
    kv_tokens: int = 0  # tokens its KV pool holds, all sequences together (0: max_batch x context)
    kv_cache_bytes: int | None = None  # the pool size asked for when placing (None: what fits)
    quantize: str | None = None  # "int8" | "int4": 16/32-bit weights quantized on load
    status: str = "loading"  # loading | ready | failed
    error: str | None = None
    created_at: float = field(default_factory=time.time)
    ready_at: float | None = None
    retries: int = 0  # placements of this model that failed before serving, in a row
    wanted_nodes: list[str] = field(default_factory=list)  # placed on before nodes were lost
    force: bool = False  # placed without memory admission (and placed again so)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Instance":
        data = dict(data)
        data["ranks"] = [RankPlacement(**r) for r in data["ranks"]]
        data["sharding"] = Sharding(data["sharding"])
        return cls(**data)

    def node_ids(self) -> list[str]:
        return [r.node_id for r in self.ranks]


@dataclass
class Peer:
    node_id: str
    address: str
    last_seen: float
    available_bytes: int = 0
    total_bytes: int = 0
    profile: dict | None = None  # its HostProfile (shardline.node.profile)
    links: dict[str, dict] = field(default_factory=dict)  # its measured links, by node id
    models: dict[str, dict] = field(default_factory=dict)  # its ModelStore.summary()
    offered_bytes: int = 0  # what it offers to models in all (its limit, or what is free)
    started_at: float = 0.0  # its incarnation: a restart changes it
    epoch: Epoch = field(default_factory=Epoch)  # of the table it holds
    busy: tuple[str, ...] = ()  # instances with requests running or waiting on its ranks


@dataclass
class _Stream:
    instance_id: str
    queue: asyncio.Queue


class Node:
    """The node process's state and behaviour (the HTTP layer is in ``shardline.node.app``).

    Args:
        host: the address peers and runners of other nodes use to reach this node.
        port: its HTTP port.
        peers: ``host:port`` of other nodes to poll.
        mdns: also find peers of the same cluster on the LAN by mDNS.
        node_id: this node's lasting id (``shardline.node.identity.node_id``).
        cluster_key: the shared secret every node-to-node request carries.
        store: this node's model store; a rank whose files are not in it copies them from
            a peer's (``shardline.node.transfer``).
        memory_limit_bytes: the most memory this node offers to models (None: all that is
            available).
        runner_threads: torch threads per runner (0: torch's default).
        watchdog_s: a runner silent this many seconds is killed and its instance fails.
        progress_timeout_s: a runner that waits this many seconds inside an engine step
            without progress (a stalled peer or collective) fails its instance.
        context, max_batch: defaults for new instances (tokens per sequence, sequences).
    """

    def __init__(
        self,
        host: str,
        port: int,
        peers: list[str],
        node_id: str,
        cluster_key: str,
        store: ModelStore,
        memory_limit_bytes: int | None = None,
        runner_threads: int = 0,
        context: int = 4096,
        max_batch: int = 8,
        down_after_s: float = 5.0,
        exit_with_parent: bool = False,
        watchdog_s: float = 10.0,
        progress_timeout_s: float = 60.0,
        mdns: bool = False,
        state_path: Path | None = None,
        rejoin: bool = True,
    ) -> None:
        self.node_id = node_id
        self.cluster_key = cluster_key
        self.store = store
        self.memory_limit_bytes = memory_limit_bytes
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        self.peer_addresses = [p for p in peers if p and p != self.address]
        self.peers: dict[str, Peer] = {}
        self.runner_threads = runner_threads
        self.progress_timeout_s = progress_timeout_s
        self.default_context = context
        self.default_max_batch = max_batch
        self.down_after_s = down_after_s
        self.exit_with_parent = exit_with_parent
        self.max_replacements = 3
        self.rejoin = rejoin  # place an instance again on its returning nodes (rule 6)
        self.started_at = time.time()
        self.instances: dict[str, Instance] = {}
        self.epoch = Epoch()  # of the instance table held (cluster_state)
        self.state_path = state_path  # where the table and its epoch are kept
        self._acting_term: int | None = None  # the term this node coordinates, if it does
        self._settled_since = self.started_at  # start, or resumption from a pause
        self._heard_all_at: float | None = None  # the last round every peer answered
        self._last_tick = self.started_at
        self._load_state()
        self.worker = Worker(self._on_runner_message, watchdog_s=watchdog_s)
        self.streams: dict[int, _Stream] = {}
        self.engine_stats: dict[str, dict] = {}  # instance id -> this node's rank's batch
        self.tokenizers: dict[str, Tokenizer] = {}
        self._tokenizer_lock: asyncio.Lock | None = None
        self._fetch_lock: asyncio.Lock | None = None
        self._preparing: dict[str, asyncio.Task] = {}  # instance id -> getting its files
        self._task_counter = itertools.count()
        self._salt = zlib.crc32(self.node_id.encode()) & 0x3FF
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: httpx.AsyncClient | None = None
        self._background: list[asyncio.Task] = []
        self._state_lock = asyncio.Lock()
        self._refused: set[str] = set()  # peer addresses that refused our cluster key
        self.profile: dict | None = None  # HostProfile.to_dict(), measured once per machine
        self.links: dict[str, dict] = {}  # node id -> measure_link result from this node
        self._link_measured: dict[str, float] = {}
        self.discovery = None
        if mdns:
            from shardline.node.discovery import Discovery

            self.discovery = Discovery(node_id, host, port, cluster_key, self.add_peer)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tokenizer_lock, self._fetch_lock = asyncio.Lock(), asyncio.Lock()
        # Every node-to-node request carries the cluster key (see shardline.node.identity).
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None),
                                       headers={"Authorization": f"Bearer {self.cluster_key}"})
        self._background.append(asyncio.create_task(self._membership_loop()))
        self._background.append(asyncio.create_task(self._profile_host()))
        if self.discovery is not None:
            try:
                await asyncio.to_thread(self.discovery.start)
            except OSError as exc:
                log.warning("mDNS discovery is off (%s); use --peers", exc)
                self.discovery = None
        if self.exit_with_parent:
            self._background.append(asyncio.create_task(self._watch_parent(os.getppid())))

    async def stop(self) -> None:
        for task in self._background:
            task.cancel()
        if self.discovery is not None:
            await asyncio.to_thread(self.discovery.stop)
        self.worker.stop_all()
        if self._http is not None:
            await self._http.aclose()

    async def _watch_parent(self, parent: int) -> None:
        """Shut down (as on Ctrl-C) once the process that started this node is gone."""
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        log.warning("parent process %d is gone; stopping", parent)
        os.kill(os.getpid(), signal.SIGINT)

    # -- membership ----------------------------------------------------------------------

    def info(self) -> dict:
        available = self._available_bytes(self.node_id)
        profile = None
        if self.profile is not None:
            profile = dict(self.profile, available_bytes=available)
        return {
            "node_id": self.node_id,
            "address": self.address,
            "started_at": self.started_at,
            "available_bytes": available,
            **self.memory_of(self.node_id),
            "total_bytes": int(psutil.virtual_memory().total),
            "memory_limit_bytes": self.memory_limit_bytes,
            "models": self.store.summary(),
            "epoch": self.epoch.to_dict(),
            "coordinator": self.coordinator_id(),
            "settled": self.is_settled(),
            "profile": profile,
            "links": self.links,
            "members": self.member_addresses(),
            "busy": self.busy_instances(),
        }

    def busy_instances(self) -> list[str]:
        """Instances whose rank on this node has requests running, waiting or held."""
        return sorted(i for i, stats in self.engine_stats.items()
                      if stats.get("running") or stats.get("waiting") or stats.get("held"))

    def member_addresses(self) -> list[str]:
        """Addresses of the live peers: told to every node that polls this one, so that a
        node that contacted one member comes to know (and be known by) all of them."""
        now = time.time()
        return sorted(p.address for p in self.peers.values() if now - p.last_seen < self.down_after_s)

    async def _profile_host(self) -> None:
        """Measure this machine once (matmul FLOP/s, memory bandwidth, accelerator, a
        runner's runtime) and keep it for a day in the data directory's
        ``host-profile-v<PROFILE_FORMAT>.json``, shared by every node on the machine (a
        profile of another format, measured otherwise, is measured again); memory figures
        are read live in :meth:`info`."""
        from shardline.node.identity import default_data_dir
        from shardline.node.profile import PROFILE_FORMAT, HostProfile, measure_host_async

        cache = default_data_dir() / f"host-profile-v{PROFILE_FORMAT}.json"
        try:
            if time.time() - cache.stat().st_mtime < 86_400:
                self.profile = HostProfile.from_dict(json.loads(cache.read_text())).to_dict()
                return
        except (OSError, ValueError):
            pass
        profile = await measure_host_async(seconds=0.3)
        self.profile = profile.to_dict()
        if not profile.note:
            try:
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps(self.profile))
            except OSError:
                pass

    async def _measure_link(self, node_id: str, address: str) -> None:
        """Latency and bandwidth from this node to a peer (1 MiB upload), every 60 s."""
        from shardline.node.profile import measure_link

        self._link_measured[node_id] = time.time()
        try:
            self.links[node_id] = await measure_link(self._http, f"http://{address}", payload_bytes=2**20)
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("could not measure the link to %s: %s", node_id, exc)

    def add_peer(self, address: str) -> None:
        """Poll ``host:port`` from now on (a peer found by mDNS, one that polled this node,
        or a member another member named; any thread). Anything else is ignored."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return
        if address != self.address and address not in self.peer_addresses:
            log.info("found peer %s", address)
            self.peer_addresses = self.peer_addresses + [address]

    def live_node_ids(self) -> list[str]:
        now = time.time()
        live = [p.node_id for p in self.peers.values() if now - p.last_seen < self.down_after_s]
        return sorted(live + [self.node_id])

    def coordinator_id(self) -> str:
        return self.live_node_ids()[0]

    def is_coordinator(self) -> bool:
        """Whether this node acts as coordinator: the smallest live id, settled, in a term
        it started."""
        return self.coordinator_id() == self.node_id and self._acting_term is not None

    def is_settled(self) -> bool:
        """Whether this node has heard the cluster for an election window since it
        started or resumed (cluster_state rule 3)."""
        return settled(time.time(), self._settled_since, self.down_after_s, self._heard_all_at)

    def incarnation_of(self, node_id: str) -> float:
        """A node's start time as last heard (this node's own for itself)."""
        return self.started_at if node_id == self.node_id else self.peers[node_id].started_at

    def address_of(self, node_id: str) -> str:
        if node_id == self.node_id:
            return self.address
        return self.peers[node_id].address

    async def _membership_loop(self) -> None:
        while True:
            now = time.time()
            if paused(now, self._last_tick, self.down_after_s):
                log.warning("this node was paused for %.0f s: it hears the cluster again "
                            "before it acts as coordinator", now - self._last_tick)
                self._settled_since, self._acting_term = now, None
            self._last_tick = now
            answered = await asyncio.gather(*(self._poll(a) for a in self.peer_addresses))
            self._last_tick = time.time()
            if all(answered):
                self._heard_all_at = self._last_tick
            if self.coordinator_id() != self.node_id:
                self._acting_term = None
            elif self._acting_term is None and self.is_settled():
                await self._start_term()
            if self.is_coordinator():
                await self._fail_lost_instances()
                if self.rejoin:
                    await self._rejoin_returned_nodes()
            await self._report_unknown_statuses()
            await asyncio.sleep(1.0)

    async def _start_term(self) -> None:
        """Become coordinator: a term above every one seen (cluster_state rule 2), then
        fail the instances whose ranks are gone, and publish."""
        term = next_term(self.epoch, [p.epoch for p in self.peers.values()])
        self.epoch, self._acting_term = Epoch(term, 0, self.node_id), term
        log.info("coordinator for term %d", term)
        await self._publish()
        for inst in [i for i in self.instances.values() if i.status == "failed"]:
            # failed before this term (perhaps while no node coordinated): place it again
            self._background.append(asyncio.create_task(self._replace(inst)))

    async def _fail_lost_instances(self) -> None:
        """Coordinator: fail the instances with a rank on a node that is down, or that
        restarted since the placement (cluster_state rule 5)."""
        live = set(self.live_node_ids())
        incarnations = {p.node_id: p.started_at for p in self.peers.values()}
        incarnations[self.node_id] = self.started_at
        active = [i for i in self.instances.values() if i.status != "failed"]
        restarted = lost_instances(
            {i.instance_id: [(r.node_id, r.incarnation) for r in i.ranks] for i in active},
            incarnations)
        for inst in active:
            down = [n for n in inst.node_ids() if n not in live]
            if down:
                for placement in inst.ranks:
                    if placement.node_id in down:
                        placement.status = "failed"
                await self._fail_instance(inst, f"node(s) {', '.join(down)} are down")
            elif inst.instance_id in restarted:
                gone = ", ".join(restarted[inst.instance_id])
                await self._fail_instance(inst, f"node(s) {gone} restarted: their ranks are gone")

    async def _rejoin_returned_nodes(self) -> None:
        """Coordinator: place an idle instance that runs on fewer nodes than it was placed
        on again on all of them, once they are all back (cluster_state rule 6). Its old
        ranks stop when the new table is published; if the new placement is refused the
        instance stays as it is and is not tried again."""
        live = self.live_node_ids()
        now = time.time()
        busy = set(self.busy_instances()).union(
            *(p.busy for p in self.peers.values() if now - p.last_seen < self.down_after_s))
        views = {i.instance_id: RejoinView(i.status, tuple(i.node_ids()), tuple(i.wanted_nodes),
                                           i.instance_id in busy)
                 for i in self.instances.values()}
        for instance_id in rejoinable(views, live):
            inst = self.instances.pop(instance_id)
            try:
                card = await self.model_card(inst.model_id)
                await self._place(card, inst.sharding, list(inst.wanted_nodes), inst.context,
                                  inst.max_batch, inst.dtype, inst.force, 0,
                                  inst.kv_cache_bytes, inst.quantize)
            except (PlacementError, ModelNotFoundError, httpx.HTTPError) as exc:
                log.warning("could not place %s on its returning node(s) again: %s",
                            inst.model_id, exc)
                inst.wanted_nodes = []
                self.instances[instance_id] = inst
                continue
            log.info("instance %s of %s: its node(s) are back; placed again on %s",
                     instance_id, inst.model_id, ", ".join(inst.wanted_nodes))

    async def _poll(self, address: str) -> bool:
        """Ask a peer for its info (and a newer table, when it holds one); whether it
        answered as a member."""
        try:
            response = await self._http.get(f"http://{address}/internal/info", timeout=2.0,
                                            headers={MEMBER_HEADER: self.address})
            if response.status_code == 401:
                if address not in self._refused:
                    self._refused.add(address)
                    log.warning("%s refused this node's cluster key: it belongs to another cluster", address)
                return False
            data = response.json()
            self._refused.discard(address)
        except (httpx.HTTPError, ValueError):
            return False
        try:
            epoch = Epoch.from_dict(data["epoch"])
        except (KeyError, TypeError, ValueError):
            return False  # not a node of this version
        self.peers[data["node_id"]] = Peer(
            data["node_id"], data["address"], time.time(),
            data["available_bytes"], data["total_bytes"], data.get("profile"), data.get("links") or {},
            data.get("models") or {},
            offered_bytes=data.get("offered_bytes", data["available_bytes"]),
            started_at=float(data.get("started_at") or 0.0), epoch=epoch,
            busy=tuple(str(i) for i in data.get("busy") or ()),
        )
        for member in data.get("members") or []:  # membership both ways, through any member
            if isinstance(member, str):
                self.add_peer(member)
        if time.time() - self._link_measured.get(data["node_id"], 0.0) > 60.0:
            self._background = [t for t in self._background if not t.done()]
            self._background.append(asyncio.create_task(self._measure_link(data["node_id"], address)))
        if newer(epoch, self.epoch):  # the newest table wins, whoever holds it (rule 4)
            try:
                state = (await self._http.get(f"http://{address}/internal/state")).json()
                await self.apply_state(state)
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return False
        return True

    # -- replicated instance table -------------------------------------------------------

    def state(self) -> dict:
        return {
            "epoch": self.epoch.to_dict(),
            "instances": [i.to_dict() for i in self.instances.values()],
        }

    async def apply_state(self, state: dict) -> bool:
        """Adopt a table of a newer epoch (cluster_state rule 1), keep it on disk and
        reconcile runners; False (nothing changes) for one not newer than this node's.

        Raises:
            KeyError, TypeError, ValueError: ``state`` is not a state.
        """
        epoch = Epoch.from_dict(state["epoch"])
        instances = {d["instance_id"]: Instance.from_dict(d) for d in state["instances"]}
        async with self._state_lock:
            if not newer(epoch, self.epoch):
                return False
            self.epoch, self.instances = epoch, instances
            if self._acting_term is not None and epoch.coordinator != self.node_id:
                self._acting_term = None  # another coordinator's newer table: start over
            self._save_state()
        await self._reconcile()
        return True

    async def _publish(self) -> None:
        """Coordinator: the next epoch of its term; keep the table on disk and push it to
        every live node. A node not (yet) acting as coordinator only reconciles."""
        if self.is_coordinator():
            self.epoch = self.epoch.next()
            self._save_state()
            state = self.state()
            targets = [self.address_of(n) for n in self.live_node_ids() if n != self.node_id]
            await asyncio.gather(
                *(self._post(f"http://{a}/internal/state", state) for a in targets)
            )
        await self._reconcile()

    def _save_state(self) -> None:
        """Keep the table and its epoch in ``state_path`` (rule 1 across restarts)."""
        if self.state_path is None:
            return
        try:
            write_atomically(self.state_path, json.dumps(self.state()))
        except OSError as exc:
            log.warning("could not keep the instance table in %s: %s", self.state_path, exc)

    def _load_state(self) -> None:
        """The table and epoch kept before a restart, as desired state: no runner starts
        from it until a coordinator publishes (its ranks died with the old process)."""
        if self.state_path is None or not self.state_path.exists():
            return
        try:
            data = json.loads(self.state_path.read_text())
            self.epoch = Epoch.from_dict(data["epoch"])
            self.instances = {d["instance_id"]: Instance.from_dict(d) for d in data["instances"]}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the kept instance table %s: %s", self.state_path, exc)

    async def _post(self, url: str, body: dict) -> httpx.Response | None:
        try:
            return await self._http.post(url, json=body, timeout=10.0)
        except httpx.HTTPError as exc:
            log.warning("POST %s failed: %s", url, exc)
            return None

    async def _reconcile(self) -> None:
        """Start runners for ranks placed here; stop runners of instances gone or failed."""
        wanted = {}
        for inst in self.instances.values():
            if inst.status == "failed":
                continue
            for rank, placement in enumerate(inst.ranks):
                if placement.node_id == self.node_id:
                    wanted[inst.instance_id] = (inst, rank, placement)
        for instance_id, task in list(self._preparing.items()):
            if instance_id not in wanted:
                task.cancel()
                self._preparing.pop(instance_id, None)
        for instance_id in list(self.worker.runners):
            if instance_id not in wanted:
                await asyncio.to_thread(self.worker.stop, instance_id)
                self.engine_stats.pop(instance_id, None)
                inst = self.instances.get(instance_id)
                self._fail_streams(instance_id, inst.error if inst else "the instance was deleted")
        for instance_id, (inst, rank, placement) in wanted.items():
            if instance_id not in self.worker.runners and instance_id not in self._preparing:
                self._preparing[instance_id] = asyncio.create_task(self._prepare_rank(inst, rank, placement))

    async def _report_unknown_statuses(self) -> None:
        """Report again each of this node's ranks whose runner is ready or failed where the
        table says otherwise: the report went to a coordinator that has since changed, or
        to none while one was taking over."""
        for inst in list(self.instances.values()):
            handle = self.worker.runners.get(inst.instance_id)
            if inst.status == "failed" or handle is None or handle.status not in ("ready", "failed"):
                continue
            mine = [r for r in inst.ranks if r.node_id == self.node_id]
            if mine and mine[0].status != handle.status:
                loaded = dataclasses.asdict(handle.loaded) if handle.loaded else None
                await self._report_runner(inst.instance_id, handle.status, handle.error, loaded)

    async def _prepare_rank(self, inst: Instance, rank: int, placement: RankPlacement) -> None:
        """Get the files of this node's shard of ``inst`` (copying what is missing from a
        peer), then start its runner; a failure to get them fails the rank."""
        try:
            weights = await self._shard_weights(inst, rank, placement)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure must fail the rank, not leave it loading
            log.exception("getting the files of %s failed", inst.model_id)
            self._preparing.pop(inst.instance_id, None)
            await self._report_runner(inst.instance_id, "failed",
                                      f"could not get the files of {inst.model_id}: {exc}", None)
            return
        self._preparing.pop(inst.instance_id, None)
        current = self.instances.get(inst.instance_id)
        if current is None or current.status == "failed" or inst.instance_id in self.worker.runners:
            return
        self._start_runner(current, rank, placement, weights)
        self._background = [t for t in self._background if not t.done()]
        self._background.append(asyncio.create_task(self._warm_tokenizer(inst.model_id)))

    async def _warm_tokenizer(self, model_id: str) -> None:
        try:
            await self.tokenizer(model_id)
        except (ModelNotFoundError, TransferError, httpx.HTTPError, OSError, ValueError) as exc:
            log.warning("could not load the tokenizer of %s: %s", model_id, exc)

    async def _shard_weights(self, inst: Instance, rank: int, placement: RankPlacement) -> Path:
        """The local path the runner of ``rank`` opens, after copying from a peer the
        files of its shard that this node's store lacks (progress goes to the coordinator).

        Raises:
            ModelNotFoundError: no live node has the files.
            TransferError, httpx.HTTPError: every copy failed.
        """
        if inst.model_id == DEFAULT_MODEL_ID:
            return self.store.weights_path(inst.model_id)
        manifest = await self._manifest(inst.model_id)
        top = inst.sharding != Sharding.PIPELINE or rank in (0, len(inst.ranks) - 1)
        needed = manifest.shard_files(placement.layer_start, placement.layer_end, top)

        def progress(done: int, total: int) -> None:
            report = self._report_runner(inst.instance_id, "fetching", None, None,
                                         fetched={"done_bytes": done, "total_bytes": total})
            asyncio.run_coroutine_threadsafe(report, self._loop)

        await self._fetch(manifest, needed, progress)
        return self.store.weights_path(inst.model_id)

    async def _manifest(self, model_id: str) -> Manifest:
        """The model's manifest from this node's store, else from a live peer's.

        Raises:
            ModelNotFoundError: no live node's store has the model.
        """
        manifest = self.store.manifest(model_id)
        if manifest is not None:
            return manifest
        for peer in await self._peers_holding(lambda models: model_id in models):
                try:
                    response = await self._http.get(f"http://{peer.address}/internal/models/manifest",
                                                    params={"model": model_id})
                    if response.status_code == 200:
                        return Manifest.from_dict(response.json())
                except (httpx.HTTPError, ValueError) as exc:
                    log.warning("manifest of %s from %s: %s", model_id, peer.node_id, exc)
        raise ModelNotFoundError(
            f"model {model_id!r} is not on any node: add it with `shardline models add {model_id}` "
            f"(a Hugging Face repo id) or `shardline models add PATH` (a .gguf file or a safetensors "
            f"directory) on one node")

    async def _peers_holding(self, holds) -> list[Peer]:
        """The live peers whose store summary satisfies ``holds(models)``; when none does,
        after polling them all once (a model added a moment ago is in no summary yet)."""
        for attempt in range(2):
            live = set(self.live_node_ids())
            found = [p for p in self.peers.values() if p.node_id in live and holds(p.models)]
            if found or attempt:
                return found
            await self.refresh_peers()
        return []

    async def refresh_peers(self) -> None:
        """Poll every live peer now, rather than within the second (their stores, memory)."""
        live = set(self.live_node_ids())
        await asyncio.gather(*(self._poll(p.address) for p in self.peers.values() if p.node_id in live))

    async def _fetch(self, manifest: Manifest, paths: list[str], on_progress=None) -> None:
        """Copy ``paths`` of a model that this store lacks from a live peer that has them
        all, trying each such peer in turn (a broken copy resumes from the next).

        Raises:
            ModelNotFoundError: no live peer has them.
            TransferError, httpx.HTTPError: the last peer's copy failed.
        """
        async with self._fetch_lock:  # one copy at a time: a tokenizer and a shard share files
            missing = self.store.missing(manifest.model_id, paths)
            if not missing:
                return
            holders = await self._peers_holding(
                lambda models: set(missing) <= set(models.get(manifest.model_id, {}).get("present", ())))
            if not holders:
                raise ModelNotFoundError(f"no live node has the files {missing} of {manifest.model_id}")
            total = sum(f.size for f in manifest.files if f.path in paths)
            progress = CopyProgress(f"copying {manifest.model_id}", total, on_progress)
            error: Exception | None = None
            try:
                for peer in holders:
                    progress.done = 0  # fetch_files counts what is present as done
                    try:
                        with httpx.Client(headers={"Authorization": f"Bearer {self.cluster_key}"}) as client:
                            received = await asyncio.to_thread(
                                fetch_files, client, f"http://{peer.address}", self.store, manifest,
                                paths, progress)
                        log.info("copied %d bytes of %s from %s", received, manifest.model_id, peer.node_id)
                        return
                    except (TransferError, httpx.HTTPError) as exc:
                        log.warning("copying %s from %s failed: %s", manifest.model_id, peer.node_id, exc)
                        error = exc
            finally:
                progress.close()
            raise error

    def _start_runner(self, inst: Instance, rank: int, placement: RankPlacement, weights: Path) -> None:
        """Start the runner of ``rank`` of ``inst`` on this node, reading ``weights``."""
        ring_chunks = {}
        if inst.sharding == Sharding.RING:
            chunk = ring_prefill_chunk(len(inst.ranks))
            ring_chunks = {"prefill_chunk": chunk, "prefill_step_tokens": chunk,
                           "prefill_burst_tokens": max(chunk, RunnerSpec.prefill_burst_tokens)}
        spec = RunnerSpec(
            instance_id=inst.instance_id,
            node_id=self.node_id,
            model_path=str(weights),
            rank=rank,
            world_size=len(inst.ranks),
            sharding=inst.sharding,
            layer_start=placement.layer_start,
            layer_end=placement.layer_end,
            tensor_share=placement.tensor_share,
            master_addr=inst.master_addr,
            master_port=inst.master_port,
            max_batch=inst.max_batch,
            context=inst.context,
            kv_tokens=inst.kv_tokens,
            dtype=inst.dtype,
            quantize=inst.quantize,
            threads=self.runner_threads,
            progress_timeout_s=self.progress_timeout_s,
            **ring_chunks,
        )
        self.worker.start(spec)

    def _on_runner_message(self, instance_id: str, message: object) -> None:
        """Called from a runner's reader thread."""
        loop = self._loop
        if loop is None:
            return
        if isinstance(message, Tokens):
            loop.call_soon_threadsafe(self._dispatch, message.events)
        elif isinstance(message, EngineStats):
            self.engine_stats[instance_id] = dataclasses.asdict(message)
        elif isinstance(message, Loaded):
            report = self._report_runner(instance_id, "ready", None, dataclasses.asdict(message))
            asyncio.run_coroutine_threadsafe(report, loop)
        elif isinstance(message, Failed):
            if message.peer_lost:  # the coordinator names the rank that failed: wait for it
                asyncio.run_coroutine_threadsafe(self._fail_streams_when_known(instance_id, message.error), loop)
            else:
                loop.call_soon_threadsafe(self._fail_streams, instance_id, message.error)
            report = self._report_runner(instance_id, "failed", message.error, None,
                                         peer_lost=message.peer_lost)
            asyncio.run_coroutine_threadsafe(report, loop)

    async def _report_runner(
        self, instance_id: str, status: str, error: str | None, loaded: dict | None,
        fetched: dict | None = None, peer_lost: bool = False,
    ) -> None:
        body = {"instance_id": instance_id, "node_id": self.node_id, "status": status,
                "error": error, "loaded": loaded, "fetched": fetched, "peer_lost": peer_lost}
        coordinator = self.coordinator_id()
        if coordinator != self.node_id:
            await self._post(f"http://{self.address_of(coordinator)}/internal/runner-status", body)
        elif self.is_coordinator():
            await self.runner_status(body)
        # else: this node is taking over; the status is reported again once it coordinates

    async def runner_status(self, body: dict) -> bool:
        """Coordinator: a node reports one of its ranks as fetching files, ready or failed.
        False (nothing changes) where this node does not coordinate: only the coordinator
        changes the table (the reporter reports again)."""
        if not self.is_coordinator():
            return False
        inst = self.instances.get(body["instance_id"])
        if inst is None or inst.status == "failed":
            return True
        for placement in inst.ranks:
            if placement.node_id == body["node_id"]:
                if body["status"] == "fetching" and placement.status == "ready":
                    continue  # a late progress report
                # a rank that only lost contact with a failed one stopped; it did not fail
                placement.status = "stopped" if body.get("peer_lost") else body["status"]
                placement.error = body["error"]
                placement.loaded = body.get("loaded")
                placement.fetched = body.get("fetched") or placement.fetched
        if body["status"] == "failed":
            rank = next(r for r, p in enumerate(inst.ranks) if p.node_id == body["node_id"])
            if body.get("peer_lost"):
                # Only a symptom: another rank failed or its node went down. Wait for that
                # rank's own report (or its node's silence) to name it.
                self._background.append(asyncio.create_task(
                    self._fail_after_grace(inst, f"rank {rank} on node {body['node_id']} "
                                                 f"{body['error']}")))
                await self._publish()
                return True
            await self._fail_instance(inst, f"rank {rank} on node {body['node_id']} failed: "
                                            f"{body['error']}")
            return True
        if all(p.status == "ready" for p in inst.ranks) and inst.status == "loading":
            inst.status, inst.ready_at = "ready", time.time()
            log.info("instance %s of %s is ready: %s on %d node(s)", inst.instance_id,
                     inst.model_id, inst.sharding, len(inst.ranks))
        await self._publish()
        return True

    async def _fail_after_grace(self, inst: Instance, error: str) -> None:
        """Coordinator: fail ``inst`` with ``error`` (a rank that lost contact with
        another) unless, within a grace, the rank that failed reported
        its own failure or its node was found down (then that is what the error names):
        a grace of ``down_after_s + 1``, the time a killed node takes to be found down."""
        deadline = time.time() + self.down_after_s + 1.0
        while time.time() < deadline and inst.status != "failed":
            down = [(r, p.node_id) for r, p in enumerate(inst.ranks)
                    if p.node_id not in self.live_node_ids()]
            if down:
                for r, _ in down:
                    inst.ranks[r].status = "failed"
                named = ", ".join(f"rank {r} on node {n}" for r, n in down)
                await self._fail_instance(inst, f"{named}: node down")
                return
            await asyncio.sleep(0.2)
        if self.instances.get(inst.instance_id) is inst:
            await self._fail_instance(inst, error)

    async def _fail_streams_when_known(self, instance_id: str, error: str) -> None:
        """Fail this node's requests on ``instance_id`` with the error the coordinator
        gives the instance (naming the rank that failed), or ``error`` if none comes within
        the grace."""
        deadline = time.time() + self.down_after_s + 3.0
        while time.time() < deadline:
            inst = self.instances.get(instance_id)
            if inst is None or inst.status == "failed":
                break
            await asyncio.sleep(0.1)
        inst = self.instances.get(instance_id)
        self._fail_streams(instance_id, inst.error if inst is not None and inst.error else error)

    async def _fail_instance(self, inst: Instance, error: str) -> None:
        """Coordinator: mark an instance failed (every node stops its runners and fails
        its in-flight requests), then place the model again on the nodes that are live."""
        if inst.status == "failed":
            return
        log.warning("instance %s failed: %s", inst.instance_id, error)
        inst.status, inst.error = "failed", error
        for placement in inst.ranks:  # every node stops its ranks of a failed instance
            if placement.status != "failed":
                placement.status = "stopped"
        await self._publish()
        task = asyncio.create_task(self._replace(inst))
        self._background.append(task)

    async def _replace(self, failed: Instance) -> None:
        # Wait until a vanished node has missed its heartbeats, so it is not chosen again.
        await asyncio.sleep(self.down_after_s + 1)
        if self.instances.get(failed.instance_id) is not failed or not self.is_coordinator():
            return
        retries = failed.retries + 1 if failed.ready_at is None else 0
        if retries > self.max_replacements:
            # Leave the failed instance in the table, so its error stays visible.
            log.error("giving up on %s after %d failed placements", failed.model_id, retries)
            return
        live = set(self.live_node_ids())
        wanted = failed.wanted_nodes or failed.node_ids()
        nodes = [n for n in wanted if n in live] or None
        try:
            card = await self.model_card(failed.model_id)
            await self._place(card, failed.sharding, nodes, failed.context, failed.max_batch,
                              failed.dtype, failed.force, retries, failed.kv_cache_bytes,
                              failed.quantize, wanted_nodes=wanted)
        except (PlacementError, ModelNotFoundError, httpx.HTTPError) as exc:
            # Left in the table with its error; a later term tries again.
            log.error("could not place %s again: %s", failed.model_id, exc)
            failed.error = f"{failed.error}; not placed again: {exc}"
            await self._publish()
            return
        # Only now, so the table never shows the model without an instance in between (a
        # client waiting for the kept model would place a second one).
        if self.instances.get(failed.instance_id) is failed:
            del self.instances[failed.instance_id]
            await self._publish()

    # -- placement -----------------------------------------------------------------------

    async def create_instance(
        self,
        model: str | None,
        sharding: str = "pipeline",
        node_ids: list[str] | None = None,
        context: int | None = None,
        max_batch: int | None = None,
        dtype: str = "bfloat16",
        force: bool = False,
        min_nodes: int | None = None,
        max_nodes: int | None = None,
        kv_cache_bytes: int | None = None,
        quantize: str | None = None,
    ) -> Instance:
        """Coordinator: place ``model`` (an id, see :meth:`adopt`) and start loading it.

        On ``node_ids`` (in rank order) when given. Otherwise under ``"auto"`` sharding, or
        with ``min_nodes`` / ``max_nodes``, the placement with the best predicted decode
        tokens/s among the shardings allowed and those node counts; else all live nodes.

        ``dtype`` is the ranks' compute dtype. bfloat16 halves the memory of float32; a
        tensor instance in bfloat16 rounds its partial sums differently from one node and
        may pick a different token where two are nearly tied, in float32 it does not.
        ``force`` skips memory admission: the user knows better than the measured memory
        (a rank that then runs out of memory fails its instance). ``kv_cache_bytes`` sizes
        the KV pool (the whole model's, all ranks together); without it the pool is
        ``max_batch`` sequences of ``context`` tokens, or as much as fits
        (:func:`~shardline.placement.ranks.place_with_kv_pool`). ``quantize`` (``"int8"``,
        ``"int4"``) quantizes the weights the files hold in 16 or 32 bits on load.

        Raises:
            ModelNotFoundError: no node has the model.
            ModelStoreError, UnsupportedModelError: a local path that is not a model
                shardline can run.
            PlacementError: the sharding is unknown or the model does not fit the nodes.
            KVCacheRequestError: ``kv_cache_bytes`` holds less than one sequence.
        """
        card = await self.model_card(await self.adopt(model))
        if sharding not in SHARDINGS + ("auto",):
            raise PlacementError(f"sharding {sharding!r} is not supported (supported: auto, {', '.join(SHARDINGS)})")
        if sharding == "auto" or (node_ids is None and (min_nodes or max_nodes)):
            shardings = SHARDINGS if sharding == "auto" else (sharding,)
            best = (await self.preview(card, node_ids, context, max_batch, dtype, best_only=True,
                                       shardings=shardings, force=force, min_nodes=min_nodes or 1,
                                       max_nodes=max_nodes, kv_cache_bytes=kv_cache_bytes,
                                       quantize=quantize))[0]
            sharding, node_ids = best.sharding, list(best.node_ids)
        return await self._place(card, sharding, node_ids, context, max_batch, dtype, force,
                                 kv_cache_bytes=kv_cache_bytes, quantize=quantize)

    async def adopt(self, model: str | None) -> str:
        """The model id for what a request names, taking what only this machine has into
        this node's store (whence the others copy it): a local path (a ``.gguf`` file or a
        safetensors directory), or a repo id in this machine's Hugging Face cache that no
        node's store holds. The default for None is the embedded default model.

        Raises:
            ModelStoreError, UnsupportedModelError: a path that is not a model shardline
                can run.
        """
        model = model or DEFAULT_MODEL_ID
        live = set(self.live_node_ids())
        if model == DEFAULT_MODEL_ID or self.store.manifest(model) is not None or any(
                model in p.models for p in self.peers.values() if p.node_id in live):
            return model
        if Path(model).expanduser().exists() or looks_like_path(model):
            return (await asyncio.to_thread(self.store.add_local, model)).model_id
        if "/" in model:
            try:
                return (await asyncio.to_thread(self.store.add_from_hub, model, False)).model_id
            except (ModelNotFoundError, ModelStoreError):
                pass
        return model

    async def model_card(self, model_id: str) -> ModelCard:
        """A model's id and config, for placement: the embedded default, or a model in this
        node's store or a live peer's.

        Raises:
            ModelNotFoundError: none of these has it.
        """
        if model_id == DEFAULT_MODEL_ID or self.store.manifest(model_id) is not None:
            return await asyncio.to_thread(self.store.card, model_id)
        manifest = await self._manifest(model_id)
        return manifest.card()

    def node_profiles(self, node_ids: list[str]):
        """The preview's view of ``node_ids``: NodeProfile each, and the measured links.

        A node whose profile is not measured yet counts with 10 GB/s and 100 GFLOP/s.
        """
        from shardline.placement.preview import Link, NodeProfile

        profiles, links = [], {}
        for node_id in node_ids:
            if node_id == self.node_id:
                profile, measured, available = self.profile or {}, self.links, self._available_bytes(node_id)
            else:
                peer = self.peers[node_id]
                profile, measured, available = peer.profile or {}, peer.links, self._available_bytes(node_id)
            profiles.append(NodeProfile(node_id, available,
                                        profile.get("memory_bandwidth_bytes_per_s") or 10e9,
                                        profile.get("matmul_flops") or 100e9))
            for other, link in measured.items():
                links[(node_id, other)] = Link(link["latency_s"], link["bandwidth_bytes_per_s"])
        return profiles, links

    async def preview(self, card: ModelCard, node_ids: list[str] | None, context: int | None,
                      max_batch: int | None, dtype: str = "bfloat16", best_only: bool = False,
                      shardings: tuple[str, ...] = SHARDINGS, force: bool = False,
                      min_nodes: int = 1, max_nodes: int | None = None,
                      kv_cache_bytes: int | None = None, quantize: str | None = None):
        """Candidate placements of a model on the live nodes, fastest predicted first
        (``shardline.placement.preview``); with ``best_only`` just the best feasible one.

        Raises:
            PlacementError: unknown nodes; with ``best_only``, no placement fits (the
                message gives each candidate's reason).
        """
        from shardline.placement.preview import auto, preview

        config, chosen, context, max_batch = self._placement_inputs(card, node_ids, context, max_batch)
        if min_nodes > len(chosen):
            raise PlacementError(f"min_nodes is {min_nodes} but there are only {len(chosen)} live nodes to use")
        profiles, links = self.node_profiles(chosen)
        kv_tokens = (None if kv_cache_bytes is None
                     else kv_tokens_for_bytes(config, kv_cache_bytes, dtype, context))
        options = dict(min_nodes=min_nodes, weight_file_bytes=card.weight_file_bytes,
                       baseline_bytes=self._runtime_baseline(chosen), admit=not force,
                       kv_tokens=kv_tokens, quantize=Quantize(quantize) if quantize else None)
        if best_only:
            return [auto(config, profiles, links, context, max_batch, dtype, shardings, max_nodes,
                         **options)]
        return preview(config, profiles, links, context, max_batch, dtype, shardings, max_nodes,
                       **options)

    def _placement_inputs(self, card: ModelCard, node_ids: list[str] | None, context: int | None,
                          max_batch: int | None):
        """The model's config, the chosen live nodes (default all) and the instance's context
        and max_batch (defaults filled in), for placing or previewing.

        Raises:
            PlacementError: a chosen node is not in the cluster or is down.
        """
        config = ModelConfig.from_dict(card.config)
        live = self.live_node_ids()
        chosen = node_ids or live
        unknown = [n for n in chosen if n not in live]
        if unknown:
            raise PlacementError(f"nodes not in the cluster (or down): {', '.join(unknown)}")
        context = context or min(self.default_context, config.max_position_embeddings)
        return config, chosen, context, max_batch or self.default_max_batch

    async def _place(
        self,
        card: ModelCard,
        sharding: Sharding,
        node_ids: list[str] | None,
        context: int | None,
        max_batch: int | None,
        dtype: str = "bfloat16",
        force: bool = False,
        retries: int = 0,
        kv_cache_bytes: int | None = None,
        quantize: str | None = None,
        wanted_nodes: list[str] | None = None,
    ) -> Instance:
        """Place ``card`` and publish the instance. ``wanted_nodes``: the nodes a failed
        instance was placed on; kept on the new one when it gets fewer of them (rule 6)."""
        config, chosen, context, max_batch = self._placement_inputs(card, node_ids, context, max_batch)
        asked = (None if kv_cache_bytes is None
                 else kv_tokens_for_bytes(config, kv_cache_bytes, dtype, context))
        capacities = [NodeCapacity(n, self._available_bytes(n)) for n in chosen]
        baseline = self._runtime_baseline(chosen)
        quantized = Quantize(quantize) if quantize else None
        shares, kv_tokens = place_with_kv_pool(
            config, sharding, capacities, context, max_batch, dtype, admit=not force,
            weight_file_bytes=card.weight_file_bytes, baseline_bytes=baseline, kv_tokens=asked,
            quantize=quantized)
        estimated = [rank_bytes(config, sharding, shares, r, context, max_batch, dtype,
                                card.weight_file_bytes, baseline, kv_tokens=kv_tokens,
                                quantize=quantized)
                     for r in range(len(shares))]
        master_addr = self.address_of(chosen[0]).rsplit(":", 1)[0]
        port = await self._free_port(chosen[0])
        inst = Instance(
            instance_id=uuid.uuid4().hex[:8],
            model_id=card.model_id,
            sharding=Sharding(sharding),
            ranks=[
                RankPlacement(n, self.address_of(n), share.layer_start, share.layer_end,
                              tensor_share=share.tensor_share, estimated_bytes=need,
                              incarnation=self.incarnation_of(n))
                for n, share, need in zip(chosen, shares, estimated)
            ],
            master_addr=master_addr,
            master_port=port,
            context=context,
            max_batch=max_batch,
            dtype=dtype,
            kv_tokens=kv_tokens,
            kv_cache_bytes=kv_cache_bytes,
            quantize=quantize,
            retries=retries,
            force=force,
            wanted_nodes=list(wanted_nodes) if wanted_nodes and set(chosen) < set(wanted_nodes) else [],
        )
        self.instances[inst.instance_id] = inst
        log.info("placed %s as instance %s (%s on %s)", card.model_id, inst.instance_id,
                 sharding, ", ".join(chosen))
        await self._publish()
        return inst

    def _offered_bytes(self) -> int:
        """Bytes this node offers to models in all: its memory limit, else the memory the
        system has available plus what its own runners hold (theirs to keep)."""
        if self.memory_limit_bytes is not None:
            return self.memory_limit_bytes
        return int(psutil.virtual_memory().available) + self.worker.resident_bytes()

    def _committed_bytes(self, node_id: str) -> int:
        """What placement counts the ranks on ``node_id`` of this node's instance table
        (every instance not failed) to hold."""
        ranks = ((r.node_id, r.estimated_bytes) for inst in self.instances.values()
                 if inst.status != "failed" for r in inst.ranks)
        return committed_bytes(ranks, node_id)

    def _runtime_baseline(self, node_ids: list[str]) -> int:
        """Runtime bytes to count per rank on these live nodes, from their profiles."""
        profiles = [(self.profile if n == self.node_id else self.peers[n].profile) or {}
                    for n in node_ids]
        return runtime_baseline([p.get("runtime_baseline_bytes") or 0 for p in profiles])

    def memory_of(self, node_id: str) -> dict:
        """``offered_bytes``, ``committed_bytes`` and ``free_bytes`` of a live node (see
        :meth:`_available_bytes`)."""
        offered = self._offered_bytes() if node_id == self.node_id else self.peers[node_id].offered_bytes
        committed = self._committed_bytes(node_id)
        return {"offered_bytes": offered, "committed_bytes": committed,
                "free_bytes": free_bytes(offered, committed)}

    def _available_bytes(self, node_id: str) -> int:
        """Bytes a node can give the next placement: what it offers less what the ranks
        placed on it hold (counted from this node's own table, so placements in a row
        never count the same bytes twice)."""
        return self.memory_of(node_id)["free_bytes"]

    async def _free_port(self, node_id: str) -> int:
        if node_id == self.node_id:
            return free_port()
        response = await self._http.get(f"http://{self.address_of(node_id)}/internal/free-port")
        return int(response.json()["port"])

    async def ask_coordinator(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        """Send a cluster-API request to the coordinator; its status and JSON body (503
        while this node, the next coordinator, still hears the cluster)."""
        if self.coordinator_id() == self.node_id:
            return 503, {"detail": "this node is taking over as coordinator; try again in a few seconds"}
        url = f"http://{self.address_of(self.coordinator_id())}{path}"
        response = await self._http.request(method, url, json=body, timeout=60.0)
        return response.status_code, response.json()

    async def delete_instance(self, instance_id: str) -> bool:
        """Coordinator: remove an instance; its runners are stopped everywhere."""
        if self.instances.pop(instance_id, None) is None:
            return False
        await self._publish()
        return True

    # -- requests ------------------------------------------------------------------------

    async def tokenizer(self, model_id: str) -> Tokenizer:
        """The tokenizer of a model, loaded once per node; a node without the model's
        tokenizer files copies them (not the weights) from a peer.

        Raises:
            ModelNotFoundError: no live node has the model.
            TransferError, httpx.HTTPError: the copy failed.
        """
        async with self._tokenizer_lock:
            if model_id not in self.tokenizers:
                if model_id != DEFAULT_MODEL_ID:
                    manifest = await self._manifest(model_id)
                    await self._fetch(manifest, manifest.tokenizer_files())
                self.tokenizers[model_id] = await asyncio.to_thread(
                    lambda: Tokenizer(self.store.tokenizer_path(model_id)))
            return self.tokenizers[model_id]

    def ready_instance(self, model_id: str) -> Instance:
        """A ready instance of the model, preferring one with a rank on this node.

        Raises:
            NoInstanceError: none is ready.
        """
        ready = [i for i in self.instances.values() if i.model_id == model_id and i.status == "ready"]
        if not ready:
            raise NoInstanceError(f"no ready instance serves model {model_id!r}")
        ready.sort(key=lambda i: (self.node_id not in i.node_ids(), i.created_at))
        return ready[0]

    def models(self) -> list[dict]:
        """Models with a ready instance: ``[{"id", "created"}]``."""
        seen = {}
        for inst in self.instances.values():
            if inst.status == "ready":
                seen.setdefault(inst.model_id, inst.created_at)
        return [{"id": m, "created": int(t)} for m, t in seen.items()]

    def new_task_id(self) -> int:
        """int64 ids that sort by creation time: ms (41 bits) | node salt (10) | counter (12)."""
        ms = int(time.time() * 1000) - 1_700_000_000_000
        return (ms << 22) | (self._salt << 12) | (next(self._task_counter) & 0xFFF)

    async def generate(
        self,
        model_id: str,
        prompt: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_token_ids: list[int],
    ) -> AsyncIterator[TokenEvent | PrefillProgress]:
        """Run one request on a ready instance and yield its events: the progress of a
        prefill that takes more than one engine step, then its tokens.

        Closing the iterator early cancels the request on every rank.

        Raises:
            NoInstanceError: no ready instance serves the model.
            InstanceFailedError: the instance failed mid-request.
        """
        inst = self.ready_instance(model_id)
        if self.node_id not in inst.node_ids():
            async for event in self._forward(inst, model_id, prompt, max_tokens, sampling, stop_token_ids):
                yield event
            return
        task = Task(
            task_id=self.new_task_id(),
            origin=self.node_id,
            prompt=tuple(prompt),
            max_tokens=max_tokens,
            sampling=sampling,
            stop_token_ids=tuple(stop_token_ids),
        )
        stream = _Stream(inst.instance_id, asyncio.Queue())
        self.streams[task.task_id] = stream
        finished = False
        try:
            await self._deliver(inst, "tasks", task_to_dict(task))
            while True:
                event = await stream.queue.get()
                if isinstance(event, Exception):
                    raise event
                if isinstance(event, TokenEvent) and event.finish_reason is not None:
                    finished = True
                yield event
                if finished:
                    return
        finally:
            self.streams.pop(task.task_id, None)
            if not finished:
                asyncio.get_running_loop().create_task(self._cancel(inst, task.task_id))

    async def _deliver(self, inst: Instance, kind: str, body: dict) -> None:
        """Hand a task or a cancellation to the runner of every rank of ``inst``.

        Raises:
            InstanceFailedError: a rank's node or runner could not be reached (a task that
                some rank never receives would never start).
        """
        body = dict(body, instance_id=inst.instance_id)
        missed = []
        if self.node_id in inst.node_ids() and not self.deliver_local(kind, body):
            missed.append(self.node_id)
        remote = [r for r in inst.ranks if r.node_id != self.node_id]
        responses = await asyncio.gather(
            *(self._post(f"http://{r.address}/internal/{kind}", body) for r in remote)
        )
        for rank, response in zip(remote, responses):
            if response is None or response.status_code != 200 or not response.json().get("delivered"):
                missed.append(rank.node_id)
        if missed:
            raise InstanceFailedError(
                f"instance {inst.instance_id}: could not reach the runner on node(s) {', '.join(missed)}"
            )

    async def _cancel(self, inst: Instance, task_id: int) -> None:
        """Tell every rank to drop a task (best effort: a rank that is gone has no batch)."""
        try:
            await self._deliver(inst, "cancel", {"task_id": task_id})
        except InstanceFailedError as exc:
            log.warning("cancel of task %d: %s", task_id, exc)

    def deliver_local(self, kind: str, body: dict) -> bool:
        """Pass a task or cancellation to this node's runner of the instance."""
        handle = self.worker.runners.get(body["instance_id"])
        if handle is None:
            return False
        message = task_from_dict(body) if kind == "tasks" else Cancel(int(body["task_id"]))
        return handle.send(message)

    def _dispatch(self, events: tuple[TokenEvent | PrefillProgress, ...]) -> None:
        for event in events:
            stream = self.streams.get(event.task_id)
            if stream is not None:
                stream.queue.put_nowait(event)

    def _fail_streams(self, instance_id: str, error: str | None) -> None:
        for stream in list(self.streams.values()):
            if stream.instance_id == instance_id:
                stream.queue.put_nowait(InstanceFailedError(f"instance {instance_id}: {error}"))

    async def _forward(self, inst, model_id, prompt, max_tokens, sampling, stop_token_ids):
        """Run the request through a node that hosts a rank of ``inst``."""
        body = {
            "model": model_id,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "sampling": dataclasses.asdict(sampling),
            "stop_token_ids": stop_token_ids,
        }
        url = f"http://{inst.ranks[0].address}/internal/generate"
        try:
            async with self._http.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    raise InstanceFailedError(f"node {inst.ranks[0].node_id} refused: {response.status_code}")
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    data = json.loads(line)
                    if "error" in data:
                        raise InstanceFailedError(data["error"])
                    yield PrefillProgress(**data) if "done" in data else TokenEvent(**data)
        except httpx.HTTPError as exc:
            raise InstanceFailedError(f"lost node {inst.ranks[0].node_id}: {exc}") from exc


def task_to_dict(task: Task) -> dict:
    return dataclasses.asdict(task)


def task_from_dict(data: dict) -> Task:
    return Task(
        task_id=int(data["task_id"]),
        origin=data["origin"],
        prompt=tuple(data["prompt"]),
        max_tokens=int(data["max_tokens"]),
        sampling=SamplingParams(**data["sampling"]),
        stop_token_ids=tuple(data["stop_token_ids"]),
    )


def free_port() -> int:
    """A TCP port that was free on this machine a moment ago."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


__all__ = [
    "Instance",
    "InstanceFailedError",
    "ModelNotFoundError",
    "NoInstanceError",
    "Node",
    "PlacementError",
    "free_port",
]
