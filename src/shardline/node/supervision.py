"""Runner supervision: reconcile this node's runners with the instance table (fetch a
rank's files, start its runner, stop those no longer placed here), relay what runners
report (loaded, failed, batches, tokens) and report rank status to the coordinator. The
role reads the node through :class:`SupervisionView`, runs runners through a
:class:`RunnerPool` (``shardline.node.runner_processes.Worker``) and acts through
:class:`SupervisionEffects` (``shardline.node.node`` wires them)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shardline.models.config import Sharding
from shardline.models.store import ModelNotFoundError
from shardline.node.peer_client import PeerError
from shardline.node.repeated_warnings import RepeatedWarnings
from shardline.node.runner_processes import RunnerHandle
from shardline.node.state import ClusterState, RankReported, plan_runners, stale_ranks, why_ended
from shardline.node.status import InstanceStatus, RankStatus
from shardline.node.table import EndCode, Instance, RankPlacement
from shardline.node.transfer import TransferError
from shardline.node.wire import RankReport
from shardline.placement.ranks import ring_prefill_chunk
from shardline.runner.protocol import EngineStats, Failed, Loaded, PrefillProgress, RunnerSpec, TokenEvent, Tokens

log = logging.getLogger(__name__)


NAMING_GRACE_S = 1.0
"""Seconds a rank that lost a peer waits for the coordinator to name the rank that failed
before it fails its requests with its own words: the table of a deletion, or of a runner
that crashed on a live node, arrives within it; a dead node's takes the heartbeat's
seconds, which a client should not wait for (it waited 4.2 s)."""


class SupervisionView(Protocol):
    """What supervision reads of its node (read-only)."""

    @property
    def node_id(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def cluster_state(self) -> ClusterState: ...
    @property
    def instances(self) -> Mapping[str, Instance]: ...
    @property
    def loop(self) -> asyncio.AbstractEventLoop | None: ...
    def coordinator_id(self) -> str: ...
    def is_coordinator(self) -> bool: ...
    def is_stopping(self) -> bool: ...
    def address_of(self, node_id: str) -> str: ...


class RunnerPool(Protocol):
    """This node's runner processes (``shardline.node.runner_processes.Worker``)."""

    @property
    def runners(self) -> Mapping[str, RunnerHandle]: ...
    def start(self, spec: RunnerSpec) -> object: ...
    def stop(self, instance_id: str) -> None: ...


@dataclass(frozen=True)
class RunnerSettings:
    """What every runner of this node is started with."""

    threads: int = 0
    device: str = "auto"
    progress_timeout_s: float = 60.0


@dataclass(frozen=True)
class SupervisionEffects:
    """What supervision asks of the node and the other roles."""

    shard_weights: Callable[[Instance, int, RankPlacement], Awaitable[Path]]
    """The local path of a rank's files, copied from peers first (the logistics)."""
    draft_weights: Callable[[Instance], Awaitable[Path]]
    """The local path of an instance's draft model, copied whole first (the logistics)."""
    warm_tokenizer: Callable[[str], None]
    """Load a model's tokenizer in the background (the logistics)."""
    dispatch: Callable[[tuple[TokenEvent | PrefillProgress, ...]], None]
    """Hand a runner's tokens to the node's requests (the router)."""
    fail_streams: Callable[[str, str | None, EndCode], None]
    """Fail the node's requests on an instance, with an error and its code (the router)."""
    end_forwarded: Callable[[], None]
    """End the requests forwarded to instances gone or failed (the router)."""
    engine_stats: Callable[[str, dict | None], None]
    """Keep (or, for None, drop) a rank's last batch figures."""
    send_report: Callable[[str, RankReport], Awaitable[object]]
    """Send a rank's report to the coordinator at this address."""
    runner_status: Callable[[RankReported], Awaitable[object]]
    """Act on a report as coordinator (this node's own)."""
    repeated: RepeatedWarnings
    """Warns once of a report that keeps failing."""


