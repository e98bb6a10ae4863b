"""The supervision role (:mod:`shardline.node.supervision`) built alone: a plain view of
the node, a stub runner pool and recording callbacks, no cluster and no node. Reconciling
with a table, a runner's spec, where a rank's report goes, and what a runner's messages
become."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardline.models.config import RankShare, Sharding
from shardline.node.peer_client import PeerError
from shardline.node.repeated_warnings import RepeatedWarnings
from shardline.node.state import ClusterState, RankReported
from shardline.node.status import InstanceStatus, RankStatus
from shardline.node.supervision import RunnerSettings, SupervisionEffects, Supervisor
from shardline.node.table import EndCode, Instance, RankPlacement
from shardline.node.transfer import TransferError
from shardline.node.wire import RankReport
from shardline.placement.ranks import ring_prefill_chunk
from shardline.runner.protocol import EngineStats, Failed, Loaded, RunnerSpec, TokenEvent, Tokens

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]


@dataclass
class View:
    """What supervision reads: plain values."""

    node_id: str = "b"
    host: str = "10.0.0.2"
    instances: dict[str, Instance] = field(default_factory=dict)
    coordinator: str = "a"
    acting: bool = False
    stopping: bool = False
    loop: asyncio.AbstractEventLoop | None = None

    @property
    def cluster_state(self) -> ClusterState:
        return ClusterState(instances=self.instances)

    def coordinator_id(self) -> str:
        return self.coordinator

    def is_coordinator(self) -> bool:
        return self.acting

    def is_stopping(self) -> bool:
        return self.stopping

    def address_of(self, node_id: str) -> str:
        return f"{node_id}:7000"


class Pool:
    """Runners by instance id; started and stopped ones recorded."""

    def __init__(self, runners: dict[str, object] | None = None) -> None:
        self.runners = runners or {}
        self.started: list[RunnerSpec] = []
        self.stopped: list[str] = []

    def start(self, spec: RunnerSpec) -> None:
        self.started.append(spec)
        self.runners[spec.instance_id] = handle()

    def stop(self, instance_id: str) -> None:
        self.stopped.append(instance_id)
        self.runners.pop(instance_id, None)


def handle(
    status: RankStatus = RankStatus.LOADING,
    error: str | None = None,
    loaded: Loaded | None = None,
    peer_lost: bool = False,
) -> SimpleNamespace:
    return SimpleNamespace(status=status, error=error, loaded=loaded, peer_lost=peer_lost)


class Recorder:
    def __init__(self, weights: object = Path("/store/m")) -> None:
        self.weights = weights  # a path, or an exception to raise
        self.calls: list[tuple] = []
        self.sent_to: list[tuple[str, RankReport]] = []
        self.send_error: Exception | None = None

    def effects(self) -> SupervisionEffects:
        async def shard_weights(inst: Instance, rank: int, placement: RankPlacement) -> Path:
            self.calls.append(("shard_weights", inst.instance_id, rank))
            if isinstance(self.weights, Exception):
                raise self.weights
            assert isinstance(self.weights, Path)
            return self.weights

        async def draft_weights(inst: Instance) -> Path:
            self.calls.append(("draft_weights", inst.instance_id))
            return Path("draft")

        async def send_report(address: str, report: RankReport) -> bool:
            if self.send_error is not None:
                raise self.send_error
            self.sent_to.append((address, report))
            return True

        async def runner_status(event: RankReported) -> bool:
            self.calls.append(("runner_status", event.instance_id, event.status))
            return True

        return SupervisionEffects(
            shard_weights=shard_weights,
            draft_weights=draft_weights,
            warm_tokenizer=lambda model_id: self.calls.append(("warm_tokenizer", model_id)),
            dispatch=lambda events: self.calls.append(("dispatch", events)),
            fail_streams=lambda instance_id, error, code: self.calls.append(("fail_streams", instance_id, error, code)),
            end_forwarded=lambda: self.calls.append(("end_forwarded",)),
            engine_stats=lambda instance_id, stats: self.calls.append(("engine_stats", instance_id, stats)),
            send_report=send_report,
            runner_status=runner_status,
            repeated=RepeatedWarnings(logging.getLogger("test_supervision")),
        )

    def named(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


def instance(
    instance_id: str,
    nodes: tuple[str, ...] = ("a", "b"),
    status: InstanceStatus = InstanceStatus.LOADING,
    sharding: Sharding = Sharding.PIPELINE,
    error: str | None = None,
    rank_status: RankStatus = RankStatus.LOADING,
    replaced: tuple[str, ...] = (),
) -> Instance:
    ranks = tuple(RankPlacement(n, f"{n}:1", RankShare(i, i + 1), status=rank_status) for i, n in enumerate(nodes))
    return Instance(
        instance_id, "m", sharding, ranks, "10.0.0.1", 29500, 64, 2, status=status, error=error, replaced=replaced
    )


def build(
    view: View, pool: Pool | None = None, recorder: Recorder | None = None, settings: RunnerSettings = RunnerSettings()
) -> tuple[Supervisor, Pool, Recorder]:
    pool = pool or Pool()
    recorder = recorder or Recorder()
    return Supervisor(view, pool, recorder.effects(), settings), pool, recorder


# -- reconciling -------------------------------------------------------------------------


def test_a_rank_placed_here_gets_its_files_then_its_runner_and_rank_0s_node_warms_the_tokenizer():
    view = View(node_id="a", instances={"x": instance("x", ("a", "b"))})
    supervisor, pool, recorder = build(view)

    async def run() -> None:
        await supervisor.reconcile()
        assert set(supervisor.preparing) == {"x"}
        await supervisor.preparing["x"]

    asyncio.run(run())
    assert [s.instance_id for s in pool.started] == ["x"] and pool.started[0].rank == 0
    assert recorder.named("shard_weights") == [("shard_weights", "x", 0)]
    assert recorder.named("warm_tokenizer") == [("warm_tokenizer", "m")]
    assert supervisor.preparing == {}


def test_another_ranks_node_does_not_warm_the_tokenizer_at_once():
    view = View(node_id="b", instances={"x": instance("x", ("a", "b"))})
    supervisor, pool, recorder = build(view)

    async def run() -> None:
        await supervisor.reconcile()
        await supervisor.preparing["x"]

    asyncio.run(run())
    assert pool.started[0].rank == 1 and not recorder.named("warm_tokenizer")


@pytest.mark.parametrize(
    "node, sharding, rank, draft",
    [
        ("a", Sharding.PIPELINE, 0, None),
        ("b", Sharding.PIPELINE, 1, "draft"),  # a pipeline's last rank samples
        ("a", Sharding.TENSOR, 0, "draft"),  # a tensor instance's first
        ("b", Sharding.TENSOR, 1, None),
    ],
)
def test_the_sampling_rank_of_an_instance_with_a_draft_model_gets_it_whole(node, sharding, rank, draft):
    inst = dataclasses.replace(instance("x", ("a", "b"), sharding=sharding), draft_model="small")
    view = View(node_id=node, instances={"x": inst})
    supervisor, pool, recorder = build(view)

    async def run() -> None:
        await supervisor.reconcile()
        await supervisor.preparing["x"]

    asyncio.run(run())
    spec = pool.started[0]
    assert spec.rank == rank and spec.model_drafts and spec.draft_model_path == draft
    assert recorder.named("draft_weights") == ([("draft_weights", "x")] if draft else [])


@pytest.mark.parametrize(
    "instances, ended, code, error",
    [
        ({}, "x", EndCode.INSTANCE_DELETED, "the instance was deleted"),  # gone
        (
            {"x": instance("x", status=InstanceStatus.FAILED, error="rank 0 died")},
            "x",
            EndCode.INSTANCE_FAILED,
            "rank 0 died",
        ),
        (
            {"y": instance("y", replaced=("x",))},
            "x",
            EndCode.INSTANCE_FAILED,
            "gone; instance y was placed in its place",
        ),
    ],
)
def test_a_runner_no_longer_placed_is_stopped_and_its_requests_told_why(instances, ended, code, error):
    view = View(node_id="z", instances=instances)  # no rank here: nothing to start
    supervisor, pool, recorder = build(view, Pool({ended: handle(RankStatus.READY)}))
    asyncio.run(supervisor.reconcile())
    assert pool.stopped == [ended]
    fail = recorder.named("fail_streams")
    assert len(fail) == 1 and fail[0][1] == ended and fail[0][3] == code
    assert error.split(";")[0] in fail[0][2]
    assert ("engine_stats", ended, None) in recorder.calls
    assert recorder.calls[0] == ("end_forwarded",)


def test_a_rank_being_prepared_for_an_instance_gone_is_cancelled():
    view = View(node_id="a", instances={"x": instance("x", ("a",))})
    supervisor, pool, recorder = build(view)

    async def run() -> bool:
        never = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(never)
        supervisor.preparing["x"] = task
        view.instances = {}
        await supervisor.reconcile()
        await asyncio.sleep(0)
        return task.cancelled()

    assert asyncio.run(run()) is True
    assert supervisor.preparing == {} and pool.started == []


@pytest.mark.parametrize("error", [TransferError("copy broke"), PeerError("peer gone"), RuntimeError("a bug")])
def test_a_rank_whose_files_cannot_be_had_is_reported_failed(error):
    view = View(node_id="b", instances={"x": instance("x", ("a", "b"))})
    recorder = Recorder(weights=error)
    supervisor, pool, _ = build(view, recorder=recorder)

    async def run() -> None:
        await supervisor.reconcile()
        await supervisor.preparing["x"]

    asyncio.run(run())
    assert pool.started == [] and supervisor.preparing == {}
    ((address, report),) = recorder.sent_to
    assert address == "a:7000" and report.status == RankStatus.FAILED
    assert report.error == f"could not get the files of m: {error}"


def test_a_rank_whose_instance_failed_while_its_files_came_does_not_start():
    view = View(node_id="b", instances={"x": instance("x", ("a", "b"))})
    supervisor, pool, _ = build(view)

    async def run() -> None:
        await supervisor.reconcile()
        view.instances = {"x": instance("x", ("a", "b"), status=InstanceStatus.FAILED)}
        await supervisor.preparing["x"]

    asyncio.run(run())
    assert pool.started == []


# -- a runner's spec ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "sharding, ranks, chunk",
    [
        (Sharding.PIPELINE, 2, RunnerSpec.prefill_chunk),
        (Sharding.TENSOR, 2, RunnerSpec.prefill_chunk),
        (Sharding.RING, 3, ring_prefill_chunk(3)),
        (Sharding.RING, 2, ring_prefill_chunk(2)),
    ],
)
def test_a_runners_spec(sharding, ranks, chunk):
    nodes = ("a", "b", "c")[:ranks]
    inst = instance("x", nodes, sharding=sharding)
    supervisor, _, _ = build(
        View(node_id="b"), settings=RunnerSettings(threads=3, device="cpu", progress_timeout_s=7.0)
    )
    spec = supervisor.runner_spec(inst, 1, inst.ranks[1], Path("/store/m"))
    assert (spec.instance_id, spec.node_id, spec.rank, spec.world_size) == ("x", "b", 1, ranks)
    assert (spec.model_path, spec.host, spec.master_addr, spec.master_port) == (
        "/store/m",
        "10.0.0.2",
        "10.0.0.1",
        29500,
    )
    assert (spec.threads, spec.device, spec.progress_timeout_s) == (3, "cpu", 7.0)
    assert spec.prefill_chunk == chunk
    if sharding == Sharding.RING:
        assert spec.prefill_step_tokens == chunk
        assert spec.prefill_burst_tokens == max(chunk, RunnerSpec.prefill_burst_tokens)


# -- reports -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "coordinator, acting, stopping, sent, acted",
    [
        ("a", False, False, True, False),  # another node coordinates: sent to it
        ("b", True, False, False, True),  # this node coordinates: acted on here
        ("b", False, False, False, False),  # this node would, but has no term yet: made again later
        ("a", False, True, False, False),  # stopping: nothing to report
    ],
)
def test_where_a_report_goes(coordinator, acting, stopping, sent, acted):
    view = View(node_id="b", coordinator=coordinator, acting=acting, stopping=stopping)
    supervisor, _, recorder = build(view)
    asyncio.run(supervisor.report_runner("x", RankStatus.READY, None, {"bytes_read": 1}))
    assert bool(recorder.sent_to) is sent and bool(recorder.named("runner_status")) is acted
    if sent:
        address, report = recorder.sent_to[0]
        assert address == "a:7000"
        assert (report.instance_id, report.node_id, report.status, report.loaded) == (
            "x",
            "b",
            RankStatus.READY,
            {"bytes_read": 1},
        )


def test_a_report_that_fails_is_warned_of_once_until_one_goes_through(caplog):
    view = View(node_id="b")
    recorder = Recorder()
    supervisor, _, _ = build(view, recorder=recorder)
    recorder.send_error = PeerError("a is down")
    for _ in range(3):
        asyncio.run(supervisor.report_runner("x", RankStatus.READY, None, None))
    recorder.send_error = None
    asyncio.run(supervisor.report_runner("x", RankStatus.READY, None, None))
    recorder.send_error = PeerError("a is down")
    asyncio.run(supervisor.report_runner("x", RankStatus.READY, None, None))
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "report of x" in r.message]
    assert len(warned) == 2


def test_copy_progress_is_reported_as_fetching():
    supervisor, _, recorder = build(View(node_id="b"))
    asyncio.run(supervisor.report_fetching("x", 5, 10))
    ((_, report),) = recorder.sent_to
    assert report.status == RankStatus.FETCHING and report.fetched == {"done_bytes": 5, "total_bytes": 10}


@pytest.mark.parametrize(
    "table_rank, runner, reported",
    [
        (RankStatus.LOADING, RankStatus.READY, True),  # the table missed its report
        (RankStatus.READY, RankStatus.READY, False),
        (RankStatus.LOADING, RankStatus.LOADING, False),  # still loading: nothing to tell
        (RankStatus.READY, RankStatus.FAILED, True),
    ],
)
def test_ranks_the_table_has_wrong_are_reported_again(table_rank, runner, reported):
    view = View(node_id="b", instances={"x": instance("x", ("a", "b"), rank_status=table_rank)})
    loaded = Loaded((0,), 1, 2, 3, 4)
    supervisor, _, recorder = build(
        view,
        Pool(
            {
                "x": handle(
                    runner,
                    "boom" if runner == RankStatus.FAILED else None,
                    loaded if runner == RankStatus.READY else None,
                )
            }
        ),
    )
    asyncio.run(supervisor.report_stale())
    assert bool(recorder.sent_to) is reported
    if reported:
        report = recorder.sent_to[0][1]
        assert report.status == runner
        assert report.loaded == (dataclasses.asdict(loaded) if runner == RankStatus.READY else None)


# -- a runner's messages -----------------------------------------------------------------


def on_loop(view: View, supervisor: Supervisor, message: object, settle_s: float = 0.05) -> None:
    async def run() -> None:
        view.loop = asyncio.get_running_loop()
        supervisor.on_runner_message("x", message)
        await asyncio.sleep(settle_s)

    asyncio.run(run())


def test_a_message_before_the_node_started_is_dropped():
    view = View(node_id="b")
    supervisor, _, recorder = build(view)
    supervisor.on_runner_message("x", Tokens(()))
    assert recorder.calls == []


def test_tokens_go_to_the_requests_and_stats_are_kept():
    view = View(node_id="b")
    supervisor, _, recorder = build(view)
    events = (TokenEvent(task_id=1, token_id=5),)
    on_loop(view, supervisor, Tokens(events))
    assert recorder.calls == [("dispatch", events)]
    stats = EngineStats(running=(1,), waiting=(), held=(), free_slots=1, steps=3)
    on_loop(view, supervisor, stats)
    assert recorder.calls[-1] == ("engine_stats", "x", dataclasses.asdict(stats))


def test_a_loaded_runner_is_reported_ready():
    view = View(node_id="b")
    supervisor, _, recorder = build(view)
    on_loop(view, supervisor, Loaded((0,), 1, 2, 3, 4))
    ((_, report),) = recorder.sent_to
    assert report.status == RankStatus.READY and report.loaded["bytes_read"] == 2


def test_a_failed_runner_fails_its_requests_at_once_and_is_reported():
    view = View(node_id="b", instances={"x": instance("x")})
    supervisor, _, recorder = build(view)
    on_loop(view, supervisor, Failed("out of memory"))
    assert recorder.named("fail_streams") == [("fail_streams", "x", "out of memory", EndCode.INSTANCE_FAILED)]
    ((_, report),) = recorder.sent_to
    assert report.status == RankStatus.FAILED and report.error == "out of memory" and not report.peer_lost


@pytest.mark.parametrize(
    "named_error, expected",
    [
        ("rank 0 on a: killed", "rank 0 on a: killed"),  # the coordinator names the rank that failed
        (None, "lost contact"),  # nobody does within the grace: its own words
    ],
)
def test_a_rank_that_lost_a_peer_waits_for_the_coordinator_to_name_the_failure(named_error, expected, monkeypatch):
    monkeypatch.setattr("shardline.node.supervision.NAMING_GRACE_S", 0.3)
    view = View(node_id="b", instances={"x": instance("x")})
    supervisor, _, recorder = build(view)

    async def run() -> None:
        view.loop = asyncio.get_running_loop()
        supervisor.on_runner_message("x", Failed("lost contact", peer_lost=True))
        await asyncio.sleep(0.05)
        assert not recorder.named("fail_streams")
        if named_error is not None:
            view.instances = {"x": instance("x", status=InstanceStatus.FAILED, error=named_error)}
        await asyncio.sleep(0.4)

    asyncio.run(run())
    ((_, instance_id, error, code),) = recorder.named("fail_streams")
    assert (instance_id, error, code) == ("x", expected, EndCode.INSTANCE_FAILED)
    assert recorder.sent_to[0][1].peer_lost
