"""The coordinator's decisions: placing a model (memory admission, the placement
preview), failing an instance and placing it again, placing it on returning nodes, and
the runner status reports that change the instance table. Only the acting coordinator
changes the table (:mod:`shardline.node.epochs`), by events
(:mod:`shardline.node.state`) it commits through the node (``Node.commit``). The role
reads the node through :class:`CoordinatorView` and acts through
:class:`CoordinatorEffects` (``shardline.node.node`` wires both)."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Protocol

from shardline.models.config import ModelConfig, Sharding
from shardline.models.store import ModelCard, ModelNotFoundError
from shardline.models.tokenizer import Tokenizer, draft_mismatch
from shardline.node.epochs import RejoinView, rejoinable
from shardline.node.peer_client import PeerError
from shardline.node.state import (
    ClusterState,
    Deleted,
    InstanceFailed,
    KeptAlive,
    NotPlacedAgain,
    Placed,
    RankReported,
    RejoinDropped,
    down_rank_failure,
    instance_named,
    lost_rank_failures,
    replaced_ids,
    sharding_again,
    stand_in_not_needed,
    standing_in,
    superseded,
)
from shardline.node.status import InstanceStatus, RankStatus
from shardline.node.table import Instance, Peer, RankPlacement
from shardline.node.transfer import TransferError
from shardline.placement.layer_ranges import NodeCapacity, PlacementError
from shardline.placement.ranks import (
    DraftModelError,
    DraftModelNotFoundError,
    PlacementOptions,
    PlacementRequestError,
    draft_hint,
    draft_model_bytes,
    kv_pool_tokens,
    place_with_kv_pool,
    ranks_bytes,
    with_draft_model,
)
from shardline.placement.served import PlacementKey, ServedSpeed
from shardline.runner.rendezvous import ranks_share_a_gpu

log = logging.getLogger(__name__)

HANDOVER_S = 2.0
"""Seconds an instance placed beside the one it stands in for has been ready before the
old one, idle, is deleted: two membership rounds, by which every node has adopted the
table that routes requests to the new one and reported what still runs on the old."""


def free_port() -> int:
    """A TCP port that was free on this machine a moment ago."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _Deleted(Exception):
    """The failed instance a placement was to replace was deleted meanwhile."""


class CoordinatorView(Protocol):
    """What the coordinator reads of its node (read-only)."""

    @property
    def node_id(self) -> str: ...
    @property
    def started_at(self) -> float: ...
    @property
    def down_after_s(self) -> float: ...
    @property
    def max_replacements(self) -> int: ...
    @property
    def default_context(self) -> int: ...
    @property
    def default_max_batch(self) -> int: ...
    @property
    def cluster_state(self) -> ClusterState: ...
    @property
    def instances(self) -> Mapping[str, Instance]: ...
    @property
    def peers(self) -> Mapping[str, Peer]: ...
    def live_node_ids(self) -> list[str]: ...
    def live_peers(self) -> list[Peer]: ...
    def address_of(self, node_id: str) -> str: ...
    def profile_of(self, node_id: str) -> dict: ...
    def incarnation_of(self, node_id: str) -> float: ...
    def is_coordinator(self) -> bool: ...
    def busy_instances(self) -> list[str]: ...


@dataclass(frozen=True)
class CoordinatorEffects:
    """What the coordinator asks of the node and the other roles."""

    commit: Callable[..., Awaitable[None]]
    """Apply events to the table and publish it (``Node.commit(*events)``)."""
    drop_unpublished: Callable[[str], None]
    """Take an instance out of the table without publishing (published with the next)."""
    background: Callable[[Coroutine[object, object, object]], None]
    """Run a coroutine as a task of the node's."""
    poll: Callable[[str], Awaitable[bool]]
    """Poll a peer now; whether it answered (the membership)."""
    model_card: Callable[[str], Awaitable[ModelCard]]
    """A model's card (the logistics)."""
    adopt: Callable[[str | None], Awaitable[str]]
    """The model id for what a request names (the logistics)."""
    check_whole: Callable[[str], Awaitable[None]]
    """Check that a live node holds every file of a model (the logistics)."""
    node_profiles: Callable[[list[str]], tuple[list, dict]]
    """The preview's profiles and links of these nodes (the forecast)."""
    served_speeds: Callable[[], Mapping[PlacementKey, ServedSpeed]]
    """What the live nodes' placements served (the forecast)."""
    free_bytes: Callable[[str], int]
    """What a live node can give the next placement (the node memory)."""
    runtime_baseline: Callable[[list[str]], int]
    """Runtime bytes per rank on these nodes (the node memory)."""
    free_port: Callable[[str], Awaitable[int]]
    """A free port on the peer at this address."""
    tokenizer: Callable[[str], Awaitable[Tokenizer]]
    """A model's tokenizer (the logistics)."""


