"""The memory role (:mod:`shardline.node.node_memory`) and the forecast
(:mod:`shardline.node.forecast`) built alone from a plain view of the node and plain
callables, no cluster and no node."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from shardline.models.config import RankShare, Sharding
from shardline.models.store import ModelNotFoundError
from shardline.node.forecast import Forecast
from shardline.node.node_memory import NodeMemory
from shardline.node.status import InstanceStatus
from shardline.node.table import Instance, Peer, RankPlacement
from shardline.placement.memory import GPU_MEMORY_FRACTION

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]

GB = 1 << 30


@dataclass
class View:
    node_id: str = "a"
    memory_limit_bytes: int | None = None
    profile: dict | None = None
    peers: dict[str, Peer] = field(default_factory=dict)
    instances: dict[str, Instance] = field(default_factory=dict)
    links: dict[str, dict] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)

    def profile_of(self, node_id: str) -> dict:
        return (self.profile if node_id == self.node_id else self.peers[node_id].profile) or {}

    def live_node_ids(self) -> list[str]:
        return sorted([*self.live, self.node_id])


def instance(
    instance_id: str, ranks: tuple[tuple[str, int], ...], status: InstanceStatus = InstanceStatus.READY
) -> Instance:
    placed = tuple(RankPlacement(n, f"{n}:1", RankShare(i, i + 1), estimated_bytes=b) for i, (n, b) in enumerate(ranks))
    return Instance(instance_id, "org/m", Sharding.PIPELINE, placed, "a", 1, 64, 1, status=status)


@pytest.mark.parametrize(
    "limit, profile, offered",
    [
        (5 * GB, {"accelerator": "cuda:0 H100", "accelerator_total_bytes": 80 * GB}, 5 * GB),  # the limit first
        (
            None,
            {"accelerator": "cuda:0 H100", "accelerator_total_bytes": 80 * GB},
            int(GPU_MEMORY_FRACTION * 80 * GB),
        ),  # then the GPU's
        (None, {"accelerator": "cpu"}, 12 * GB + GB),  # else what is available and its runners hold
        (None, None, 12 * GB + GB),
    ],
)
def test_what_a_node_offers(limit, profile, offered):
    memory = NodeMemory(View(memory_limit_bytes=limit, profile=profile), lambda: GB, lambda: 12 * GB)
    assert memory.offered() == offered


@pytest.mark.parametrize(
    "node_id, instances, committed, free",
    [
        ("a", {}, 0, 10 * GB),
        ("a", {"x": instance("x", (("a", 3 * GB), ("b", 4 * GB)))}, 3 * GB, 7 * GB),
        ("b", {"x": instance("x", (("a", 3 * GB), ("b", 4 * GB)))}, 4 * GB, 2 * GB),  # b offers 6 GB
        ("a", {"x": instance("x", (("a", 3 * GB),), InstanceStatus.FAILED)}, 0, 10 * GB),  # failed: not counted
        ("b", {"x": instance("x", (("b", 9 * GB),))}, 9 * GB, 0),  # never below 0
    ],
)
def test_what_a_node_has_free(node_id, instances, committed, free):
    view = View(
        memory_limit_bytes=10 * GB, instances=instances, peers={"b": Peer("b", "b:1", 0.0, offered_bytes=6 * GB)}
    )
    memory = NodeMemory(view, lambda: 0)
    assert memory.of(node_id) == {
        "offered_bytes": memory.offered() if node_id == "a" else 6 * GB,
        "committed_bytes": committed,
        "free_bytes": free,
    }
    assert memory.free(node_id) == free


def forecast(view: View, card=None) -> Forecast:
    async def model_card(model_id: str):
        if card is None:
            raise ModelNotFoundError(model_id)
        return card

    return Forecast(view, lambda node_id: 2 * GB, lambda: [], model_card, lambda coroutine: coroutine.close())


def test_the_profiles_a_preview_sees():
    view = View(
        profile={"matmul_flops": 5e12},
        links={"b": {"latency_s": 0.001, "bandwidth_bytes_per_s": 1e9}},
        peers={
            "b": Peer("b", "b:1", 0.0, profile=None, links={"a": {"latency_s": 0.002, "bandwidth_bytes_per_s": 2e9}})
        },
    )
    profiles, links = forecast(view).node_profiles(["a", "b"])
    assert [(p.node_id, p.available_bytes) for p in profiles] == [("a", 2 * GB), ("b", 2 * GB)]
    assert profiles[0].matmul_flops == 5e12 and profiles[1].matmul_flops == 100e9  # b: not measured yet
    assert links[("a", "b")].latency_s == 0.001 and links[("b", "a")].bandwidth_bytes_per_s == 2e9


def test_an_instance_whose_card_cannot_be_read_has_no_prediction():
    view = View(instances={"x": instance("x", (("a", GB),))})
    assert asyncio.run(forecast(view).first_order(view.instances["x"])) == (0.0, 0.0)


# -- the host profiler (shardline.node.speeds) -------------------------------------------


@dataclass
class ProfilerView:
    node_id: str = "a"
    profile: dict | None = None
    instances: dict[str, Instance] = field(default_factory=dict)
    streams: dict[int, object] = field(default_factory=dict)
    busy: list[str] = field(default_factory=list)

    def busy_instances(self) -> list[str]:
        return self.busy


@pytest.mark.parametrize(
    "streams, busy, idle",
    [
        ({}, [], True),
        ({1: object()}, [], False),  # a request in flight
        ({}, ["x"], False),  # a rank here with requests
    ],
)
def test_the_profiler_measures_only_an_idle_node(streams, busy, idle):
    from shardline.node.speeds import HostProfiler

    profiler = HostProfiler(ProfilerView(streams=streams, busy=busy), lambda profile: None, None)
    assert profiler.idle(any_load=True) is idle


@pytest.mark.parametrize("had", [None, {"decode_weight_bytes_per_s": 2.1e10}])
def test_a_profile_measured_beside_other_work_is_not_kept(tmp_path, monkeypatch, had):
    """Other programs kept most of the CPUs busy while it measured: nothing kept, the next
    measurement RETRY_S later and only while other programs rest; with no profile held,
    the try is cached, which the machine's other nodes take as no first guess but as a
    reason to measure only while other programs rest too."""
    import shardline.node.profile as profile_module
    from shardline.node.profile import HostProfile
    from shardline.node.speeds import INTERVAL_S, RETRY_S, HostProfiler

    async def measured(**_):
        return HostProfile(
            cpu_count=2, decode_weight_bytes_per_s=2.2e8, other_cores=1.9, threads=2, measured_at=time.time()
        )

    monkeypatch.setattr(profile_module, "measure_host_async", measured)
    kept: list[dict | None] = []
    cache = tmp_path / "profile.json"
    profiler = HostProfiler(ProfilerView(profile=had), kept.append, cache, threads=2)
    assert asyncio.run(profiler._measure(None)) is True  # quiet only, next
    assert kept == []
    assert profiler.measured_at is not None
    assert profiler.measured_at + INTERVAL_S - RETRY_S == pytest.approx(time.monotonic(), abs=1.0)
    assert cache.exists() is (had is None)
    other = HostProfiler(ProfilerView(node_id="b"), kept.append, cache, threads=2)
    assert other.first_guess() is None and other._tried_beside_load() is (had is None)


def test_a_cached_profile_of_other_runner_threads_is_no_first_guess(tmp_path):
    from shardline.node.profile import HostProfile
    from shardline.node.speeds import HostProfiler

    cache = tmp_path / "profile.json"
    cache.write_text(__import__("json").dumps(HostProfile(threads=2).to_dict()))
    assert HostProfiler(ProfilerView(), lambda profile: None, cache, threads=3).first_guess() is None
    guess = HostProfiler(ProfilerView(), lambda profile: None, cache, threads=2).first_guess()
    assert guess is not None and guess["threads"] == 2
