"""A shardline node: membership, the replicated instance table, placement, request routing.

One node runs per machine and never runs model code itself (its runners do). Nodes talk
over HTTP (``/internal/*``):

- membership: every node polls its peers' ``/internal/info`` each second (five times a
  second until it is settled), naming itself (``peer_client.MEMBER_HEADER``); the polled
  node adds it to its peers and answers with the members it knows, so a node that
  contacts one member joins all of them. A node silent for ``down_after_s`` is down. The coordinator is the live node with the smallest id,
  once settled (``shardline.node.cluster_state``: terms, epochs and their invariants).
- instances: the coordinator places a model, writes the instance table, and pushes it to
  every node (``/internal/state``) with its epoch; a node adopts only a newer epoch and
  keeps the table on disk. Each node reconciles its runners with the table (starts the
  ranks placed on it, stops those no longer there) and reports runner status back.
- requests: the node that takes a request hands the task to every rank's node
  (``/internal/tasks``); its own runner streams the tokens back. A node that hosts no rank
  of the instance forwards the request to one that does (``/internal/generate``).

This module holds what the node knows of its peers and the replicated table (kept on disk
by ``table_file.py``; the links to peers measured by ``link_probe.LinkMeter``); the
membership rounds, the coordinator's decisions, runner supervision, model logistics and
request routing are the roles in ``membership.py``, ``coordinator.py``,
``supervision.py``, ``logistics.py`` and ``routing.py``, each given the node. Every
message between nodes is a ``wire.py`` model sent through ``peer_client.PeerClient``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import time
import zlib
from collections.abc import Coroutine, Mapping
from pathlib import Path

import psutil

from shardline.models.store import (
    ModelStore,
)
from shardline.models.tokenizer import Tokenizer
from shardline.node.cluster_state import (
    Epoch,
    heard_majority,
    settled,
)
from shardline.node.coordinator import Coordinator
from shardline.node.forecast import Forecast
from shardline.node.link_probe import LinkMeter
from shardline.node.logistics import ModelLogistics
from shardline.node.membership import Membership
from shardline.node.node_memory import NodeMemory
from shardline.node.peer_client import PeerClient, PeerError
from shardline.node.queue_bound import DEFAULT_MAX_WAITING
from shardline.node.repeated_warnings import RepeatedWarnings
from shardline.node.routing import RequestStream, Router
from shardline.node.signing import signing_key
from shardline.node.speeds import HostProfiler, ServedLog
from shardline.node.state import (
    Adopted,
    ClusterState,
    Event,
    Published,
    apply,
)
from shardline.node.supervision import Supervisor
from shardline.node.table import EndCode, Instance, InstanceFailedError, Peer
from shardline.node.table_file import load_table, save_table
from shardline.node.wire import NodeInfo
from shardline.node.worker import Spare, Worker

log = logging.getLogger(__name__)


class Node:
    """A node: its state, what it knows of its peers (who is live, who coordinates) and
    the replicated instance table (publish, adopt, keep on disk); the composition root of
    its roles, which share that state: :class:`~shardline.node.membership.Membership`
    (the rounds: polling peers, terms), :class:`~shardline.node.coordinator.Coordinator`,
    :class:`~shardline.node.supervision.Supervisor`,
    :class:`~shardline.node.logistics.ModelLogistics` and
    :class:`~shardline.node.routing.Router`. The HTTP layer is ``shardline.api.app``.

    Args:
        host: the address peers and runners of other nodes use to reach this node.
        port: its HTTP port.
        peers: ``host:port`` of other nodes to poll.
        mdns: also find peers of the same cluster on the LAN by mDNS.
        node_id: this node's lasting id (``shardline.node.identity.node_id``).
        cluster_key: the cluster's shared secret; every node-to-node request and answer is
            signed with a key derived from it (``shardline.node.signing``), never sent.
        store: this node's model store; a rank whose files are not in it copies them from
            a peer's (``shardline.node.transfer``).
        memory_limit_bytes: the most memory this node offers to models (None: all that is
            available).
        runner_threads: torch threads per runner (0: torch's default).
        device: what its runners compute on (``shardline.node.profile.DEVICE_RE``:
            ``auto``, the first CUDA device torch sees, else the CPU), and what its
            profile measures.
        watchdog_s: a runner silent this many seconds is killed and its instance fails.
        progress_timeout_s: a runner that waits this many seconds inside an engine step
            without progress (a stalled peer or collective) fails its instance.
        context, max_batch: defaults for new instances (tokens per sequence, sequences).
        model_dirs: directories under which a client may name a local path as a model
            (``--model-dir``); the store's directory is always one. A path elsewhere is
            refused (``ModelLogistics.adopt``).
        max_waiting: the most requests this node lets wait for a slot of one instance;
            more are refused with 429 (``shardline.node.queue_bound``).
        spare_runner: keep a runner started ahead of the next rank placed here, its
            imports done (``shardline.node.worker``).
        first_spare: the first such runner, started already (the ``run`` command starts it
            before importing the node, so their imports overlap).
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
        device: str = "auto",
        context: int = 4096,
        max_batch: int = 8,
        down_after_s: float = 5.0,
        exit_with_parent: bool = False,
        watchdog_s: float = 10.0,
        progress_timeout_s: float = 60.0,
        mdns: bool = False,
        state_path: Path | None = None,
        rejoin: bool = True,
        model_dirs: list[Path] | None = None,
        max_waiting: int = DEFAULT_MAX_WAITING,
        spare_runner: bool = True,
        first_spare: Spare | None = None,
    ) -> None:
        self.node_id = node_id
        self.store = store
        self.model_dirs = [store.root, *(Path(d) for d in model_dirs or [])]
        self.memory_limit_bytes = memory_limit_bytes
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        self.peer_addresses = [p for p in peers if p and p != self.address]
        # the given peers that have not answered yet: warned of once (membership.PEER_SILENT_S)
        self._unheard_peers = set(self.peer_addresses)
        self.peers: dict[str, Peer] = {}
        self.runner_threads = runner_threads
        self.device = device  # its runners' (profile.DEVICE_RE), resolved by each runner
        self.progress_timeout_s = progress_timeout_s
        self.default_context = context
        self.default_max_batch = max_batch
        self.max_waiting = max_waiting
        self.down_after_s = down_after_s
        self.exit_with_parent = exit_with_parent
        self.max_replacements = 3
        self.rejoin = rejoin  # place an instance again on its returning nodes (rule 6)
        self.started_at = time.time()
        self.cluster_state = ClusterState()  # the instance table and its epoch (node.state)
        self.state_path = state_path  # where the table and its epoch are kept
        self._acting_term: int | None = None  # the term this node coordinates, if it does
        self._left_term = 0  # the greatest term of a table it held and gave up (a minority's)
        self._settled_since = self.started_at  # start, or resumption from a pause
        self._heard_all_at: float | None = None  # the last round every peer answered
        self._last_tick = self.started_at
        self._busy_at = float("-inf")  # when a rank here last loaded or served
        kept = None if state_path is None else load_table(state_path)
        if kept is not None:  # desired state: no runner starts from it until a coordinator publishes
            self.cluster_state = kept
        # the roles, each with this node's state (the node is their composition root)
        self.membership = Membership(self)
        self.coordinator = Coordinator(self)
        self.memory = NodeMemory(self)
        self.forecast = Forecast(self)
        self.repeated = RepeatedWarnings(log)  # a peer down: one warning, not one a second
        self.supervisor = Supervisor(self)
        self.logistics = ModelLogistics(self)
        self.router = Router(self)
        self.worker = Worker(self.supervisor._on_runner_message, watchdog_s=watchdog_s, spare=spare_runner)
        self._first_spare = first_spare
        self.streams: dict[int, RequestStream] = {}
        self.engine_stats: dict[str, dict] = {}  # instance id -> this node's rank's batch
        self.tokenizers: dict[str, Tokenizer] = {}
        self._tokenizer_lock = asyncio.Lock()
        self._fetch_lock = asyncio.Lock()
        self._preparing: dict[str, asyncio.Task] = {}  # instance id -> getting its files
        self._task_counter = itertools.count()
        self._salt = zlib.crc32(self.node_id.encode()) & 0x3FF
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False  # told to stop: changes and watches nothing more
        self.signing_key = signing_key(cluster_key)  # scrypt: tens of ms, once
        self.peer_client = PeerClient(self.signing_key, self.address)  # every node-to-node call
        self._background: list[asyncio.Task] = []
        self._state_lock = asyncio.Lock()
        self._refused: set[str] = set()  # peer addresses that refused our cluster key
        self.profile: dict | None = None  # HostProfile.to_dict(): node.speeds.HostProfiler
        self.link_meter = LinkMeter(self.peer_client.measure_link)
        self.links = self.link_meter.links  # node id -> the link from this node (link_probe)
        from shardline.node.identity import default_data_dir
        from shardline.node.profile import PROFILE_FORMAT

        # one file per runner thread count: nodes of 1- and 3-node local clusters run
        # runners on 2 and 1 threads here, and a shared file made every start of the
        # other kind measure (a torch child beside the start-up, killed at placement)
        self.profiler = HostProfiler(
            self, default_data_dir() / f"host-profile-v{PROFILE_FORMAT}-{device}-threads{runner_threads}.json")
        self.served = ServedLog(self, None if state_path is None else state_path.parent / "served-speeds.json")
        self.discovery = None
        if mdns:
            from shardline.node.discovery import Discovery

            self.discovery = Discovery(node_id, host, port, self.add_peer)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # its imports overlap the node's start-up and election
        self.worker.start_spare(self._first_spare)
        self._first_spare = None
        # (later ones: the membership loop, once idle)
        self._last_tick = time.time()  # the time since construction (a busy start) is no pause
        self.background(self.membership.run())
        self.background(self.profiler.run())
        if self.discovery is not None:
            try:
                await asyncio.to_thread(self.discovery.start)
            except (OSError, ValueError) as exc:
                log.warning("mDNS discovery is off (%s); use --peers", exc)
                self.discovery = None
        if self.exit_with_parent:
            self.background(self._watch_parent(os.getppid()))

    def background(self, coroutine: Coroutine[object, object, object]) -> None:
        """Run ``coroutine`` as a task of this node's (cancelled when it stops)."""
        self._background = [t for t in self._background if not t.done()]
        self._background.append(asyncio.create_task(coroutine))

    def stopping(self) -> None:
        """The node was told to stop (Ctrl-C, SIGTERM; any thread may call this): from now
        it watches and places nothing (a peer stopping with it is no failure to record),
        and its open requests end with an error, so that the HTTP server, which waits for
        them, stops at once."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._begin_stop)

    def is_stopping(self) -> bool:
        return self._stopping

    def _begin_stop(self) -> None:
        log.info("stopping: %d open request(s) end with an error, the runners are stopped",
                 len(self.streams))
        self._stopping = True
        for task in self._background:
            task.cancel()
        for stream in list(self.streams.values()):
            stream.queue.put_nowait(InstanceFailedError("the node is stopping", EndCode.SERVER_STOPPING))

    async def stop(self) -> None:
        for task in self._background:
            task.cancel()
        if self.discovery is not None:
            await asyncio.to_thread(self.discovery.stop)
        self.worker.stop_all()
        await self.peer_client.aclose()

    async def _watch_parent(self, parent: int) -> None:
        """Shut down (as on Ctrl-C) once the process that started this node is gone."""
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        log.warning("parent process %d is gone; stopping", parent)
        os.kill(os.getpid(), signal.SIGINT)

    # -- membership ----------------------------------------------------------------------

    def info(self) -> NodeInfo:
        """This node as its peers see it (``GET /internal/info``)."""
        memory = self.memory.of(self.node_id)
        profile = None
        if self.profile is not None:
            profile = dict(self.profile, available_bytes=memory["free_bytes"])
        return NodeInfo(
            node_id=self.node_id, address=self.address, started_at=self.started_at,
            available_bytes=memory["free_bytes"], **memory,
            total_bytes=int(psutil.virtual_memory().total), memory_limit_bytes=self.memory_limit_bytes,
            models=self.store.summary(), epoch=self.epoch, coordinator=self.coordinator_id(),
            settled=self.is_settled(), profile=profile, links=self.links,
            members=self.member_addresses(), busy=self.busy_instances(),
            served=self.served.to_list(),
        )

    def busy_instances(self) -> list[str]:
        """Instances whose rank on this node has requests running, waiting or held."""
        return sorted(i for i, stats in self.engine_stats.items()
                      if stats.get("running") or stats.get("waiting") or stats.get("held"))

    def member_addresses(self) -> list[str]:
        """Addresses of the live peers: told to every node that polls this one, so that a
        node that contacted one member comes to know (and be known by) all of them."""
        return sorted(p.address for p in self.live_peers())

    def add_peer(self, address: str) -> None:
        """Poll ``host:port`` from now on (a peer found by mDNS, one that polled this node,
        or a member another member named; any thread). Anything else is ignored."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return
        if address != self.address and address not in self.peer_addresses:
            log.info("found peer %s", address)
            self.peer_addresses = self.peer_addresses + [address]

    def live_peers(self) -> list[Peer]:
        """The peers heard from within ``down_after_s``."""
        now = time.time()
        return [p for p in self.peers.values() if now - p.last_seen < self.down_after_s]

    def live_node_ids(self) -> list[str]:
        return sorted([p.node_id for p in self.live_peers()] + [self.node_id])

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

    def profile_of(self, node_id: str) -> dict:
        """A node's profile as last heard (this node's own for itself; {} until measured)."""
        return (self.profile if node_id == self.node_id else self.peers[node_id].profile) or {}

    def address_of(self, node_id: str) -> str:
        if node_id == self.node_id:
            return self.address
        return self.peers[node_id].address

    def _named_nodes(self) -> set[str]:
        """The nodes the table held names: its instances' and the ones they want."""
        return {n for i in self.instances.values() for n in (*i.node_ids(), *i.wanted_nodes)}

    def hears_majority(self) -> bool:
        """Whether the live nodes are a majority of the nodes known: every node heard since
        this one started, those its table names, itself (cluster_state rule 4)."""
        return heard_majority(self.live_node_ids(), {*self.peers, *self._named_nodes()})

    # -- replicated instance table -------------------------------------------------------

    @property
    def instances(self) -> Mapping[str, Instance]:
        """The instance table held (read-only: changed by events, :meth:`commit`)."""
        return self.cluster_state.instances

    @property
    def epoch(self) -> Epoch:
        """The epoch of the table held."""
        return self.cluster_state.epoch

    async def commit(self, *events: Event) -> None:
        """Coordinator: apply ``events`` to the table, then publish it (nothing once the
        node is stopping: :meth:`stopping`)."""
        if self.is_stopping():
            return
        for event in events:
            self.cluster_state = apply(self.cluster_state, event)
        await self._publish()

    async def apply_state(self, theirs: ClusterState) -> bool:
        """Adopt a table of a newer epoch (cluster_state rule 1), keep it on disk and
        reconcile runners; False (nothing changes) for one not newer than this node's."""
        async with self._state_lock:
            adopted = apply(self.cluster_state, Adopted(theirs))
            if adopted is self.cluster_state:
                return False
            # a minority's newer term, given up for a majority's older one: never started again
            self._left_term = max(self._left_term, self.epoch.term)
            self.cluster_state = adopted
            if self._acting_term is not None and self.epoch.coordinator != self.node_id:
                # Another coordinator's newer table: this node coordinated out of touch with
                # it (a minority, cut off), and its peers' liveness is as old as the cut.
                # Start over, and hear the whole cluster (or wait the window) before a term
                # of its own: CI saw a returning coordinator fail the majority's serving
                # instance for a node it had not heard again yet.
                self._acting_term = None
                self._settled_since = time.time()
            self._save_state()
        await self.supervisor._reconcile()
        return True

    async def _publish(self) -> None:
        """Coordinator: the next epoch of its term; keep the table on disk and push it to
        every live node. A node not (yet) acting as coordinator only reconciles."""
        if self.is_coordinator():
            self.cluster_state = apply(self.cluster_state, Published())
            self._save_state()
            targets = [self.address_of(n) for n in self.live_node_ids() if n != self.node_id]
            results = await asyncio.gather(
                *(self.peer_client.push_state(a, self.cluster_state) for a in targets), return_exceptions=True
            )
            for address, result in zip(targets, results):
                if isinstance(result, PeerError):
                    self.repeated.warn(("publish", address), "could not publish the table to %s: %s",
                                       address, result)
                elif isinstance(result, BaseException):
                    raise result
                else:
                    self.repeated.ended(("publish", address))
        await self.supervisor._reconcile()

    def _save_state(self) -> None:
        """Keep the table and its epoch in ``state_path`` (rule 1 across restarts)."""
        if self.state_path is not None:
            save_table(self.state_path, self.cluster_state)
