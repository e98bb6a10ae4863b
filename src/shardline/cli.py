"""The ``shardline`` command: ``run`` one node, start a local ``cluster``, ``bench`` it, and
work a running cluster (``nodes``, ``instances``, ``place``, ``delete``, ``models``)."""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from shardline.cluster_commands import DEFAULT_PORT

if TYPE_CHECKING:
    from shardline.local_cluster import LocalCluster
    from shardline.node.runner_processes import Spare

MIN_API_KEY_CHARS = 8
"""The shortest API key a node takes (``shardline run`` and ``cluster`` refuse a shorter one)."""


def peer_address(text: str) -> str:
    """A ``--peers`` entry as ``host:port``: the default port (52415) where it gives none
    (``10.0.0.2``, ``[fd00::2]``; trial 5: ``10.77.0.1`` alone was polled at port 80).
    Other entries (with a port, or an IPv6 address without brackets) as given."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        return f"{text}:{DEFAULT_PORT}"
    return text if ":" in text else f"{text}:{DEFAULT_PORT}"


def device_name(text: str) -> str:
    """A ``--device`` (argparse type): ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps``.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    from shardline.node.profile import DEVICE_RE

    if not DEVICE_RE.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: auto, cpu, cuda, cuda:N or mps")
    return text


def _run(args: argparse.Namespace) -> int:
    """``shardline run``: check the arguments, then serve one node until interrupted.
    Returns the exit status (2: the arguments were refused, the message on stderr)."""
    # The node computes nothing with torch (its runners and measuring children do), but
    # transformers, which its tokenizers use, imports torch where it is installed: 1.7 s
    # of CPU beside the runners' start-up and ~200 MB held for nothing. A None in
    # sys.modules makes "import torch" fail here, so transformers takes its torch-free path
    # (https://docs.python.org/3/reference/import.html#the-module-cache).
    if "torch" not in sys.modules:  # (a process that has it, e.g. a test's, keeps it)
        sys.modules["torch"] = None  # type: ignore[assignment]
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch was not found"
    from shardline.node import identity

    api_key = args.api_key or os.environ.get("SHARDLINE_API_KEY") or None
    bind = args.bind or args.host
    model_dirs = [Path(d).expanduser() for d in args.model_dir or []]
    problem = _run_problem(args, api_key, bind, model_dirs)
    if problem:
        print(f"shardline run: {problem}", file=sys.stderr)
        return 2
    data_dir = Path(args.data_dir) if args.data_dir else identity.default_data_dir()
    try:
        key, generated = identity.cluster_key(data_dir, args.cluster_key or os.environ.get("SHARDLINE_CLUSTER_KEY"))
    except ValueError as exc:
        print(f"shardline run: {exc}", file=sys.stderr)
        return 2
    if generated:
        print(
            f"shardline: new cluster key {key}\n  (saved in {data_dir}; start the other nodes with "
            f"--cluster-key {key})",
            flush=True,
        )
    first_spare = None if args.no_spare_runner else _start_first_spare()
    _serve_node(args, api_key, data_dir, key, model_dirs, first_spare)
    return 0


def _run_problem(args: argparse.Namespace, api_key: str | None, bind: str, model_dirs: list[Path]) -> str | None:
    """Why ``run`` refuses its arguments (no API key on an address other machines reach, a
    short key, a --model-dir that is no directory, an address not this machine's, a port in
    use), else None; warns of serving without a key on such an address."""
    from shardline.runner.rendezvous import is_loopback

    if api_key is None and not args.no_api_key and not is_loopback(bind):
        return (
            f"listening on {bind}, which other machines reach, needs an API key: "
            f"give --api-key (or SHARDLINE_API_KEY), or --no-api-key to serve anyone who can "
            f"reach it"
        )
    if api_key is not None and len(api_key) < MIN_API_KEY_CHARS:
        return f"the API key must be at least {MIN_API_KEY_CHARS} characters"
    if api_key is None and not is_loopback(bind):
        logging.getLogger("shardline").warning(
            "listening on %s without an API key (--no-api-key): anyone who can reach it can "
            "use its models and its cluster API",
            bind,
        )
    not_dirs = [str(d) for d in model_dirs if not d.is_dir()]
    if not_dirs:
        return f"--model-dir {', '.join(not_dirs)}: not a directory"
    from shardline.local_cluster import address_is_here, ports_in_use

    if not address_is_here(bind):
        return f"{bind} is not an address of this machine: give --host (or --bind) one of its addresses"
    if ports_in_use([args.port], bind):
        return f"port {args.port} on {bind} is in use (another node?): give --port"
    return None