class Coordinator:
    """The coordinator's decisions on the node's instance table (acted on only while the
    node coordinates). One per node."""

    def __init__(self, view: CoordinatorView, effects: CoordinatorEffects) -> None:
        self.view = view
        self.effects = effects
        self.replacing: set[str] = set()  # failed instances being placed again
        self._announced: set[str] = set()  # instances whose "is ready" was logged
        self._failures_said: set[str] = set()  # instances whose failure was acted on
        self._no_room_beside: set[str] = set()  # rejoins that did not fit beside their instance

    async def fail_lost_instances(self) -> None:
        """Coordinator: fail the instances with a rank on a node that is down, or that
        restarted since the placement (epochs rule 5)."""
        incarnations = {p.node_id: p.started_at for p in self.view.peers.values()}
        incarnations[self.view.node_id] = self.view.started_at
        for event in lost_rank_failures(self.view.cluster_state, set(self.view.live_node_ids()), incarnations):
            await self._fail_instance(event)

    async def rejoin_returned_nodes(self) -> None:
        """Coordinator: place an instance that runs on other nodes than it was placed on
        (fewer of them, or others) again on its own, once they are all back (cluster_state
        rule 6): beside the serving one where both fit (it keeps serving until the new one
        is ready: :meth:`retire_superseded`), else in its place once it is idle (its old
        ranks stop when the new table is published). If the new placement is refused the
        instance stays as it is and is not tried again."""
        live = self.view.live_node_ids()
        busy = self._busy()
        standing = standing_in(self.view.instances)
        views = {
            i.instance_id: RejoinView(
                i.status, tuple(i.node_ids()), tuple(i.wanted_nodes), i.instance_id in busy, i.instance_id in standing
            )
            for i in self.view.instances.values()
        }
        for instance_id in rejoinable(views, live):
            inst = self.view.instances[instance_id]
            if instance_id in busy and instance_id in self._no_room_beside:
                continue  # tried: both do not fit; in its place once it is idle
            try:
                card = await self.effects.model_card(inst.model_id)

                async def place() -> Instance:
                    return await self._place(
                        card,
                        inst.sharding,
                        list(inst.wanted_nodes),
                        inst.placement_options(),
                        replaced=replaced_ids(inst),
                        stands_in_for=instance_id,
                    )

                try:
                    new = await place()
                    how = "beside it (it serves until the new one is ready)"
                except PlacementError:
                    if instance_id in busy:
                        self._no_room_beside.add(instance_id)
                        continue  # no room for both: in its place, once it is idle
                    # No room for both: out of the table while placing, so that its ranks'
                    # bytes are not counted against the placement that replaces them;
                    # published with the new instance.
                    self.effects.drop_unpublished(instance_id)
                    new = await place()
                    how = "in its place (no room for both)"
            except (PlacementError, ModelNotFoundError, PeerError, PlacementRequestError) as exc:
                log.warning("could not place %s on its returning node(s) again: %s", inst.model_id, exc)
                back = () if instance_id in self.view.instances else (Placed(inst),)
                await self.effects.commit(*back, RejoinDropped(instance_id))
                continue
            log.info(
                "instance %s of %s: its node(s) are back; placed again on %s as %s, %s",
                instance_id,
                inst.model_id,
                ", ".join(inst.wanted_nodes),
                new.instance_id,
                how,
            )

    def _busy(self) -> set[str]:
        """The instances a node of the cluster reports a request running or waiting on."""
        return set(self.view.busy_instances()).union(*(p.busy for p in self.view.live_peers()))

    async def retire_superseded(self) -> None:
        """Coordinator: delete the instances a ready one stands in for
        (``state.superseded``) once they are idle and it has been ready for
        :data:`HANDOVER_S` (every node routes to the new one by then, so none takes a
        request on the old one after the busy reports were read)."""
        standing = standing_in(self.view.instances)
        busy = self._busy()
        now = time.time()
        for old in sorted(superseded(self.view.instances) - busy):
            new = standing[old]
            if new.ready_at is None or now - new.ready_at < HANDOVER_S:
                continue
            await self.effects.commit(Deleted(old))
            log.info(
                "instance %s of %s handed over to %s (%s on %d node(s))",
                old,
                new.model_id,
                new.instance_id,
                new.sharding,
                len(new.ranks),
            )

    async def runner_status(self, report: RankReported) -> bool:
        """Coordinator: a node reports one of its ranks as fetching files, ready or failed.
        False (nothing changes) where this node does not coordinate: only the coordinator
        changes the table (the reporter reports again)."""
        if not self.view.is_coordinator():
            return False
        before = self.view.instances.get(report.instance_id)
        await self.effects.commit(report)
        after = self.view.instances.get(report.instance_id)
        if before is None or after is None or before.status == InstanceStatus.FAILED:
            return True
        if after.status == InstanceStatus.FAILED:
            if self._first_word_of_failure(after.instance_id):
                log.warning("instance %s failed: %s", after.instance_id, after.error)
                self.effects.background(self.replace(after.instance_id))
        elif report.status == RankStatus.FAILED:  # only lost a peer
            # Only a symptom: another rank failed or its node went down. Wait for that
            # rank's own report (or its node's silence) to name it.
            rank = after.node_ids().index(report.node_id)
            self.effects.background(
                self._fail_after_grace(report.instance_id, f"rank {rank} on node {report.node_id} {report.error}")
            )
        elif (
            after.status == InstanceStatus.READY
            and before.status == InstanceStatus.LOADING
            and after.instance_id not in self._announced
        ):
            # two ranks' reports committed together both see loading -> ready: said once
            self._announced.add(after.instance_id)
            log.info(
                "instance %s of %s is ready: %s on %d node(s)",
                after.instance_id,
                after.model_id,
                after.sharding,
                len(after.ranks),
            )
        return True

    def _first_word_of_failure(self, instance_id: str) -> bool:
        """Whether this is the first the coordinator acts on an instance's failure (the one
        that logs it and places it again): reports committed together (two awaits apart)
        each see it fail, and a report's commit can find it failed by a restarted node's
        event (at once, not after the grace that a replacement of a failure waits)."""
        if instance_id in self._failures_said:
            return False
        self._failures_said.add(instance_id)
        return True

    async def _fail_after_grace(self, instance_id: str, error: str) -> None:
        """Coordinator: fail ``instance_id`` with ``error`` (a rank that lost contact with
        another) unless, within a grace, the rank that failed reported
        its own failure or its node was found down (then that is what the error names):
        a grace of ``down_after_s + 1``, the time a killed node takes to be found down."""
        deadline = time.time() + self.view.down_after_s + 1.0
        while time.time() < deadline:
            inst = self.view.instances.get(instance_id)
            if inst is None or inst.status == InstanceStatus.FAILED:
                return
            down = down_rank_failure(inst, set(self.view.live_node_ids()))
            if down is not None:
                await self._fail_instance(down)
                return
            await asyncio.sleep(0.2)
        await self._fail_instance(InstanceFailed(instance_id, error))

    async def _fail_instance(self, event: InstanceFailed) -> None:
        """Coordinator: mark an instance failed (every node stops its runners and fails
        its in-flight requests), then place the model again on the nodes that are live."""
        inst = self.view.instances.get(event.instance_id)
        if inst is None or inst.status == InstanceStatus.FAILED or not self._first_word_of_failure(inst.instance_id):
            return
        if event.at_once:  # the ranks went with their restarted nodes: expected, not a fault
            log.info("instance %s ended: %s; placing it again", event.instance_id, event.error)
        else:
            log.warning("instance %s failed: %s", event.instance_id, event.error)
        await self.effects.commit(event)
        self.effects.background(self.replace(event.instance_id, wait=not event.at_once))

    async def replace(self, instance_id: str, wait: bool = True) -> None:
        """Place a failed instance again (once: a second call for the same instance while
        one runs does nothing), after ``down_after_s + 1`` so that a vanished node has
        missed its heartbeats and is not chosen again, unless it had served and every node
        of it not yet found down answers a poll now (a runner died, or its node was found
        down already: 6 s of 503s saved; one that
        failed while loading keeps the wait, so its reason stays in the table a while and
        a model that cannot load is not placed again in a tight loop); at once without
        ``wait`` (its ranks died with restarted nodes that have been heard since, e.g. a
        cluster started again with its kept table)."""
        if instance_id in self.replacing:
            return
        self.replacing.add(instance_id)
        try:
            failed = self.view.instances.get(instance_id)
            if wait and not (failed is not None and failed.ready_at is not None and await self._all_answer(failed)):
                await asyncio.sleep(self.view.down_after_s + 1)
            failed = self.view.instances.get(instance_id)
            if failed is not None and failed.status == InstanceStatus.FAILED and self.view.is_coordinator():
                await self._place_again(failed)
        finally:
            self.replacing.discard(instance_id)

    async def _all_answer(self, inst: Instance) -> bool:
        """Whether every other node of ``inst`` still counted live answers a poll now (a
        node already found down is not chosen again, so it need not be waited for:
        trial 6 saw 6 s of 503s after the node-down failure for nothing)."""
        live = set(self.view.live_node_ids())
        others = {r.address for r in inst.ranks if r.node_id != self.view.node_id and r.node_id in live}
        answers = await asyncio.gather(*(self.effects.poll(address) for address in others))
        return all(answers)

    async def _place_again(self, failed: Instance) -> None:
        if stand_in_not_needed(self.view.instances, failed):
            # A rejoin's instance, placed beside one that still serves or is placed again
            # itself: deleted, not placed again (the rejoin rule tries again from that
            # one; placing both again left two copies for good: trials 6 and 7).
            log.info(
                "instance %s, placed beside %s, failed: deleted; the model goes on from %s",
                failed.instance_id,
                failed.stands_in_for,
                failed.stands_in_for,
            )
            await self.effects.commit(Deleted(failed.instance_id))
            return
        retries = failed.retries + 1 if failed.ready_at is None else 0
        if retries > self.view.max_replacements:
            # Leave the failed instance in the table, so its error stays visible.
            log.error("giving up on %s after %d failed placements", failed.model_id, retries)
            if not failed.given_up:
                await self.effects.commit(
                    NotPlacedAgain(failed.instance_id, f"gave up after {retries} failed placements")
                )
            return
        live = set(self.view.live_node_ids())
        wanted = list(failed.wanted_nodes) or failed.node_ids()
        nodes = [n for n in wanted if n in live] or None
        try:
            card = await self.effects.model_card(failed.model_id)
            await self._place(
                card,
                sharding_again(failed, nodes),
                nodes,
                failed.placement_options(),
                retries,
                wanted_nodes=wanted,
                replaces=failed.instance_id,
                replaced=replaced_ids(failed),
            )
        except _Deleted:
            log.info("not placing %s again: its instance %s was deleted meanwhile", failed.model_id, failed.instance_id)
            return
        except (PlacementError, ModelNotFoundError, PeerError, PlacementRequestError) as exc:
            # Left in the table with its error; a later term tries again.
            log.error("could not place %s again: %s", failed.model_id, exc)
            await self.effects.commit(NotPlacedAgain(failed.instance_id, str(exc)))
            return
        # Only now, so the table never shows the model without an instance in between (a
        # client waiting for the kept model would place a second one).
        if failed.instance_id in self.view.instances:
            await self.effects.commit(Deleted(failed.instance_id))

    async def create_instance(
        self, model: str | None, node_ids: list[str] | None = None, options: PlacementOptions = PlacementOptions()
    ) -> Instance:
        """Coordinator: place ``model`` (an id, see :meth:`adopt`) under ``options`` and
        start loading it.

        On ``node_ids`` (in rank order) when given. Otherwise, with several shardings (the
        API's ``"auto"``) or with ``min_nodes`` / ``max_nodes``, the placement with the best
        predicted decode tokens/s among the shardings allowed and those node counts; else
        all live nodes.

        ``dtype`` is the ranks' compute dtype. bfloat16 halves the memory of float32; a
        tensor instance in bfloat16 rounds its partial sums differently from one node and
        may pick a different token where two are nearly tied, in float32 it does not.
        ``force`` skips memory admission: the user knows better than the measured memory
        (a rank that then runs out of memory fails its instance). ``kv_cache_bytes`` sizes
        the KV pool (the whole model's, all ranks together); without it the pool is
        ``max_batch`` sequences of ``context`` tokens, or as much as fits
        (:func:`~shardline.placement.ranks.place_with_kv_pool`). ``quantize`` quantizes the
        weights the files hold in 16 or 32 bits on load. ``prefix_cache`` False: its ranks
        keep no finished prompt for later ones (:mod:`shardline.runner.prefix_cache`).

        Raises:
            ModelNotFoundError: no node has the model.
            ModelStoreError, UnsupportedModelError: a local path that is not a model
                shardline can run.
            PlacementError: the model does not fit the nodes.
            KVCacheRequestError: ``kv_cache_bytes`` holds less than one sequence.
        """
        card = await self.effects.model_card(await self.effects.adopt(model))
        chosen = options.shardings[0]
        if len(options.shardings) > 1 or (node_ids is None and (options.min_nodes or options.max_nodes)):
            best = (await self.preview(card, node_ids, options, best_only=True))[0]
            chosen, node_ids = best.sharding, list(best.node_ids)
        return await self._place(card, chosen, node_ids, options)

    async def preview(
        self, card: ModelCard, node_ids: list[str] | None, options: PlacementOptions, best_only: bool = False
    ):
        """Candidate placements of a model on the live nodes (``node_ids``: these; None:
        all) under ``options``, fastest predicted first (``shardline.placement.preview``);
        with ``best_only`` just the best feasible one.

        Raises:
            PlacementError: unknown nodes; with ``best_only``, no placement fits (the
                message gives each candidate's reason).
        """
        from shardline.placement.preview import auto, preview

        config, chosen, options = self._placement_inputs(card, node_ids, options)
        min_nodes = options.min_nodes or 1
        if min_nodes > len(chosen):
            raise PlacementError(f"min_nodes is {min_nodes} but {len(chosen)} live node(s) can be used")
        profiles, links = self.effects.node_profiles(chosen)
        choose = auto if best_only else preview
        chosen_placements = choose(
            config,
            profiles,
            links,
            options,
            weight_file_bytes=card.weight_file_bytes,
            baseline_bytes=self.effects.runtime_baseline(chosen),
            model_id=card.model_id,
            served=list(self.effects.served_speeds().values()),
            draft_bytes=await self._draft_bytes(card, options),
        )
        return [chosen_placements] if best_only else chosen_placements

    def _placement_inputs(
        self, card: ModelCard, node_ids: list[str] | None, options: PlacementOptions
    ) -> tuple[ModelConfig, list[str], PlacementOptions]:
        """The model's config, the chosen live nodes (default all) and ``options`` with the
        instance's context and max_batch (defaults filled in), for placing or previewing.

        Raises:
            PlacementError: a chosen node is not in the cluster or is down.
            ContextRequestError: a context over the model's trained one.
        """
        config = ModelConfig.from_dict(card.config)
        live = self.view.live_node_ids()
        chosen = node_ids or live
        unknown = [n for n in chosen if n not in live]
        if unknown:
            raise PlacementError(f"nodes not in the cluster (or down): {', '.join(unknown)}")
        options = options.resolved(
            config.max_position_embeddings, card.model_id, self.view.default_context, self.view.default_max_batch
        )
        return config, chosen, options

    async def _place(
        self,
        card: ModelCard,
        sharding: Sharding,
        node_ids: list[str] | None,
        options: PlacementOptions,
        retries: int = 0,
        wanted_nodes: list[str] | None = None,
        replaces: str | None = None,
        replaced: tuple[str, ...] = (),
        stands_in_for: str | None = None,
    ) -> Instance:
        """Place ``card`` under ``sharding`` and ``options`` and publish the instance.
        ``wanted_nodes``: the nodes a failed instance was placed on; kept on the new one
        when it gets other nodes (fewer of them, or others where none was live: rule 6).
        ``replaces``: the failed instance this placement stands in for. ``replaced``: the
        ids the new instance answers for (``state.replaced_ids``). ``stands_in_for``: the
        serving instance a rejoin places this one beside.

        Raises:
            _Deleted: ``replaces`` left the table while this placement awaited (a user
                deleted it, e.g. ``shardline bench`` clearing its nodes' kept table);
                publishing would add an instance nobody asked for beside theirs.
            ModelNotFoundError: no live node holds the model whole
                (:meth:`~shardline.node.logistics.Logistics.check_whole`).
        """
        await self.effects.check_whole(card.model_id)
        config, chosen, options = self._placement_inputs(card, node_ids, options)
        context, max_batch = options.sizes()
        ranks, kv_tokens = self._ranks(card, config, sharding, chosen, options, await self._draft_bytes(card, options))
        master_addr = self.view.address_of(chosen[0]).rsplit(":", 1)[0]
        port = await self._free_port(chosen[0])
        inst = Instance(
            instance_id=uuid.uuid4().hex[:8],
            model_id=card.model_id,
            sharding=Sharding(sharding),
            ranks=ranks,
            master_addr=master_addr,
            master_port=port,
            context=context,
            max_batch=max_batch,
            dtype=options.dtype,
            kv_tokens=kv_tokens,
            kv_cache_bytes=options.kv_cache_bytes,
            quantize=options.quantize.value if options.quantize else None,
            retries=retries,
            force=options.force,
            wanted_nodes=tuple(wanted_nodes) if wanted_nodes and set(chosen) != set(wanted_nodes) else (),
            replaced=replaced,
            collectives_on_cpu=ranks_share_a_gpu([self.view.profile_of(n) for n in chosen]),
            stands_in_for=stands_in_for,
            prefix_cache=options.prefix_cache,
            draft_model=options.draft_model,
            keep_until=self._kept_until(replaces or stands_in_for),
        )
        if replaces is not None and replaces not in self.view.instances:
            raise _Deleted(replaces)
        log.info("placed %s as instance %s (%s on %s)", card.model_id, inst.instance_id, sharding, ", ".join(chosen))
        await self.effects.commit(Placed(inst))
        return inst

    async def _draft_bytes(self, card: ModelCard, options: PlacementOptions) -> int:
        """Bytes the sampling rank of ``card``'s instance holds for ``options``' (resolved)
        draft model (:func:`~shardline.placement.ranks.draft_model_bytes`; 0 without one).

        Raises:
            DraftModelNotFoundError: no live node holds the draft model whole.
            DraftModelError: its tokenizer is not the model's
                (:func:`~shardline.models.tokenizer.draft_mismatch`), or cannot be read.
        """
        if options.draft_model is None:
            return 0
        try:
            draft = await self.effects.model_card(options.draft_model)
            await self.effects.check_whole(draft.model_id)
        except ModelNotFoundError as exc:
            raise DraftModelNotFoundError(f"draft_model: {exc}") from None
        try:
            target_tokens, draft_tokens = (
                await self.effects.tokenizer(card.model_id),
                await self.effects.tokenizer(draft.model_id),
            )
        except (ModelNotFoundError, TransferError, PeerError, OSError, ValueError) as exc:
            raise DraftModelError(f"draft_model {draft.model_id}: its tokenizer could not be compared: {exc}") from None
        mismatch = await asyncio.to_thread(draft_mismatch, target_tokens, draft_tokens)
        if mismatch is not None:
            raise DraftModelError(
                f"draft_model {draft.model_id} cannot draft for {card.model_id}: another tokenizer ({mismatch})"
            )
        pool = kv_pool_tokens(*options.sizes(), options.kv_tokens(ModelConfig.from_dict(card.config)))
        return draft_model_bytes(ModelConfig.from_dict(draft.config), draft.weight_file_bytes, options, pool)

    def _ranks(
        self,
        card: ModelCard,
        config: ModelConfig,
        sharding: Sharding,
        chosen: list[str],
        options: PlacementOptions,
        draft_bytes: int = 0,
    ) -> tuple[tuple[RankPlacement, ...], int]:
        """The ranks of ``card`` under ``sharding`` on ``chosen`` (in rank order) and
        ``options`` (resolved), each with its share and the bytes it will hold (the
        sampling rank ``draft_bytes`` more, its draft model's), and the KV pool's tokens
        (:func:`~shardline.placement.ranks.place_with_kv_pool`).

        Raises:
            PlacementError: it does not fit.
        """
        free = [NodeCapacity(n, self.effects.free_bytes(n)) for n in chosen]
        capacities, drafts = with_draft_model(sharding, free, draft_bytes)
        baseline = self.effects.runtime_baseline(chosen)
        try:
            shares, kv_tokens = place_with_kv_pool(
                config, sharding, capacities, options, card.weight_file_bytes, baseline
            )
        except PlacementError as exc:
            if not draft_bytes:
                raise
            raise type(exc)(f"{exc}{draft_hint(draft_bytes)}") from None
        estimated = ranks_bytes(config, sharding, shares, options, card.weight_file_bytes, baseline, kv_tokens)
        estimated = tuple(need + d for need, d in zip(estimated, drafts))
        ranks = tuple(
            RankPlacement(
                n, self.view.address_of(n), share, estimated_bytes=need, incarnation=self.view.incarnation_of(n)
            )
            for n, share, need in zip(chosen, shares, estimated)
        )
        return ranks, kv_tokens

    async def _free_port(self, node_id: str) -> int:
        if node_id == self.view.node_id:
            return free_port()
        return await self.effects.free_port(self.view.address_of(node_id))

    def _kept_until(self, instance_id: str | None) -> float | None:
        """The keep_alive deadline of the instance a new one takes the place of (None
        where there is none): a model placed again is unloaded when it would have been."""
        inst = self.view.instances.get(instance_id) if instance_id else None
        return inst.keep_until if inst else None

    async def keep_alive(self, instance_ids: list[str], seconds: float, now: float | None = None) -> bool:
        """Coordinator: keep the instances ``seconds`` idle from ``now`` (``time.time()``
        by default; ``math.inf``: for ever) before they are unloaded (Ollama's
        ``keep_alive``), in the table, so that every node serves and keeps the deadline.
        Ids the table does not hold are skipped. False (nothing changes) where this node
        does not coordinate."""
        if not self.view.is_coordinator():
            return False
        until = None if math.isinf(seconds) else (time.time() if now is None else now) + seconds
        events = [KeptAlive(i, until) for i in instance_ids if i in self.view.instances]
        if events:
            await self.effects.commit(*events)
        return True

    async def delete_instance(self, instance_id: str) -> str | None:
        """Coordinator: remove the instance ``instance_id`` names (itself, or the one
        placed again in its place: ``state.instance_named``), and one placed beside it to
        stand in for it (``state.standing_in``: a rejoin's, still loading or handing
        over, which would otherwise serve on); their runners are stopped everywhere. The
        id named, or None where the id names none."""
        inst = instance_named(self.view.instances, instance_id)
        if inst is None:
            return None
        beside = [new.instance_id for old, new in standing_in(self.view.instances).items() if old == inst.instance_id]
        await self.effects.commit(Deleted(inst.instance_id), *(Deleted(i) for i in beside))
        log.info(
            "deleted instance %s of %s%s",
            inst.instance_id,
            inst.model_id,
            f" and {', '.join(beside)} placed beside it" if beside else "",
        )
        return inst.instance_id
