"""N nodes on 127.0.0.1, each its own ``shardline run`` process, for ``shardline cluster``,
the benchmark and the tests. The nodes talk only over the network, as on separate machines.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from shardline.cluster_commands import api_key_headers
from shardline.node.identity import cluster_key, default_data_dir
from shardline.runner.rendezvous import bare_address

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

KEPT_REPLACE_S = 20.0
"""How long :meth:`LocalCluster.serve` waits for a kept instance that failed with its old
ranks to be placed again (the coordinator waits ``down_after_s + 1``, 6 s by default)."""


def model_dirs_for(model: str | None) -> list[str]:
    """The ``--model-dir`` a local cluster's nodes need to take in ``model`` by its path:
    a ``.gguf`` file's directory, or a safetensors directory itself (resolved); none for a
    model id (a name that neither looks like a path nor exists)."""
    from shardline.models.store import looks_like_path

    if model is None:
        return []
    path = Path(model).expanduser()
    if not (looks_like_path(model) or path.exists()):
        return []
    real = path.resolve()
    return [str(real if real.is_dir() else real.parent)]


POLL_S = 0.1
"""How often the launcher asks the nodes whether the cluster formed and the model serves."""

SHARED_SPIN_COUNT = "10000"
"""``GOMP_SPINCOUNT`` of the runners of a local cluster of several nodes (one machine's
cores for all its ranks): how long an OpenMP worker that finished its part spins before it
sleeps (libgomp's default, 300,000 turns of a pause loop, kept it spinning for
milliseconds). A pipeline stage that has handed its micro-batch on would keep the cores
the next stage needs: a 1.5B Q4_K_M model on 3 nodes of a 2-vCPU VM with 2 runner
threads each decoded 9.1 tokens/s with the default and 10.8 with this (one node 12.4-13.6;
1 thread each, the default split there, 5.7). A single node keeps libgomp's default:
with the spin bounded, one node's 8-sequence decode of SmolLM2 lost ~15%."""


def node_environment(base: dict[str, str], nodes: int, cluster_key: str, api_key: str | None) -> dict[str, str]:
    """The environment of a local cluster's node (its runners inherit it): ``base`` with
    the cluster's key, the API key where one is set, and :data:`SHARED_SPIN_COUNT` where
    ``nodes`` share the machine and ``base`` sets no ``GOMP_SPINCOUNT`` of its own."""
    env = dict(base, SHARDLINE_CLUSTER_KEY=cluster_key)
    if api_key:
        env["SHARDLINE_API_KEY"] = api_key
    if nodes > 1:
        env.setdefault("GOMP_SPINCOUNT", SHARED_SPIN_COUNT)
    return env


def node_memory_limit(available_bytes: int, nodes: int, asked: int | None) -> int | None:
    """Bytes each node of a local cluster offers to models: ``asked`` (``--memory-limit``)
    where given; else, where several nodes share the machine, an even split of the memory
    it has available at start (each node would offer all of it, and placement could
    commit it once per node); a single node offers what is available as it goes (None)."""
    if asked is not None:
        return asked
    return available_bytes // nodes if nodes > 1 else None


def ports_in_use(ports: Iterable[int], host: str = "127.0.0.1") -> list[int]:
    """The TCP ports of ``ports`` that something listens on at ``host``: a bind fails there
    (with ``SO_REUSEADDR``, as uvicorn binds, so a port whose connections are only closing
    counts as free)."""
    busy = []
    for port in ports:
        try:  # the address family of host (an IPv6 address binds an AF_INET6 socket)
            family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        except OSError:
            continue  # not an address here: the server's own bind says what is wrong
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError:
                busy.append(port)
    return busy