def _start_first_spare() -> Spare:
    """A spare runner started now, before the node's own imports (~1 s), so that the
    runner's (torch: ~1.7 s) run beside them rather than after; killed at exit."""
    from shardline.node.runner_processes import Spare, spawn_runner

    first_spare = Spare(*spawn_runner())
    # in its own session, so gone with this process only if killed (an interrupt
    # during the node's imports that follow left it to notice its closed pipe, seconds later)
    atexit.register(_kill_if_running, first_spare.process)
    return first_spare


def _serve_node(
    args: argparse.Namespace,
    api_key: str | None,
    data_dir: Path,
    key: str,
    model_dirs: list[Path],
    first_spare: Spare | None,
) -> None:
    """Build the node of ``run``'s arguments and serve its HTTP API until Ctrl-C or
    SIGTERM."""
    import uvicorn

    from shardline.api.app import create_app
    from shardline.api.header_timeout import header_timeout_protocol
    from shardline.api.http_guard import GuardConfig, local_names
    from shardline.models.store import ModelStore
    from shardline.node import identity
    from shardline.node.node import Node

    guard = GuardConfig(
        api_key=api_key,
        allowed_hosts=local_names([args.host, *args.allowed_host]),
        cors_origins=frozenset(args.cors_origin),
    )
    node = Node(
        host=args.host,
        port=args.port,
        peers=[peer_address(p) for p in (args.peers or "").split(",") if p.strip()],
        node_id=args.node_id or identity.node_id(data_dir),
        cluster_key=key,
        store=ModelStore(data_dir / "models"),
        memory_limit_bytes=args.memory_limit,
        runner_threads=args.runner_threads,
        device=args.device,
        exit_with_parent=args.exit_with_parent,
        watchdog_s=args.watchdog,
        progress_timeout_s=args.progress_timeout,
        mdns=not args.no_mdns,
        state_path=data_dir / "cluster-state.json",
        rejoin=not args.no_rejoin,
        model_dirs=model_dirs,
        max_waiting=args.max_waiting,
        spare_runner=not args.no_spare_runner,
        first_spare=first_spare,
    )
    logging.getLogger(__name__).info("node %s on %s", node.node_id, node.address)

    class NodeServer(uvicorn.Server):
        """uvicorn's server, which on Ctrl-C or SIGTERM first tells the node (its open
        streams end, so the server need not wait for them while the peers stop)."""

        def handle_exit(self, sig, frame) -> None:
            node.stopping()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        create_app(node, guard, max_body_bytes=args.max_body_bytes, heartbeat_s=args.stream_heartbeat),
        host=args.bind or args.host,
        port=args.port,
        log_level="warning",
        http=header_timeout_protocol(args.header_timeout),
    )
    access = logging.getLogger("uvicorn.access")  # its 4xx and 5xx lines: what an operator looks for
    access.setLevel(logging.INFO)
    access.addFilter(error_response_line)
    server = NodeServer(config)
    try:
        server.run()
    except KeyboardInterrupt:  # the signal uvicorn raises again once it has stopped (as uvicorn.run)
        pass


def error_response_line(record: logging.LogRecord) -> bool:
    """Whether a line of uvicorn's access log (``client - "METHOD path HTTP/v" status``) is
    kept: an error's (status 400 or more). Every request's would bury the rest: the
    dashboard asks for the cluster's state every second."""
    args = record.args
    return isinstance(args, tuple) and len(args) == 5 and isinstance(args[4], int) and args[4] >= 400


def _kill_if_running(process: subprocess.Popen) -> None:
    """Kill ``process`` and wait for it, unless it has exited."""
    if process.poll() is None:
        process.kill()
        process.wait()


