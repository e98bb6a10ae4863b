"""Runner supervision: reconcile this node's runners with the instance table (fetch a
rank's files, start its runner, stop those no longer placed here), relay what runners
report (loaded, failed, batches, tokens) and report rank status to the coordinator."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from shardline.models.config import Sharding
from shardline.models.store import ModelNotFoundError
from shardline.node.peer_client import PeerError
from shardline.node.state import plan_runners, stale_ranks, why_ended
from shardline.node.status import InstanceStatus, RankStatus
from shardline.node.table import Instance, RankPlacement
from shardline.node.transfer import TransferError
from shardline.node.wire import RankReport
from shardline.placement.ranks import (
    ring_prefill_chunk,
)
from shardline.runner.protocol import (
    EngineStats,
    Failed,
    Loaded,
    RunnerSpec,
    Tokens,
)

if TYPE_CHECKING:
    from shardline.node.node import Node

log = logging.getLogger(__name__)


NAMING_GRACE_S = 1.0
"""Seconds a rank that lost a peer waits for the coordinator to name the rank that failed
before it fails its requests with its own words: the table of a deletion, or of a runner
that crashed on a live node, arrives within it; a dead node's takes the heartbeat's
seconds, which a client should not wait for (it waited 4.2 s)."""


class Supervisor:
    """This node's runners against the instance table, and their reports. One per node;
    the state is the node's."""

    def __init__(self, node: "Node") -> None:
        self.node = node

    async def _reconcile(self) -> None:
        """Start runners for ranks placed here; stop runners of instances gone or failed
        (:func:`~shardline.node.state.plan_runners`)."""
        node = self.node
        plan = plan_runners(node.cluster_state, node.node_id, frozenset(node.worker.runners),
                            frozenset(node._preparing))
        for instance_id in plan.cancel:
            node._preparing.pop(instance_id).cancel()
        node.router.end_forwarded()
        for instance_id in plan.stop:
            code, error = why_ended(node.instances, instance_id)
            node.router._fail_streams(instance_id, error, code)
            await asyncio.to_thread(node.worker.stop, instance_id)
            node.engine_stats.pop(instance_id, None)
        for instance_id, rank in plan.start:
            inst = node.instances[instance_id]
            node._preparing[instance_id] = asyncio.create_task(
                self._prepare_rank(inst, rank, inst.ranks[rank]))

    async def _report_unknown_statuses(self) -> None:
        """Report again each of this node's ranks whose runner is ready or failed where the
        table says otherwise (:func:`~shardline.node.state.stale_ranks`)."""
        runners = dict(self.node.worker.runners)
        for instance_id in stale_ranks(self.node.cluster_state, self.node.node_id,
                                       {i: h.status for i, h in runners.items()}):
            handle = runners[instance_id]
            loaded = dataclasses.asdict(handle.loaded) if handle.loaded else None
            await self._report_runner(instance_id, handle.status, handle.error, loaded,
                                      peer_lost=handle.peer_lost)

    async def _prepare_rank(self, inst: Instance, rank: int, placement: RankPlacement) -> None:
        """Get the files of this node's shard of ``inst`` (copying what is missing from a
        peer), then start its runner; a failure to get them fails the rank."""
        try:
            weights = await self.node.logistics._shard_weights(inst, rank, placement)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure must fail the rank, not leave it loading
            if isinstance(exc, (ModelNotFoundError, TransferError, PeerError)):
                log.error("getting the files of %s failed: %s", inst.model_id, exc)  # told, not a bug
            else:
                log.exception("getting the files of %s failed", inst.model_id)
            self.node._preparing.pop(inst.instance_id, None)
            await self._report_runner(inst.instance_id, RankStatus.FAILED,
                                      f"could not get the files of {inst.model_id}: {exc}", None)
            return
        self.node._preparing.pop(inst.instance_id, None)
        current = self.node.instances.get(inst.instance_id)
        if current is None or current.status == InstanceStatus.FAILED \
                or inst.instance_id in self.node.worker.runners:
            return
        self._start_runner(current, rank, placement, weights)
        if rank == 0:  # the others' nodes load it once idle (Membership.run)
            self.node.logistics.warm_tokenizer(inst.model_id)

    def _start_runner(self, inst: Instance, rank: int, placement: RankPlacement, weights: Path) -> None:
        """Start the runner of ``rank`` of ``inst`` on this node, reading ``weights``."""
        chunk, step, burst = RunnerSpec.prefill_chunk, RunnerSpec.prefill_step_tokens, RunnerSpec.prefill_burst_tokens
        if inst.sharding == Sharding.RING:
            chunk = step = ring_prefill_chunk(len(inst.ranks))
            burst = max(chunk, burst)
        spec = RunnerSpec(
            instance_id=inst.instance_id,
            node_id=self.node.node_id,
            model_path=str(weights),
            rank=rank,
            world_size=len(inst.ranks),
            sharding=inst.sharding,
            share=placement.share,
            master_addr=inst.master_addr,
            master_port=inst.master_port,
            host=self.node.host,
            max_batch=inst.max_batch,
            context=inst.context,
            kv_tokens=inst.kv_tokens,
            dtype=inst.dtype,
            quantize=inst.quantize,
            threads=self.node.runner_threads,
            device=self.node.device,
            collectives_on_cpu=inst.collectives_on_cpu,
            progress_timeout_s=self.node.progress_timeout_s,
            prefill_chunk=chunk, prefill_step_tokens=step, prefill_burst_tokens=burst,
            prefix_cache=inst.prefix_cache,
        )
        self.node.worker.start(spec)

    def _on_runner_message(self, instance_id: str, message: object) -> None:
        """Called from a runner's reader thread."""
        loop = self.node._loop
        if loop is None:
            return
        if isinstance(message, Tokens):
            loop.call_soon_threadsafe(self.node.router._dispatch, message.events)
        elif isinstance(message, EngineStats):
            self.node.engine_stats[instance_id] = dataclasses.asdict(message)
        elif isinstance(message, Loaded):
            report = self._report_runner(instance_id, RankStatus.READY, None,
                                         dataclasses.asdict(message))
            asyncio.run_coroutine_threadsafe(report, loop)
        elif isinstance(message, Failed):
            if message.peer_lost:  # the coordinator names the rank that failed: wait for it
                asyncio.run_coroutine_threadsafe(self._fail_streams_when_known(instance_id, message.error), loop)
            else:
                loop.call_soon_threadsafe(self.node.router._fail_streams, instance_id, message.error)
            report = self._report_runner(instance_id, RankStatus.FAILED, message.error, None,
                                         peer_lost=message.peer_lost)
            asyncio.run_coroutine_threadsafe(report, loop)

    async def _report_runner(
        self, instance_id: str, status: RankStatus, error: str | None, loaded: dict | None,
        fetched: dict | None = None, peer_lost: bool = False,
    ) -> None:
        """Report this node's rank of ``instance_id`` to the coordinator (itself, or over
        ``/internal/runner-status``); a report that finds no coordinator is made again by
        :meth:`_report_unknown_statuses`."""
        if self.node.is_stopping():
            return  # its ranks stop with it: nothing for the coordinator to act on
        report = RankReport(instance_id=instance_id, node_id=self.node.node_id, status=status,
                            error=error, loaded=loaded, fetched=fetched, peer_lost=peer_lost)
        coordinator = self.node.coordinator_id()
        if coordinator != self.node.node_id:
            try:
                await self.node.peer_client.report(self.node.address_of(coordinator), report)
                self.node.repeated.ended(("report", coordinator))
            except PeerError as exc:
                self.node.repeated.warn(("report", coordinator), "report of %s to the coordinator: %s",
                                        instance_id, exc)
        elif self.node.is_coordinator():
            await self.node.coordinator.runner_status(report.event())

    async def _fail_streams_when_known(self, instance_id: str, error: str) -> None:
        """Fail this node's requests on ``instance_id`` with the error the coordinator
        gives the instance (naming the rank that failed), or ``error`` if none comes within
        :data:`NAMING_GRACE_S`."""
        deadline = time.time() + NAMING_GRACE_S
        while time.time() < deadline:
            inst = self.node.instances.get(instance_id)
            if inst is None or inst.status == InstanceStatus.FAILED:
                break
            await asyncio.sleep(0.1)
        inst = self.node.instances.get(instance_id)
        code, named = why_ended(self.node.instances, instance_id)  # deleted: that stopped the ranks
        self.node.router._fail_streams(instance_id, error if inst is not None and not inst.error else named,
                                       code)
