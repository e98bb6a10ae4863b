"""What the cluster predicts and measured of its placements' speed, for the coordinator's
previews and ``GET /cluster/instances``: each node's profile and links as the speed model
sees them (:mod:`shardline.placement.speed`), the speeds the live nodes recorded while
serving (:mod:`shardline.placement.served`), and an instance's first-order prediction.
The role reads the node through :class:`ForecastView`; what it asks of others is given as
callbacks."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Protocol

from shardline.models.config import ModelConfig, Quantize
from shardline.models.store import ModelCard, ModelNotFoundError
from shardline.node.peer_client import PeerError
from shardline.node.table import Instance, Peer
from shardline.placement.layer_ranges import PlacementError
from shardline.placement.ranks import resident_bytes_per_weight
from shardline.placement.served import PlacementKey, ServedSpeed, merge

log = logging.getLogger(__name__)


class ForecastView(Protocol):
    """What the forecast reads of its node (read-only)."""

    @property
    def node_id(self) -> str: ...
    @property
    def links(self) -> Mapping[str, dict]: ...
    @property
    def peers(self) -> Mapping[str, Peer]: ...
    @property
    def instances(self) -> Mapping[str, Instance]: ...
    def profile_of(self, node_id: str) -> dict: ...
    def live_node_ids(self) -> list[str]: ...


class Forecast:
    """The speed figures of placements this node gives (as coordinator, or for its
    instance list). One per node; it keeps the model cards read.

    Args:
        view: the node, read.
        free_bytes: what a live node can give the next placement (``NodeMemory.free``).
        own_served: what the placements this node streamed did (``ServedLog.speeds``).
        model_card: a model's card (``ModelLogistics.model_card``).
        background: run a coroutine as a task of the node's.
    """

    def __init__(
        self,
        view: ForecastView,
        free_bytes: Callable[[str], int],
        own_served: Callable[[], Iterable[ServedSpeed]],
        model_card: Callable[[str], Awaitable[ModelCard]],
        background: Callable[[Coroutine[object, object, object]], None],
    ) -> None:
        self.view = view
        self.free_bytes = free_bytes
        self.own_served = own_served
        self.model_card = model_card
        self.background = background
        self._cards: dict[str, ModelCard] = {}  # model id -> card, for first_order
        self._reading: set[str] = set()  # model ids whose card is read in the background
        self._unpredicted: set[str] = set()  # instance ids whose preview could not be computed (logged)

    def node_profiles(self, node_ids: list[str]):
        """The preview's view of ``node_ids``: NodeProfile each, and the measured links.

        A node whose profile is not measured yet counts with 10 GB/s and 100 GFLOP/s (and
        no per-layer decode cost).
        """
        from shardline.placement.speed import Link, NodeProfile

        profiles, links = [], {}
        for node_id in node_ids:
            profile, available = self.view.profile_of(node_id), self.free_bytes(node_id)
            measured = self.view.links if node_id == self.view.node_id else self.view.peers[node_id].links
            profiles.append(
                NodeProfile(
                    node_id,
                    available,
                    profile.get("memory_bandwidth_bytes_per_s") or 10e9,
                    profile.get("matmul_flops") or 100e9,
                    profile.get("decode_layer_s") or 0.0,
                    profile.get("decode_weight_bytes_per_s") or 0.0,
                    profile.get("host_id") or "",
                    profile.get("cpu_count") or 0,
                    profile.get("threads") or 0,
                    profile.get("host_layer_s") or 0.0,
                )
            )
            for other, link in measured.items():
                links[(node_id, other)] = Link(link["latency_s"], link["bandwidth_bytes_per_s"])
        return profiles, links

    def served_speeds(self) -> dict[PlacementKey, ServedSpeed]:
        """What every placement the live nodes streamed requests of did, one record a
        placement (:func:`~shardline.placement.served.merge`)."""
        records = [*self.own_served()]
        live = set(self.view.live_node_ids())
        for peer in self.view.peers.values():
            if peer.node_id in live:
                for item in peer.served:
                    try:
                        records.append(ServedSpeed.from_dict(item))
                    except (KeyError, TypeError, ValueError):
                        continue  # a node of another version
        return merge(records)

    async def first_order(
        self, inst: Instance, context: int | None = None, wait: bool = True, *, prompt_tokens: int | None = None
    ) -> tuple[float, float]:
        """The preview's first-order (decode, prefill) tokens/s for an instance's
        placement, from its nodes' profiles now, decode for sequences growing to
        ``context`` tokens (None: the instance's context), prefill of a prompt of
        ``prompt_tokens`` (None: one chunk's, the preview's); (0, 0) when a node of it is
        not known or its model card cannot be read (cards are read once a model; the
        first read of a GGUF's takes seconds: without ``wait``, (0, 0) while it is read
        in the background)."""
        from shardline.placement.speed import PREFILL_CHUNK_TOKENS, predict_tokens_per_s

        try:
            card = self._cards.get(inst.model_id)
            if card is None and not wait:
                if inst.model_id not in self._reading:
                    self._reading.add(inst.model_id)
                    self.background(self.first_order(inst))
                return 0.0, 0.0
            if card is None:  # read once a model: the instance list calls this each time
                card = self._cards[inst.model_id] = await self.model_card(inst.model_id)
            config = ModelConfig.from_dict(card.config)
            profiles, links = self.node_profiles(inst.node_ids())
            weight = resident_bytes_per_weight(
                config, card.weight_file_bytes, inst.dtype, Quantize(inst.quantize) if inst.quantize else None
            )
            return predict_tokens_per_s(
                config,
                inst.sharding,
                profiles,
                [r.share for r in inst.ranks],
                links,
                context or inst.context,
                inst.dtype,
                decode_weight_bytes=weight,
                prompt_tokens=prompt_tokens or PREFILL_CHUNK_TOKENS,
            )
        except (KeyError, ModelNotFoundError, PeerError, PlacementError) as exc:
            # Once an instance: every listing asks again (a failed instance's dead node
            # stays unknown; a dashboard lists every second).
            if inst.instance_id not in self._unpredicted:
                self._unpredicted &= self.view.instances.keys()  # ids of deleted instances go
                self._unpredicted.add(inst.instance_id)
                reason = f"node {exc} is not known" if isinstance(exc, KeyError) else str(exc)
                log.info("no prediction for instance %s: %s", inst.instance_id, reason)
            return 0.0, 0.0
        finally:
            if wait:
                self._reading.discard(inst.model_id)
