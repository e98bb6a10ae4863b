"""The replicated instance table's values: an instance and its ranks' placements (frozen:
changed only by :func:`shardline.node.state.apply`), the peers a node knows, and the
errors a request meets when no instance serves it."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from enum import StrEnum

from shardline.models.config import Quantize, RankShare, Sharding
from shardline.node.epochs import NO_EPOCH, Epoch
from shardline.node.status import InstanceStatus, RankStatus
from shardline.placement.ranks import PlacementOptions


class NoInstanceError(LookupError):
    """No ready instance serves the requested model."""


DELETED = "the instance was deleted"
"""What a request on an instance deleted mid-request fails with."""


class EndCode(StrEnum):
    """Why a request's instance stopped serving it mid-request: the ``code`` of the error
    a client is given (OpenAI's error objects carry one)."""

    INSTANCE_FAILED = "instance_failed"
    """A rank's runner, node or link failed."""
    INSTANCE_DELETED = "instance_deleted"
    """Someone deleted the instance."""
    SERVER_STOPPING = "server_shutting_down"
    """The node streaming the request is stopping (Ctrl-C, SIGTERM)."""


class InstanceFailedError(RuntimeError):
    """The instance serving a request stopped serving it while it was in flight;
    ``code`` says why (:class:`EndCode`). ``final``: the node that ran the request gave
    this answer after its own wait for the model to be served again (a forwarded
    request's), so the node that forwarded it does not wait again."""

    def __init__(self, message: str, code: EndCode = EndCode.INSTANCE_FAILED, final: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.final = final


@dataclass(frozen=True)
class RankPlacement:
    """Where rank i of an instance runs, what it holds and its status."""

    node_id: str
    address: str
    share: RankShare  # its layers, and under tensor sharding its heads and columns
    status: RankStatus = RankStatus.LOADING
    error: str | None = None
    loaded: dict | None = None  # the runner's Loaded report: layers and bytes it read
    fetched: dict | None = None  # while its node copies the shard's files: done_bytes, total_bytes
    estimated_bytes: int = 0  # what placement counts this rank to hold (placement.ranks.rank_bytes)
    incarnation: float = 0.0  # its node's start time when placed (the rank dies with the node)


@dataclass(frozen=True)
class Instance:
    """A model placed on an ordered list of nodes (rank i on ``ranks[i]``)."""

    instance_id: str
    model_id: str
    sharding: Sharding
    ranks: tuple[RankPlacement, ...]
    master_addr: str
    master_port: int
    context: int
    max_batch: int
    dtype: str = "bfloat16"  # compute dtype of every rank
    kv_tokens: int = 0  # tokens its KV pool holds, all sequences together (0: max_batch x context)
    kv_cache_bytes: int | None = None  # the pool size asked for when placing (None: what fits)
    quantize: str | None = None  # "int8" | "int4": 16/32-bit weights quantized on load
    status: InstanceStatus = InstanceStatus.LOADING
    error: str | None = None
    created_at: float = field(default_factory=time.time)
    ready_at: float | None = None
    retries: int = 0  # placements of this model that failed before serving, in a row
    wanted_nodes: tuple[str, ...] = ()  # placed on before nodes were lost
    force: bool = False  # placed without memory admission (and placed again so)
    replaced: tuple[str, ...] = ()  # ids of the instances it was placed again for, oldest first
    collectives_on_cpu: bool = False  # its ranks share a GPU: gloo, not NCCL (rendezvous.ranks_share_a_gpu)
    stands_in_for: str | None = None  # placed beside this serving instance on its returning nodes
    given_up: bool = False  # failed, and the coordinator will not place it again (NotPlacedAgain)
    prefix_cache: bool = True  # its ranks keep finished prompts for later ones (runner.prefix_cache)
    keep_until: float | None = None  # Ollama keep_alive: deleted once idle past this time.time() (None: kept)
    draft_model: str | None = None  # the id of the model its sampling rank drafts with (runner.draft_model)

    def to_dict(self) -> dict:
        """A JSON view (the cluster API's, each rank's share flattened into it:
        ``layer_start``, ``layer_end``, ``tensor_share``); the wire form is
        ``wire.StateMessage``'s."""
        view = dataclasses.asdict(self)
        view["ranks"] = [{**{k: v for k, v in rank.items() if k != "share"}, **rank["share"]} for rank in view["ranks"]]
        return view

    def placement_options(self) -> PlacementOptions:
        """What it was placed with, to place it again so (its sharding alone)."""
        return PlacementOptions(
            self.context,
            self.max_batch,
            self.dtype,
            (self.sharding,),
            kv_cache_bytes=self.kv_cache_bytes,
            quantize=Quantize(self.quantize) if self.quantize else None,
            force=self.force,
            prefix_cache=self.prefix_cache,
            draft_model=self.draft_model,
        )

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
    epoch: Epoch = NO_EPOCH  # of the table it holds
    busy: tuple[str, ...] = ()  # instances with requests running or waiting on its ranks
    served: list[dict] = field(default_factory=list)  # its ServedSpeed records (placement.served)