def _non_negative_int(text: str) -> int:
    """An int of at least 0 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 0")
    return value


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _print_serving(args: argparse.Namespace, cluster: LocalCluster, instance: dict) -> None:
    """What ``shardline cluster`` prints once its model serves: the placement, where the API
    and the dashboard are, and a first request to try."""
    import httpx

    from shardline.cluster_commands import rank_share

    url = cluster.url(0)
    ranges = ", ".join(f"port {r['address'].rsplit(':', 1)[-1]} {rank_share(r)}" for r in instance["ranks"])
    print(
        f"\nshardline: {args.nodes}-node cluster serving {instance['model_id']} "
        f"({instance['sharding']} on {len(instance['ranks'])} node(s))"
    )
    print(f"  per node: {ranges}")
    if len(instance["ranks"]) < args.nodes:
        print(
            f"  ({len(instance['ranks'])} of the {args.nodes} nodes: --sharding {args.sharding} "
            "predicted that placement fastest; `shardline place --preview` lists the others, "
            "and --sharding pipeline places on every node)"
        )
    if cluster.memory_limit_bytes is not None:
        print(
            f"  each node offers models up to {cluster.memory_limit_bytes / 1e9:.2f} GB"
            + (
                ""
                if args.memory_limit is not None
                else f" (the machine's available memory / {args.nodes}; --memory-limit sets it)"
            )
        )
    try:
        others = [i for i in cluster.instances() if i.get("instance_id") != instance.get("instance_id")]
    except httpx.HTTPError:  # only a note: the cluster serves either way
        others = []
    if others:  # the cluster's state on these ports keeps every instance placed before
        print(
            "  also serving, kept from an earlier run on these ports: "
            + ", ".join(f"{i['model_id']} (instance {i['instance_id']})" for i in others)
            + f"; `shardline delete ID --url {url}` removes one"
        )
    print(f"  API: {url}/v1  (any node: ports {args.port}-{args.port + args.nodes - 1})")
    print(f"  dashboard: {url}/")
    print("  try:")
    auth = ' -H "Authorization: Bearer $SHARDLINE_API_KEY"' if cluster.api_key else ""  # the shell expands it
    if cluster.api_key and not os.environ.get("SHARDLINE_API_KEY"):
        print("  (the API key given with --api-key: set SHARDLINE_API_KEY to it in your shell first)")
    print(f"    curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\")
    print(
        f'      -d \'{{"model": "{instance["model_id"]}", "max_tokens": 64, '
        f'"temperature": 0, "messages": '
        f'[{{"role": "user", "content": "What is the name of the capital of France?"}}]}}\''
    )


def _cluster(args: argparse.Namespace) -> int:
    from shardline.local_cluster import LocalCluster, LocalClusterError, model_dirs_for

    api_key = args.api_key or os.environ.get("SHARDLINE_API_KEY") or None
    if api_key is not None and len(api_key) < MIN_API_KEY_CHARS:
        print(f"shardline cluster: the API key must be at least {MIN_API_KEY_CHARS} characters", file=sys.stderr)
        return 2
    cluster = LocalCluster(
        nodes=args.nodes,
        base_port=args.port,
        runner_threads=args.runner_threads,
        api_key=api_key,
        model_dirs=model_dirs_for(args.model) + (args.model_dir or []),
        spare_runners=True,
        memory_limit_bytes=args.memory_limit,
        device=args.device,
    )
    # SIGTERM and SIGINT stop the nodes (they run in their own sessions); SIGINT is set
    # explicitly because a shell starts background jobs with it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cluster.start()
        instance = cluster.serve(args.model, args.sharding)
    except (LocalClusterError, KeyboardInterrupt) as exc:
        cluster.stop()
        print(f"shardline cluster: {str(exc) or 'interrupted'}", file=sys.stderr)
        return 1
    _print_serving(args, cluster, instance)
    print("  Ctrl-C stops the cluster.", flush=True)
    try:
        for line in cluster.supervise(restart=args.restart):
            print(f"shardline cluster: {line}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()
    return 1  # every node exited on its own


def _bench(args: argparse.Namespace) -> int:
    from shardline.bench.command import main as bench_main

    return bench_main(args)


class _Version(argparse.Action):
    """``--version``: read from the installed package's metadata when asked (importing
    importlib.metadata costs every process ~40 ms otherwise)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import importlib.metadata

        print(f"shardline {importlib.metadata.version('shardline')}")  # stdout, as argparse's
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The ``shardline`` command line: ``run``, ``cluster``, ``bench`` and the cluster
    client's commands (:func:`shardline.cluster_commands.add_commands`)."""
    parser = argparse.ArgumentParser(prog="shardline", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_cluster(sub)

    bench = sub.add_parser(
        "bench", help="measure prefill and decode tokens/s and TTFT; --against URL: side by side with another server"
    )
    from shardline.bench.arguments import add_arguments

    add_arguments(bench)
    bench.set_defaults(func=_bench)

    from shardline.cluster_commands import add_commands

    add_commands(sub, DEFAULT_PORT)
    return parser


def _add_run(sub: argparse._SubParsersAction) -> None:
    """The ``run`` command: one node."""
    from shardline.cluster_commands import byte_size

    run = sub.add_parser("run", help="run one node")
    run.add_argument("--host", default="127.0.0.1", help="address other nodes reach this node at")
    run.add_argument("--bind", default=None, help="address to listen on (default: --host)")
    run.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port (default %(default)s)")
    run.add_argument("--peers", default="", help="other nodes as host:port,host:port")
    run.add_argument(
        "--node-id", default=None, help="this node's id (default: the one in the data directory, made on first start)"
    )
    run.add_argument(
        "--data-dir",
        default=None,
        help="where the node keeps its id, cluster key and model store (default: $XDG_DATA_HOME/shardline)",
    )
    run.add_argument(
        "--memory-limit",
        type=byte_size,
        default=None,
        help="the most memory this node offers to models, e.g. 8GB or 512MiB (default: all that is available)",
    )
    _add_run_access(run)
    run.add_argument("--runner-threads", type=int, default=0, help="torch threads per runner (0: all cores)")
    run.add_argument(
        "--device",
        type=device_name,
        default="auto",
        help="what the runners compute on: auto (the first CUDA GPU torch sees, else "
        "the CPU), cpu, cuda, cuda:N or mps (default %(default)s)",
    )
    run.add_argument(
        "--watchdog",
        type=float,
        default=10.0,
        help="seconds a runner may go silent before its instance fails (default %(default)s)",
    )
    run.add_argument(
        "--progress-timeout",
        type=float,
        default=60.0,
        help="seconds a runner may wait inside an engine step without progress (a stalled "
        "peer or collective) before its instance fails; must exceed the time of one "
        "prefill chunk (default %(default)s)",
    )
    run.add_argument(
        "--no-spare-runner",
        action="store_true",
        help="start each runner when its rank is placed, rather than keeping one "
        "started ahead with its imports done (it holds ~100 MB while it waits)",
    )
    run.add_argument(
        "--no-rejoin",
        action="store_true",
        help="when this node coordinates, do not place an instance that lost nodes on them again when they return",
    )
    run.add_argument(
        "--no-mdns",
        action="store_true",
        help="do not advertise this node or look for others by mDNS (use --peers only)",
    )
    run.add_argument(
        "--model-dir",
        action="append",
        default=None,
        metavar="DIR",
        help="a directory under which a client of the cluster API may name a local "
        ".gguf file or safetensors directory as a model (repeatable; the model "
        "store is always one; other paths are refused)",
    )
    _add_run_limits(run)
    run.add_argument(
        "--exit-with-parent", action="store_true", help="stop when the process that started this node exits"
    )
    run.set_defaults(func=_run)


def _add_run_access(run: argparse.ArgumentParser) -> None:
    """``run``'s keys and who may reach the node (hosts, web origins)."""
    run.add_argument(
        "--cluster-key",
        default=None,
        help="the cluster's shared secret (default: $SHARDLINE_CLUSTER_KEY, else the saved "
        "one, else a new one, printed at start)",
    )
    run.add_argument(
        "--api-key",
        default=None,
        help="the key API clients must send (Authorization: Bearer, or x-api-key); default "
        "$SHARDLINE_API_KEY. Required when listening on an address other machines "
        "reach, unless --no-api-key",
    )
    run.add_argument(
        "--no-api-key",
        action="store_true",
        help="serve without an API key on a non-loopback address (anyone who reaches "
        "the port can use and change the cluster)",
    )
    run.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name clients may reach this node by (the Host header), besides its "
        "addresses and host name; '*' allows any (repeatable)",
    )
    run.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web origin (e.g. http://localhost:3000) whose pages may call this node "
        "from a browser; '*' allows any (repeatable; default: none but the "
        "node's own dashboard)",
    )


