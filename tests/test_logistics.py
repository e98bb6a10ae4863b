"""The model logistics role (:mod:`shardline.node.logistics`) built alone: a plain view of
the node, an empty store in a temporary directory, stub peers and recording callbacks, no
cluster and no node. Which models the cluster holds, where a manifest comes from, what a
request may name, and warming tokenizers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from shardline.models.store import (
    DEFAULT_MODEL_ID,
    Manifest,
    ModelFile,
    ModelNotFoundError,
    ModelStore,
    ModelStoreError,
)
from shardline.node.logistics import LogisticsEffects, ModelLogistics
from shardline.node.peer_client import PeerError
from shardline.node.table import Instance, Peer

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]


@dataclass
class View:
    node_id: str = "a"
    peers: dict[str, Peer] = field(default_factory=dict)
    instances: dict[str, Instance] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)

    def live_node_ids(self) -> list[str]:
        return sorted([*self.live, self.node_id])


class Peers:
    """Manifests by (address, model id); a PeerError for an address in ``broken``."""

    def __init__(self, manifests: dict[tuple[str, str], Manifest] | None = None, broken: tuple[str, ...] = ()) -> None:
        self.manifests, self.broken = manifests or {}, broken
        self.asked: list[str] = []

    async def manifest(self, address: str, model_id: str) -> Manifest | None:
        self.asked.append(address)
        if address in self.broken:
            raise PeerError(f"{address} is down")
        return self.manifests.get((address, model_id))

    async def copy_files(self, *args, **kwargs) -> int:
        raise AssertionError("no copy expected")


class Recorder:
    def __init__(self) -> None:
        self.polled: list[str] = []
        self.background: list[object] = []

    def effects(self) -> LogisticsEffects:
        async def poll(address: str) -> bool:
            self.polled.append(address)
            return True

        async def report_fetching(instance_id: str, done: int, total: int) -> None:
            pass

        return LogisticsEffects(poll=poll, background=self.run_later, report_fetching=report_fetching)

    def run_later(self, coroutine) -> None:
        self.background.append(coroutine)
        coroutine.close()


def manifest(model_id: str = "org/m") -> Manifest:
    return Manifest(model_id, "safetensors", (ModelFile("model.safetensors", 10, "0" * 64, True),), {"num_layers": 2})


def summary(complete: bool, added_at: float = 5.0) -> dict:
    return {
        "format": "safetensors",
        "total_bytes": 10,
        "present": [],
        "ranges": {},
        "complete": complete,
        "added_at": added_at,
    }


def peer(node_id: str, models: dict[str, dict] | None = None) -> Peer:
    return Peer(node_id, f"{node_id}:1", 0.0, models=models or {})


def build(tmp_path, view: View, peers: Peers | None = None, model_dirs=None) -> tuple[ModelLogistics, Recorder, Peers]:
    store = ModelStore(tmp_path / "models")
    peers = peers or Peers()
    recorder = Recorder()
    dirs = [store.root, *(model_dirs or [])]
    return ModelLogistics(view, store, dirs, peers, recorder.effects()), recorder, peers


@pytest.mark.parametrize(
    "model_id, peers, live, held",
    [
        (DEFAULT_MODEL_ID, {}, set(), True),  # the embedded default: always
        ("org/m", {}, set(), False),
        ("org/m", {"b": {"org/m": summary(True)}}, {"b"}, True),  # a live peer's store
        ("org/m", {"b": {"org/m": summary(False)}}, {"b"}, True),  # in part counts as held
        ("org/m", {"b": {"org/m": summary(True)}}, set(), False),  # a peer not live
    ],
)
def test_held(tmp_path, model_id, peers, live, held):
    view = View(peers={n: peer(n, m) for n, m in peers.items()}, live=live)
    logistics, _, _ = build(tmp_path, view)
    assert logistics.held(model_id) is held


@pytest.mark.parametrize(
    "peers, live, whole",
    [
        ({"b": {"org/m": summary(True)}}, {"b"}, True),
        ({"b": {"org/m": summary(False)}, "c": {"org/m": summary(True)}}, {"b", "c"}, True),
        ({"b": {"org/m": summary(False)}}, {"b"}, "part of it is on b"),
        ({"b": {"org/m": summary(True)}}, set(), "no live node holds all"),  # b is down
        ({}, set(), "no live node holds all"),
    ],
)
def test_check_whole(tmp_path, peers, live, whole):
    view = View(peers={n: peer(n, m) for n, m in peers.items()}, live=live)
    logistics, recorder, _ = build(tmp_path, view)
    if whole is True:
        asyncio.run(logistics.check_whole("org/m"))
    else:
        with pytest.raises(ModelNotFoundError, match=whole):
            asyncio.run(logistics.check_whole("org/m"))
    assert sorted(recorder.polled) == sorted(f"{n}:1" for n in peers if n in live)  # asked afresh


def test_the_default_model_is_whole_without_asking(tmp_path):
    logistics, recorder, _ = build(tmp_path, View())
    asyncio.run(logistics.check_whole(DEFAULT_MODEL_ID))
    assert recorder.polled == []


def test_a_manifest_comes_from_a_live_peer_that_holds_the_model(tmp_path):
    view = View(
        peers={"b": peer("b", {"org/m": summary(True)}), "c": peer("c", {"org/m": summary(True)}), "d": peer("d")},
        live={"b", "c", "d"},
    )
    peers = Peers({("c:1", "org/m"): manifest()}, broken=("b:1",))
    logistics, _, _ = build(tmp_path, view, peers)
    assert asyncio.run(logistics.manifest("org/m")) == manifest()
    assert "d:1" not in peers.asked and "c:1" in peers.asked


def test_a_model_no_node_holds_has_no_manifest_after_asking_the_peers_again(tmp_path):
    view = View(peers={"b": peer("b")}, live={"b"})
    logistics, recorder, _ = build(tmp_path, view)
    with pytest.raises(ModelNotFoundError, match="shardline models add"):
        asyncio.run(logistics.manifest("org/m"))
    assert recorder.polled == ["b:1"]  # a model added a moment ago is in no summary yet


def test_cluster_models_lists_the_default_and_each_model_by_where_it_is(tmp_path):
    view = View(
        peers={
            "b": peer("b", {"org/m": summary(True, added_at=7.0)}),
            "c": peer("c", {"org/m": summary(False), "org/n": summary(True, added_at=3.0)}),
            "d": peer("d", {"org/gone": summary(True)}),
        },
        live={"b", "c"},
    )
    logistics, _, _ = build(tmp_path, view)
    models = {m["model_id"]: m for m in asyncio.run(logistics.cluster_models())}
    assert sorted(models) == sorted([DEFAULT_MODEL_ID, "org/m", "org/n"])  # d is down
    assert models[DEFAULT_MODEL_ID]["embedded"] and models[DEFAULT_MODEL_ID]["complete_on"] == ["a", "b", "c"]
    assert (models["org/m"]["complete_on"], models["org/m"]["partial_on"], models["org/m"]["added_at"]) == (
        ["b"],
        ["c"],
        7.0,
    )
    assert models["org/n"]["instances"] == []


@pytest.mark.parametrize("name", ["/etc/passwd", "./model.gguf", "../elsewhere/model"])
def test_a_path_outside_the_model_directories_is_refused(tmp_path, name):
    logistics, _, _ = build(tmp_path, View())
    with pytest.raises(ModelStoreError, match="nor a path under a --model-dir"):
        asyncio.run(logistics.adopt(name))


@pytest.mark.parametrize(
    "name, adopted",
    [
        (None, DEFAULT_MODEL_ID),
        (DEFAULT_MODEL_ID, DEFAULT_MODEL_ID),
        ("org/m", "org/m"),  # held by a live peer: as named
    ],
)
def test_what_a_request_names(tmp_path, name, adopted):
    view = View(peers={"b": peer("b", {"org/m": summary(True)})}, live={"b"})
    logistics, _, _ = build(tmp_path, view)
    assert asyncio.run(logistics.adopt(name)) == adopted


def test_a_tokenizer_is_warmed_once_and_not_when_loaded(tmp_path):
    logistics, recorder, _ = build(tmp_path, View())
    logistics.warm_tokenizer("org/m")
    logistics.warm_tokenizer("org/m")  # loading already
    assert len(recorder.background) == 1
    logistics.tokenizers["org/n"] = object()  # type: ignore[assignment]
    logistics.warm_tokenizer("org/n")
    assert len(recorder.background) == 1


def test_one_models_tokenizer_load_does_not_hold_up_anothers(tmp_path):
    """A model's tokenizer files come slowly from a peer; a request for another model's
    tokenizer meanwhile is answered at once (here: no node has it), not after the first."""
    slow = asyncio.Event()

    class SlowPeers(Peers):
        async def manifest(self, address: str, model_id: str) -> Manifest | None:
            if model_id == "org/m":
                await slow.wait()
            return None

    view = View(peers={"b": peer("b", {"org/m": summary(True), "org/n": summary(True)})}, live={"b"})
    logistics, _, _ = build(tmp_path, view, SlowPeers())

    async def run() -> None:
        loading = asyncio.create_task(logistics.tokenizer("org/m"))
        await asyncio.sleep(0)
        with pytest.raises(ModelNotFoundError):
            await asyncio.wait_for(logistics.tokenizer("org/n"), 5)
        assert not loading.done()
        slow.set()
        with pytest.raises(ModelNotFoundError):
            await loading

    asyncio.run(run())