class Supervisor:
    """This node's runners against the instance table, and their reports. One per node."""

    def __init__(
        self,
        view: SupervisionView,
        runners: RunnerPool,
        effects: SupervisionEffects,
        settings: RunnerSettings = RunnerSettings(),
    ) -> None:
        self.view = view
        self.pool = runners
        self.effects = effects
        self.settings = settings
        self.preparing: dict[str, asyncio.Task] = {}  # instance id -> getting its files

    async def reconcile(self) -> None:
        """Start runners for ranks placed here; stop runners of instances gone or failed
        (:func:`~shardline.node.state.plan_runners`)."""
        view, effects = self.view, self.effects
        plan = plan_runners(view.cluster_state, view.node_id, frozenset(self.pool.runners), frozenset(self.preparing))
        for instance_id in plan.cancel:
            self.preparing.pop(instance_id).cancel()
        effects.end_forwarded()
        for instance_id in plan.stop:
            code, error = why_ended(view.instances, instance_id)
            effects.fail_streams(instance_id, error, code)
            await asyncio.to_thread(self.pool.stop, instance_id)
            effects.engine_stats(instance_id, None)
        for instance_id, rank in plan.start:
            inst = view.instances[instance_id]
            self.preparing[instance_id] = asyncio.create_task(self._prepare_rank(inst, rank, inst.ranks[rank]))

    async def report_stale(self) -> None:
        """Report again each of this node's ranks whose runner is ready or failed where the
        table says otherwise (:func:`~shardline.node.state.stale_ranks`)."""
        runners = dict(self.pool.runners)
        for instance_id in stale_ranks(
            self.view.cluster_state, self.view.node_id, {i: h.status for i, h in runners.items()}
        ):
            handle = runners[instance_id]
            loaded = dataclasses.asdict(handle.loaded) if handle.loaded else None
            await self.report_runner(instance_id, handle.status, handle.error, loaded, peer_lost=handle.peer_lost)

    async def _prepare_rank(self, inst: Instance, rank: int, placement: RankPlacement) -> None:
        """Get the files of this node's shard of ``inst`` (copying what is missing from a
        peer), then start its runner; a failure to get them fails the rank."""
        try:
            weights = await self.effects.shard_weights(inst, rank, placement)
            draft = None
            if inst.draft_model is not None and rank == inst.sharding.sampling_rank(len(inst.ranks)):
                draft = await self.effects.draft_weights(inst)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure must fail the rank, not leave it loading
            if isinstance(exc, (ModelNotFoundError, TransferError, PeerError)):
                log.error("getting the files of %s failed: %s", inst.model_id, exc)  # told, not a bug
            else:
                log.exception("getting the files of %s failed", inst.model_id)
            self.preparing.pop(inst.instance_id, None)
            await self.report_runner(
                inst.instance_id, RankStatus.FAILED, f"could not get the files of {inst.model_id}: {exc}", None
            )
            return
        self.preparing.pop(inst.instance_id, None)
        current = self.view.instances.get(inst.instance_id)
        if current is None or current.status == InstanceStatus.FAILED or inst.instance_id in self.pool.runners:
            return
        self.pool.start(self.runner_spec(current, rank, placement, weights, draft))
        if rank == 0:  # the others' nodes load it once idle (Membership.round)
            self.effects.warm_tokenizer(inst.model_id)

    def runner_spec(
        self, inst: Instance, rank: int, placement: RankPlacement, weights: Path, draft: Path | None = None
    ) -> RunnerSpec:
        """The spec of the runner of ``rank`` of ``inst`` on this node, reading ``weights``
        (and ``draft``, the draft model's, where it samples for an instance with one)."""
        chunk, step, burst = RunnerSpec.prefill_chunk, RunnerSpec.prefill_step_tokens, RunnerSpec.prefill_burst_tokens
        if inst.sharding == Sharding.RING:
            chunk = step = ring_prefill_chunk(len(inst.ranks))
            burst = max(chunk, burst)
        return RunnerSpec(
            instance_id=inst.instance_id,
            node_id=self.view.node_id,
            model_path=str(weights),
            rank=rank,
            world_size=len(inst.ranks),
            sharding=inst.sharding,
            share=placement.share,
            master_addr=inst.master_addr,
            master_port=inst.master_port,
            host=self.view.host,
            max_batch=inst.max_batch,
            context=inst.context,
            kv_tokens=inst.kv_tokens,
            dtype=inst.dtype,
            quantize=inst.quantize,
            threads=self.settings.threads,
            device=self.settings.device,
            collectives_on_cpu=inst.collectives_on_cpu,
            progress_timeout_s=self.settings.progress_timeout_s,
            prefill_chunk=chunk,
            prefill_step_tokens=step,
            prefill_burst_tokens=burst,
            prefix_cache=inst.prefix_cache,
            model_drafts=inst.draft_model is not None,
            draft_model_path=str(draft) if draft is not None else None,
        )

    def on_runner_message(self, instance_id: str, message: object) -> None:
        """Called from a runner's reader thread."""
        loop, effects = self.view.loop, self.effects
        if loop is None:
            return
        if isinstance(message, Tokens):
            loop.call_soon_threadsafe(effects.dispatch, message.events)
        elif isinstance(message, EngineStats):
            effects.engine_stats(instance_id, dataclasses.asdict(message))
        elif isinstance(message, Loaded):
            report = self.report_runner(instance_id, RankStatus.READY, None, dataclasses.asdict(message))
            asyncio.run_coroutine_threadsafe(report, loop)
        elif isinstance(message, Failed):
            if message.peer_lost:  # the coordinator names the rank that failed: wait for it
                asyncio.run_coroutine_threadsafe(self._fail_streams_when_known(instance_id, message.error), loop)
            else:
                loop.call_soon_threadsafe(effects.fail_streams, instance_id, message.error, EndCode.INSTANCE_FAILED)
            report = self.report_runner(
                instance_id, RankStatus.FAILED, message.error, None, peer_lost=message.peer_lost
            )
            asyncio.run_coroutine_threadsafe(report, loop)

    async def report_runner(
        self,
        instance_id: str,
        status: RankStatus,
        error: str | None,
        loaded: dict | None,
        fetched: dict | None = None,
        peer_lost: bool = False,
    ) -> None:
        """Report this node's rank of ``instance_id`` to the coordinator (itself, or over
        ``/internal/runner-status``); a report that finds no coordinator is made again by
        :meth:`report_stale`."""
        view, effects = self.view, self.effects
        if view.is_stopping():
            return  # its ranks stop with it: nothing for the coordinator to act on
        report = RankReport(
            instance_id=instance_id,
            node_id=view.node_id,
            status=status,
            error=error,
            loaded=loaded,
            fetched=fetched,
            peer_lost=peer_lost,
        )
        coordinator = view.coordinator_id()
        if coordinator != view.node_id:
            try:
                await effects.send_report(view.address_of(coordinator), report)
                effects.repeated.ended(("report", coordinator))
            except PeerError as exc:
                effects.repeated.warn(("report", coordinator), "report of %s to the coordinator: %s", instance_id, exc)
        elif view.is_coordinator():
            await effects.runner_status(report.event())

    async def report_fetching(self, instance_id: str, done: int, total: int) -> None:
        """Report that this node's rank of ``instance_id`` has copied ``done`` of its
        ``total`` bytes."""
        await self.report_runner(
            instance_id, RankStatus.FETCHING, None, None, fetched={"done_bytes": done, "total_bytes": total}
        )

    async def _fail_streams_when_known(self, instance_id: str, error: str) -> None:
        """Fail this node's requests on ``instance_id`` with the error the coordinator
        gives the instance (naming the rank that failed), or ``error`` if none comes within
        :data:`NAMING_GRACE_S`."""
        deadline = time.time() + NAMING_GRACE_S
        while time.time() < deadline:
            inst = self.view.instances.get(instance_id)
            if inst is None or inst.status == InstanceStatus.FAILED:
                break
            await asyncio.sleep(0.1)
        inst = self.view.instances.get(instance_id)
        code, named = why_ended(self.view.instances, instance_id)  # deleted: that stopped the ranks
        self.effects.fail_streams(instance_id, error if inst is not None and not inst.error else named, code)