def address_is_here(host: str) -> bool:
    """Whether this machine can listen on ``host`` (an address or a name): a socket binds
    to it at a free port. False where the bind fails with ``EADDRNOTAVAIL`` (an address of
    another machine) or the name does not resolve; True on any other outcome (the server's
    own bind then says what is wrong)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(bare_address(host), 0, type=socket.SOCK_STREAM)[0]
    except OSError:
        return False
    with socket.socket(family, kind, proto) as probe:
        try:
            probe.bind(address)
        except OSError as exc:
            return exc.errno != errno.EADDRNOTAVAIL
    return True


def table_model_id(model: str | None) -> str:
    """The id the instance table names ``model`` by: the default model's id for none, a
    local path's default id (a ``.gguf`` file's stem, a directory's name: the id the nodes
    add it under), else ``model`` itself (a model id)."""
    from shardline.models.store import DEFAULT_MODEL_ID, local_model_id

    if model is None:
        return DEFAULT_MODEL_ID
    return local_model_id(Path(model).expanduser()) if model_dirs_for(model) else model


def views_formed(views: list[dict]) -> bool:
    """Whether nodes whose ``GET /cluster/nodes`` answers are ``views`` have formed a
    cluster: each sees all of them live, they hold one epoch from the coordinator they agree
    on, and that coordinator, where it is one of them, acts in its term (a node restarted
    with its table on disk holds its last term's epoch, naming itself, before it has
    settled and started a new term; placement asked of it then is refused)."""
    live = [sum(1 for n in v["nodes"] if n["live"]) for v in views]
    agreed = {(v["coordinator"], tuple(sorted(v["epoch"].items()))) for v in views}
    if not (
        all(c == len(views) for c in live)
        and len(agreed) == 1
        and views[0]["epoch"]["coordinator"] == views[0]["coordinator"]
    ):
        return False
    return all(v["acting"] for v in views if v["node_id"] == v["coordinator"])


def kept_instances(instances: list[dict], model_id: str, sharding: str, nodes: int) -> tuple[list[dict], list[dict]]:
    """Of a table's instances (``GET /cluster/instances``' entries), those of ``model_id``
    that serve it as asked of a cluster of ``nodes`` nodes (any for ``"auto"``; for a
    sharding named, that sharding on every node, as :meth:`LocalCluster.place` puts
    it), and the other instances of ``model_id`` (placed otherwise: by a run that asked
    for another sharding, or again on fewer nodes by Ollama's load on demand after a
    ``keep_alive: 0``; the one asked now replaces them). Instances of other models are
    in neither."""
    mine = [i for i in instances if i["model_id"] == model_id]
    asked = [i for i in mine if sharding == "auto" or (i["sharding"] == sharding and len(i["ranks"]) == nodes)]
    return asked, [i for i in mine if i not in asked]


class LocalClusterError(RuntimeError):
    """The local cluster could not start, or its model could not be placed."""


class LocalCluster:
    """Start, place a model on, and stop a cluster of local node processes.

    Args:
        nodes: how many nodes.
        base_port: node i listens on ``base_port + i``.
        runner_threads: torch threads per runner; 0 gives each node cores / nodes.
        device: what the nodes' runners compute on (``shardline run --device``).
        log_dir: where each node's output goes (``node-i.log``); None: inherit stdout.
        data_dir: node i keeps its id in ``data_dir/node-i``; the cluster's key is in
            ``data_dir/cluster-key`` (default: ``local-cluster/<base_port>`` in shardline's
            data directory, so a restarted local cluster keeps its ids, and two on other
            ports do not share them). Node i's model store is ``data_dir/node-i/models``.
        node_args: more ``shardline run`` arguments for some nodes, by index (e.g.
            ``{1: ["--memory-limit", "200MB"]}``).
        api_key: the API key the nodes require (default: ``$SHARDLINE_API_KEY``, else none:
            the nodes listen on 127.0.0.1 only); the launcher's own requests send it.
        model_dirs: directories every node takes local models from (``--model-dir``): a
            model placed by its local path must lie under one (see :func:`model_dirs_for`).
        spare_runners: each node keeps a runner started ahead (``shardline run``'s
            default); off (``--no-spare-runner``) unless asked, so that every runner
            process under a node is a rank's.
        memory_limit_bytes: the most memory each node offers to models; None: an even
            share of what the machine has available (:func:`node_memory_limit`), then
            in :attr:`memory_limit_bytes`.
    """

    def __init__(
        self,
        nodes: int,
        base_port: int,
        runner_threads: int = 0,
        log_dir: str | None = None,
        data_dir: str | None = None,
        node_args: dict[int, list[str]] | None = None,
        api_key: str | None = None,
        model_dirs: Sequence[str | Path] | None = None,
        spare_runners: bool = False,
        memory_limit_bytes: int | None = None,
        device: str = "auto",
    ) -> None:
        import psutil

        self.data_dir = Path(data_dir) if data_dir else default_data_dir() / "local-cluster" / str(base_port)
        self.cluster_key, _ = cluster_key(self.data_dir)
        self.api_key = api_key or os.environ.get("SHARDLINE_API_KEY") or None
        self.headers = api_key_headers(self.api_key)
        self.n = nodes
        self.base_port = base_port
        self.runner_threads = runner_threads or max(1, (os.cpu_count() or 1) // nodes)
        self.log_dir = log_dir
        self.node_args = node_args or {}
        self.model_dirs = [str(d) for d in model_dirs or []]
        self.spare_runners = spare_runners
        self.device = device
        self.memory_limit_bytes = node_memory_limit(int(psutil.virtual_memory().available), nodes, memory_limit_bytes)
        self.procs: list[subprocess.Popen | None] = []
        self.stopping = False
        self.instance: dict | None = None

    @cached_property
    def http(self) -> httpx.Client:
        """The one client of every request (made on first use: httpx's import would delay
        the nodes' start). httpx.get() makes a client and TLS context per call, ~28 ms of
        CPU: polling every 0.1 s took a quarter of a core from the nodes starting beside it."""
        import httpx

        return httpx.Client(headers=self.headers, timeout=5)

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.base_port + i}"

    def node_command(self, i: int) -> list[str]:
        peers = ",".join(f"127.0.0.1:{self.base_port + j}" for j in range(self.n) if j != i)
        return [
            sys.executable,
            "-m",
            "shardline.cli",
            "run",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.base_port + i),
            "--peers",
            peers,
            "--runner-threads",
            str(self.runner_threads),
            "--device",
            self.device,
            "--exit-with-parent",
            "--no-mdns",
            "--data-dir",
            str(self.node_data_dir(i)),
            *([] if self.spare_runners else ["--no-spare-runner"]),
            *([] if self.memory_limit_bytes is None else ["--memory-limit", str(self.memory_limit_bytes)]),
            *(arg for d in self.model_dirs for arg in ("--model-dir", d)),
            *self.node_args.get(i, []),
        ]

    def node_data_dir(self, i: int) -> Path:
        """Node i's data directory (its id, and its model store in ``models/``)."""
        return self.data_dir / f"node-{i}"

    def start_node(self, i: int) -> None:
        out = None
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"node-{i}.log"), "ab")
        env = node_environment(dict(os.environ), self.n, self.cluster_key, self.api_key)
        proc = subprocess.Popen(
            self.node_command(i), stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True, env=env
        )
        if i < len(self.procs):
            self.procs[i] = proc
        else:
            self.procs.append(proc)

    def start(self, timeout_s: float = 60.0) -> None:
        """Start every node and wait until the cluster has formed (:meth:`formed`).

        Raises:
            LocalClusterError: a port is in use (else a running cluster on them would
                answer for the new nodes, which exit), a node exited, or the cluster did
                not form in time.
        """
        busy = ports_in_use(range(self.base_port, self.base_port + self.n))
        if busy:
            raise LocalClusterError(
                f"port(s) {', '.join(map(str, busy))} on 127.0.0.1 are in use (another shardline "
                f"cluster?): stop what listens there or pass another --port"
            )
        for i in range(self.n):
            self.start_node(i)
        self.wait_formed(range(self.n), timeout_s)

    def formed(self, indices) -> bool:
        """Whether the nodes ``indices`` have formed a cluster (:func:`views_formed` of their
        ``GET /cluster/nodes``)."""
        import httpx

        try:
            views = [self.http.get(f"{self.url(i)}/cluster/nodes", timeout=2).json() for i in indices]
        except (httpx.HTTPError, ValueError):
            return False
        return views_formed(views)

    def wait_formed(self, indices, timeout_s: float = 60.0) -> None:
        """Wait until :meth:`formed`.

        Raises:
            LocalClusterError: a node exited or the cluster did not form in time.
        """
        indices = list(indices)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            self._check_alive()
            if self.formed(indices):
                return
            time.sleep(POLL_S)
        raise LocalClusterError(f"the nodes {indices} did not form a cluster within {timeout_s:.0f} s")

    def _check_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc is not None and proc.poll() is not None:
                raise LocalClusterError(f"node {i} exited with code {proc.returncode}")

    def place(
        self,
        model: str | None,
        sharding: str = "pipeline",
        timeout_s: float = 300.0,
        on: list[int] | None = None,
        **options,
    ) -> dict:
        """Place ``model`` on the nodes ``on`` (default all; the first is rank 0) and wait
        until every node sees it ready.

        Raises:
            LocalClusterError: placement was refused or the instance failed or timed out.
        """
        indices = range(self.n) if on is None else on
        nodes = [self.http.get(f"{self.url(i)}/health", timeout=5).json()["node_id"] for i in indices]
        body = {"model": model, "sharding": sharding, "nodes": nodes, **options}
        response = self.http.post(f"{self.url(0)}/cluster/instances", json=body, timeout=120)
        if response.status_code != 201:
            from shardline.api.errors import error_message

            raise LocalClusterError(f"placement refused: {error_message(response.json()) or response.text}")
        instance_id = response.json()["instance_id"]
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            self._check_alive()
            instances = {
                i["instance_id"]: i
                for i in self.http.get(f"{self.url(0)}/cluster/instances", timeout=5).json()["instances"]
            }
            inst = instances.get(instance_id)
            if inst is not None and inst["status"] == "ready":
                if self._all_nodes_ready(instance_id):
                    self.instance = inst
                    return inst
            if inst is not None and inst["status"] == "failed":
                raise LocalClusterError(f"instance failed: {inst['error']}")
            time.sleep(POLL_S)
        raise LocalClusterError(f"instance {instance_id} was not ready within {timeout_s:g} s")

    def instances(self) -> list[dict]:
        """The instance table, as node 0 sees it."""
        return self.http.get(f"{self.url(0)}/cluster/instances", timeout=5).json()["instances"]

    def serve(self, model: str | None, sharding: str = "pipeline", timeout_s: float = 300.0, **options) -> dict:
        """The instance serving ``model`` with ``sharding``, placed once across restarts.

        The nodes keep their instance table on disk: after a restart the coordinator finds
        a kept instance's ranks gone, fails it and places it again. Such an instance
        (:func:`kept_instances`) is waited for instead of placing a second copy beside
        it, and one of the model placed otherwise (another sharding, or fewer nodes) is
        deleted; one still failed after :data:`KEPT_REPLACE_S`
        (not placed again) is deleted and the model placed anew (:meth:`place`, with
        ``options``).

        Raises:
            LocalClusterError: placement was refused or the instance failed or timed out.
        """
        model_id = table_model_id(model)
        deadline = time.time() + timeout_s
        kept: list[dict] = []
        replaced_by = time.time() + KEPT_REPLACE_S
        while time.time() < deadline:
            self._check_alive()
            kept, other = kept_instances(self.instances(), model_id, sharding, self.n)
            if other:  # placed otherwise before: the one asked now replaces it
                log.info(
                    "deleting the kept %s of %s: --sharding %s on %d nodes replaces it",
                    ", ".join(
                        f"{i['sharding']} instance {i['instance_id']} on {len(i['ranks'])} node(s)" for i in other
                    ),
                    model_id,
                    sharding,
                    self.n,
                )
                self.clear([i["instance_id"] for i in other])
                # the table again: the coordinator may have committed one's replacement
                # (placed again after the restart) just before the delete, and that one
                # stays unless deleted too
                time.sleep(POLL_S)
                continue
            for inst in kept:
                if inst["status"] == "ready" and self._all_nodes_ready(inst["instance_id"]):
                    # copies beside it (kept by runs whose nodes stopped before a delete
                    # landed) hold a share of memory each and serve nothing asked of them
                    self.clear([i["instance_id"] for i in kept if i is not inst])
                    self.instance = inst
                    return inst
            if not kept or (all(i["status"] == "failed" for i in kept) and time.time() > replaced_by):
                break
            time.sleep(POLL_S)
        else:
            raise LocalClusterError(f"the kept instance of {model_id} was not ready within {timeout_s:.0f} s")
        self.clear([i["instance_id"] for i in kept])
        return self.place(model, sharding, max(1.0, deadline - time.time()), **options)

    def clear(self, instance_ids: list[str] | None = None, timeout_s: float = 30.0) -> None:
        """Delete the instances ``instance_ids`` (default: every instance in the table, until
        the table reads empty: a kept instance the coordinator places again after a restart
        gets a new id, and one placed just before its old id's delete stays unless deleted
        in its turn; each bench run left one more copy of its model loaded before)."""
        if instance_ids is not None:
            for instance_id in instance_ids:
                self.http.delete(f"{self.url(0)}/cluster/instances/{instance_id}", timeout=30)
            return
        deadline = time.time() + timeout_s
        while (ids := [i["instance_id"] for i in self.instances()]) and time.time() < deadline:
            self.clear(ids)
            time.sleep(POLL_S)

    def _all_nodes_ready(self, instance_id: str) -> bool:
        import httpx

        for i in range(self.n):
            try:
                instances = self.http.get(f"{self.url(i)}/cluster/instances", timeout=5).json()["instances"]
            except httpx.HTTPError:
                return False
            if not any(x["instance_id"] == instance_id and x["status"] == "ready" for x in instances):
                return False
        return True

    def supervise(self, restart: bool = False, poll_s: float = 0.5) -> Iterator[str]:
        """Watch the nodes until every one has exited (or Ctrl-C): yields a line for each
        node that exits and, with ``restart``, starts it again (same port, id and data
        directory, as a service manager would) and yields that too. The others keep
        serving either way; the last node's exit is reported too (its line says none is
        left) before this ends."""
        while not self.stopping and (any(p is not None for p in self.procs) or restart):
            for i, proc in enumerate(self.procs):
                if self.stopping or proc is None or proc.poll() is None:
                    continue
                exited = f"node {i} ({self.url(i)}) exited with code {proc.returncode}"
                if restart:
                    yield exited
                    self.start_node(i)
                    yield f"node {i} started again"
                    continue
                self.procs[i] = None
                left = any(p is not None and p.poll() is None for p in self.procs)
                yield exited + ("; the others keep serving" if left else "; no node is left")
            time.sleep(poll_s)

    def stop(self) -> None:
        """Stop every node; each node kills its runners on the way out (and
        :meth:`supervise` ends instead of starting them again)."""
        self.stopping = True
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            if proc is None:
                continue
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