def _add_run_limits(run: argparse.ArgumentParser) -> None:
    """``run``'s bounds on what clients send and wait for."""
    from shardline.api.bounds import DEFAULT_MAX_BODY_BYTES
    from shardline.api.header_timeout import DEFAULT_HEADER_TIMEOUT_S
    from shardline.api.heartbeat import HEARTBEAT_S
    from shardline.cluster_commands import byte_size
    from shardline.node.queue_bound import DEFAULT_MAX_WAITING

    run.add_argument(
        "--max-body-bytes",
        type=byte_size,
        default=DEFAULT_MAX_BODY_BYTES,
        help="the largest request body this node takes, e.g. 16MiB; larger ones get 413 (default %(default)s bytes)",
    )
    run.add_argument(
        "--max-waiting",
        type=_non_negative_int,
        default=DEFAULT_MAX_WAITING,
        help="requests this node lets wait for one instance's batch; more get 429 with "
        "Retry-After (default %(default)s)",
    )
    run.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a client has to send a request's headers before the connection is closed (default %(default)s)",
    )
    run.add_argument(
        "--stream-heartbeat",
        type=float,
        default=HEARTBEAT_S,
        metavar="SECONDS",
        help="seconds a stream waits with nothing to send (a long prompt's prefill) before it "
        "sends its API's keep-alive (default %(default)s)",
    )


