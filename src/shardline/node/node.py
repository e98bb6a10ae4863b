"""A shardline node: membership, the replicated instance table, placement, request routing.

One node runs per machine and never runs model code itself (its runners do). Nodes talk
over HTTP (``/internal/*``):

- membership: every node polls its peers' ``/internal/info`` each second (five times a
  second until it is settled), naming itself (``peer_client.MEMBER_HEADER``); the polled
  node adds it to its peers and answers with the members it knows, so a node that
  contacts one member joins all of them. A node silent for ``down_after_s`` is down. The coordinator is the live node with the smallest id,
  once settled (``shardline.node.epochs``: terms, epochs and their invariants).
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
``supervision.py``, ``logistics.py`` and ``routing.py``. None knows this class: each
reads a narrow read-only view of the node (a ``Protocol`` in its module; the node passes
itself) and acts through the callbacks given here. Every message between nodes is a
``wire.py`` model sent through ``peer_client.PeerClient``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path

import psutil

from shardline.models.store import ModelStore
from shardline.node.coordinator import Coordinator, CoordinatorEffects
from shardline.node.epochs import Epoch
from shardline.node.forecast import Forecast
from shardline.node.link_probe import LinkMeter
from shardline.node.logistics import LogisticsEffects, ModelLogistics
from shardline.node.membership import Membership, MembershipEffects
from shardline.node.node_memory import NodeMemory
from shardline.node.peer_client import PeerClient, PeerError
from shardline.node.queue_bound import DEFAULT_MAX_WAITING
from shardline.node.repeated_warnings import RepeatedWarnings
from shardline.node.routing import RequestStream, Router
from shardline.node.runner_processes import Spare, Worker
from shardline.node.signing import signing_key
from shardline.node.speeds import HostProfiler, ServedLog
from shardline.node.state import Adopted, ClusterState, Deleted, Event, Published, TermStarted, apply
from shardline.node.supervision import RunnerSettings, SupervisionEffects, Supervisor
from shardline.node.table import EndCode, Instance, InstanceFailedError, Peer
from shardline.node.table_file import load_table, save_table
from shardline.node.wire import NodeInfo

log = logging.getLogger(__name__)


class Node:
    """A node: its state, what it knows of its peers (who is live, who coordinates) and
    the replicated instance table (publish, adopt, keep on disk); the composition root of
    its roles: :class:`~shardline.node.membership.Membership`
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
            imports done (``shardline.node.runner_processes``).
        first_spare: the first such runner, started already (the ``run`` command starts it
            before importing the node, so their imports overlap).
    """

    router: Router
    served: ServedLog

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
        self._table_event = asyncio.Event()  # set and replaced whenever the table changes
        self.state_path = state_path  # where the table and its epoch are kept
        kept = None if state_path is None else load_table(state_path)
        # the instance table and its epoch (node.state); a kept one is desired state: no
        # runner starts from it until a coordinator publishes
        self._cluster_state = ClusterState() if kept is None else kept
        self.streams: dict[int, RequestStream] = {}
        self.engine_stats: dict[str, dict] = {}  # instance id -> this node's rank's batch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False  # told to stop: changes and watches nothing more
        self.signing_key = signing_key(cluster_key)  # scrypt: tens of ms, once
        self.peer_client = PeerClient(self.signing_key, self.address)  # every node-to-node call
        self._background: list[asyncio.Task] = []
        self._state_lock = asyncio.Lock()
        self.profile: dict | None = None  # HostProfile.to_dict(): node.speeds.HostProfiler
        self.link_meter = LinkMeter(self.peer_client.measure_link)
        self.links = self.link_meter.links  # node id -> the link from this node (link_probe)
        self.repeated = RepeatedWarnings(log)  # a peer down: one warning, not one a second
        # the roles: each reads this node (a narrow view of it, typed in its module) and
        # changes it through the callbacks given here (the node is their composition root)
        self._control_roles()
        self._local_roles(
            store,
            RunnerSettings(runner_threads, device, progress_timeout_s),
            watchdog_s,
            spare_runner,
            first_spare,
            state_path,
        )
        self.discovery = None
        if mdns:
            from shardline.node.discovery import Discovery

            self.discovery = Discovery(node_id, host, port, self.add_peer)

    def _control_roles(self) -> None:
        """The roles of the cluster's control: membership (peers, terms, the coordinator's
        election) and the coordinator (placement, the table's changes)."""
        self.membership = Membership(
            self,
            MembershipEffects(
                fetch_info=lambda address: self.peer_client.info(address),
                fetch_state=lambda address: self.peer_client.state(address),
                record_peer=self._record_peer,
                add_peer=self.add_peer,
                adopt=self.apply_state,
                probe_link=self._probe_link,
                enter_term=self._enter_term,
                publish=self.publish,
                place_again=lambda instance_id: self.background(self.coordinator.replace(instance_id)),
                coordinate=self._coordinate,
                report_stale=lambda: self.supervisor.report_stale(),
                loading=lambda: self.worker.loading(),
                when_idle=self._when_idle,
            ),
        )
        self.coordinator = Coordinator(
            self,
            CoordinatorEffects(
                commit=self.commit,
                drop_unpublished=self._drop_unpublished,
                background=self.background,
                poll=lambda address: self.membership.poll(address),
                model_card=lambda model_id: self.logistics.model_card(model_id),
                adopt=lambda model: self.logistics.adopt(model),
                check_whole=lambda model_id: self.logistics.check_whole(model_id),
                node_profiles=lambda node_ids: self.forecast.node_profiles(node_ids),
                served_speeds=lambda: self.forecast.served_speeds(),
                free_bytes=lambda node_id: self.memory.free(node_id),
                runtime_baseline=lambda node_ids: self.memory.runtime_baseline(node_ids),
                free_port=lambda address: self.peer_client.free_port(address),
                tokenizer=lambda model_id: self.logistics.tokenizer(model_id),
            ),
        )

    def _local_roles(
        self,
        store: ModelStore,
        settings: RunnerSettings,
        watchdog_s: float,
        spare_runner: bool,
        first_spare: Spare | None,
        state_path: Path | None,
    ) -> None:
        """The roles of this node's own work: its memory and speed forecasts, its runners
        (worker and supervisor), model files (logistics), requests (router), its profile
        and the speeds its requests showed."""
        self.memory = NodeMemory(self, lambda: self.worker.resident_bytes())
        self.forecast = Forecast(
            self,
            self.memory.free,
            lambda: self.served.speeds.values(),
            lambda model_id: self.logistics.model_card(model_id),
            self.background,
        )
        self.worker = Worker(
            lambda instance_id, message: self.supervisor.on_runner_message(instance_id, message),
            watchdog_s=watchdog_s,
            spare=spare_runner,
        )
        self._first_spare = first_spare
        self.supervisor = Supervisor(
            self,
            self.worker,
            SupervisionEffects(
                shard_weights=lambda inst, rank, placement: self.logistics.shard_weights(inst, rank, placement),
                draft_weights=lambda inst: self.logistics.draft_weights(inst),
                warm_tokenizer=lambda model_id: self.logistics.warm_tokenizer(model_id),
                dispatch=lambda events: self.router.dispatch(events),
                fail_streams=lambda instance_id, error, code: self.router.fail_streams(instance_id, error, code),
                end_forwarded=lambda: self.router.end_forwarded(),
                engine_stats=self._keep_engine_stats,
                send_report=lambda address, report: self.peer_client.report(address, report),
                runner_status=lambda event: self.coordinator.runner_status(event),
                repeated=self.repeated,
            ),
            settings,
        )
        self.logistics = ModelLogistics(
            self,
            store,
            self.model_dirs,
            self.peer_client,
            LogisticsEffects(
                poll=lambda address: self.membership.poll(address),
                background=self.background,
                report_fetching=lambda instance_id, done, total: self.supervisor.report_fetching(
                    instance_id, done, total
                ),
            ),
        )
        self.router = Router(self)
        from shardline.node.identity import default_data_dir
        from shardline.node.profile import PROFILE_FORMAT

        # one file per runner thread count: nodes of 1- and 3-node local clusters run
        # runners on 2 and 1 threads here, and a shared file made every start of the
        # other kind measure (a torch child beside the start-up, killed at placement)
        self.profiler = HostProfiler(
            self,
            self._keep_profile,
            default_data_dir() / f"host-profile-v{PROFILE_FORMAT}-{settings.device}-threads{settings.threads}.json",
            threads=settings.threads,
            device=settings.device,
        )
        self.served = ServedLog(
            lambda *args, **kwargs: self.forecast.first_order(*args, **kwargs),
            None if state_path is None else state_path.parent / "served-speeds.json",
        )

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # its imports overlap the node's start-up and election
        self.worker.start_spare(self._first_spare)
        self._first_spare = None
        # (later ones: the membership loop, once idle: _when_idle)
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

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The node's event loop, once started."""
        return self._loop

    def _begin_stop(self) -> None:
        log.info("stopping: %d open request(s) end with an error, the runners are stopped", len(self.streams))
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
            node_id=self.node_id,
            address=self.address,
            started_at=self.started_at,
            available_bytes=memory["free_bytes"],
            **memory,
            total_bytes=int(psutil.virtual_memory().total),
            memory_limit_bytes=self.memory_limit_bytes,
            models=self.store.summary(),
            epoch=self.epoch,
            coordinator=self.coordinator_id(),
            settled=self.is_settled(),
            profile=profile,
            links=self.links,
            members=self.member_addresses(),
            busy=self.busy_instances(),
            served=self.served.to_list(),
        )

    def busy_instances(self) -> list[str]:
        """Instances whose rank on this node has requests running, waiting or held."""
        return sorted(
            i
            for i, stats in self.engine_stats.items()
            if stats.get("running") or stats.get("waiting") or stats.get("held")
        )

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
        """Whether this node acts as coordinator (:meth:`Membership.is_coordinator`)."""
        return self.membership.is_coordinator()

    def is_settled(self) -> bool:
        """Whether this node has settled (:meth:`Membership.is_settled`)."""
        return self.membership.is_settled()

    def hears_majority(self) -> bool:
        """Whether this node hears a majority (:meth:`Membership.hears_majority`)."""
        return self.membership.hears_majority()

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

    # -- the roles' callbacks -----------------------------------------------------------

    def _record_peer(self, peer: Peer) -> None:
        self.peers[peer.node_id] = peer

    def _probe_link(self, node_id: str, address: str) -> None:
        if self.link_meter.claim(node_id, time.time()):
            self.background(self.link_meter.measure(node_id, address))

    def _drop_unpublished(self, instance_id: str) -> None:
        self.cluster_state = apply(self.cluster_state, Deleted(instance_id))

    def _enter_term(self, event: TermStarted) -> None:
        self.cluster_state = apply(self.cluster_state, event)

    async def _coordinate(self) -> None:
        await self.coordinator.fail_lost_instances()
        if self.rejoin:
            await self.coordinator.rejoin_returned_nodes()
        await self.coordinator.retire_superseded()

    async def _when_idle(self) -> None:
        for model_id in {i.model_id for i in self.instances.values() if self.node_id in i.node_ids()}:
            self.logistics.warm_tokenizer(model_id)
        await asyncio.to_thread(self.worker.start_spare)

    def _keep_profile(self, profile: dict | None) -> None:
        self.profile = profile

    def _keep_engine_stats(self, instance_id: str, stats: dict | None) -> None:
        if stats is None:
            self.engine_stats.pop(instance_id, None)
        else:
            self.engine_stats[instance_id] = stats

    # -- replicated instance table -------------------------------------------------------

    @property
    def cluster_state(self) -> ClusterState:
        """The instance table held and its epoch (changed by events: :meth:`commit`,
        :meth:`apply_state`)."""
        return self._cluster_state

    @cluster_state.setter
    def cluster_state(self, state: ClusterState) -> None:
        changed = state is not self._cluster_state
        self._cluster_state = state
        if changed:  # wake those waiting on the table (table_changed)
            self._table_event.set()
            self._table_event = asyncio.Event()

    async def table_changed(self, timeout_s: float) -> None:
        """Return once the table changes (any new value: a request waiting for a ready
        instance looks again), or after ``timeout_s`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._table_event.wait(), timeout_s)

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
        await self.publish()

    async def apply_state(self, theirs: ClusterState) -> bool:
        """Adopt a table of a newer epoch (epochs rule 1), keep it on disk and
        reconcile runners; False (nothing changes) for one not newer than this node's."""
        async with self._state_lock:
            adopted = apply(self.cluster_state, Adopted(theirs))
            if adopted is self.cluster_state:
                return False
            held_term = self.epoch.term
            self.cluster_state = adopted
            self.membership.adopted(held_term, self.epoch.coordinator)
            self._save_state()
        await self.supervisor.reconcile()
        return True

    async def publish(self) -> None:
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
                    self.repeated.warn(("publish", address), "could not publish the table to %s: %s", address, result)
                elif isinstance(result, BaseException):
                    raise result
                else:
                    self.repeated.ended(("publish", address))
        await self.supervisor.reconcile()

    def _save_state(self) -> None:
        """Keep the table and its epoch in ``state_path`` (rule 1 across restarts)."""
        if self.state_path is not None:
            save_table(self.state_path, self.cluster_state)