def _add_cluster(sub: argparse._SubParsersAction) -> None:
    """The ``cluster`` command: N nodes on 127.0.0.1 and a model across them."""
    from shardline.cluster_commands import byte_size
    from shardline.models.store import DEFAULT_MODEL_ID
    from shardline.placement.ranks import SHARDING_NAMES

    cluster = sub.add_parser("cluster", help="start N nodes on 127.0.0.1 and place a model across them")
    cluster.add_argument("--nodes", type=int, default=3, help="how many nodes (default %(default)s)")
    cluster.add_argument(
        "--sharding",
        default="pipeline",
        choices=("auto", *SHARDING_NAMES),
        help="pipeline: a layer range per node; tensor: heads and MLP columns split "
        "across the nodes; ring: the whole model on every node, long prompts "
        "split across them; expert (mixture-of-experts models): tensor's heads, "
        "whole experts per node; auto: the placement with the best predicted decode "
        "tokens/s (default %(default)s)",
    )
    cluster.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="first node's port; the others follow (default %(default)s)"
    )
    cluster.add_argument("--model", default=DEFAULT_MODEL_ID, help="model id or local path (default %(default)s)")
    cluster.add_argument(
        "--model-dir",
        action="append",
        default=None,
        metavar="DIR",
        help="more directories the nodes take local models from (repeatable; "
        "--model's own directory is passed on by itself)",
    )
    cluster.add_argument("--runner-threads", type=int, default=0, help="torch threads per runner (0: cores / nodes)")
    cluster.add_argument(
        "--device",
        type=device_name,
        default="auto",
        help="what the runners compute on, as for run (default %(default)s)",
    )
    cluster.add_argument(
        "--memory-limit",
        type=byte_size,
        default=None,
        help="the most memory each node offers to models, e.g. 600MB (default: the "
        "memory available at start, split evenly between the nodes)",
    )
    cluster.add_argument(
        "--api-key",
        default=None,
        help="an API key the nodes require of clients (default: $SHARDLINE_API_KEY, "
        "else none: the nodes listen on 127.0.0.1 only)",
    )
    cluster.add_argument(
        "--restart",
        action="store_true",
        help="start a node that exits again (same port, id and data directory); without it the others keep serving",
    )
    cluster.set_defaults(func=_cluster)


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subcommand's own parser (its error shows its usage, not the top level's)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = _command_parser(parser, args.command)
    if args.command == "run" and not args.header_timeout > 0:
        command.error("--header-timeout must be above 0 seconds")
    if args.command == "place" and not args.timeout > 0:
        command.error("--timeout must be above 0 seconds")
    if args.command in ("run", "cluster", "bench"):
        nodes = getattr(args, "nodes", 1)
        if nodes < 1:
            command.error("--nodes must be at least 1")
        if not 1 <= args.port or args.port + nodes - 1 > 65535:
            command.error(
                "--port must lie in 1-65535"
                if args.command == "run"
                else "ports must lie in 1-65535 (--port, plus one per extra node)"
            )
    if args.command in ("run", "cluster"):
        from shardline.node.profile import device_problem

        problem = device_problem(args.device)
        if problem:
            print(f"shardline {args.command}: --device {args.device}: {problem}", file=sys.stderr)
            return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # one line, not the traceback of whatever was importing
        print(f"shardline {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
